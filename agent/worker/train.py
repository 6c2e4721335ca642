"""The worker's main loop: join the world, build the stage, train, checkpoint, evaluate.

Owns the order of one optimizer step across ranks (pipeline, data-parallel averaging, global
clipping, AdamW) and writing the progress events a supervisor reads (their schema is
`dtfm.core.events`). Everything it needs comes from one `dtfm.v1.Assignment`; the only other
inputs are a few `DTFM_*` environment variables (thread count, collective timeout, and the
fault-injection seam tests use).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from agent.worker import checkpoint, deadline, errors, globalnorm, lora
from agent.worker.compress import make_codec
from agent.worker.data import Position, Sampler, load_splits, replica_slice, val_batches
from agent.worker.data_parallel import GradAverager
from agent.worker.deadline import Deadline, measure_flops
from agent.worker.delayed import DelayedSteps, Versions
from agent.worker.device import autocast_dtype, pick_device
from agent.worker.fault import Fault
from agent.worker.hfload import check_init_dir
from agent.worker.nonfinite import NonFinitePeerValue
from agent.worker.optim import clip_, local_sq_norm, lr_at, make_optimizer, set_lr
from agent.worker.outer import OuterSync, SyncResult, average_moments
from agent.worker.pipeline import Pipeline, Timings
from agent.worker.replicacheck import ReplicaChecks
from agent.worker.slowdown import compute_slowdown
from agent.worker.stage import Stage
from agent.worker.transport import resume
from agent.worker.world import DTFM, join
from dtfm.core.events import (
    DoneEvent,
    ErrorEvent,
    EvalEvent,
    ProgressEvent,
    StepEvent,
    WorkerEnv,
    encode_event,
    failed_at,
)
from dtfm.core.hfdir import model_tokenizer_hash
from dtfm.core.layout import Layout, layer_ranges
from dtfm.core.requests import CheckpointRequests
from dtfm.core.rounds import round_of
from dtfm.core.spec import ModelSpec, TrainConfig
from dtfm.core.verify import resolve
from protos.dtfm.v1 import common_pb2

log = logging.getLogger(__name__)

ENV_TIMEOUT = WorkerEnv.TIMEOUT  # the ceiling of any wait (deadline.py decides below it)
ENV_THREADS = WorkerEnv.THREADS  # torch intra-op threads per worker
class Progress:
    """One JSON line per event, appended and flushed (a file, or stdout).

    Flushed at once because the supervisor tails the file while the worker runs, and a
    worker that dies must leave every event it reported behind.
    """

    def __init__(self, path: str | None) -> None:
        self._own = path is not None
        self._f: IO[str] = open(path, "a", encoding="utf-8") if path else sys.stdout  # noqa: SIM115

    def emit(self, event: ProgressEvent) -> None:
        self._f.write(encode_event(event) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._own:
            self._f.close()


class Worker:
    """One rank of a training job."""

    def __init__(self, a: common_pb2.Assignment, progress: Progress,
                 requests: CheckpointRequests | None = None) -> None:
        self.a, self.progress = a, progress
        # extra checkpoints the agent asks for while this worker trains (dtfm.core.requests)
        self.requests = requests or CheckpointRequests(None)
        self._checkpointed = 0  # the newest step this run checkpointed, for step events
        self._wanted = False  # a checkpoint fell due inside this round (local steps: at its end)
        self.at_step = 0  # the step it trains (or checkpoints, evaluates): its error event's
        self.spec = ModelSpec.from_proto(a.model)
        self.cfg = TrainConfig.from_proto(a.train)
        self.cfg.validate(a.replicas)
        self.layout = Layout(a.stages, a.replicas)
        self.rank = a.rank
        if self.layout.coords(self.rank) != (a.stage, a.replica):
            raise ValueError(
                f"assignment rank {a.rank} is (stage, replica) {self.layout.coords(a.rank)} "
                f"in a {a.stages}x{a.replicas} layout, not ({a.stage}, {a.replica})"
            )
        self._check_layers(a)
        self.device = pick_device(a.backend or "gloo", self.rank, a.data_plane.gpu)
        self.deadline = self._deadline()
        self.amp = autocast_dtype(self.cfg.dtype, self.device)
        self.fault = Fault.from_env()
        # this rank's link codecs (pipeline prev, next, data-parallel): a bad name is a config error
        seed = hash((self.cfg.seed, self.rank))  # int4h's stochastic rounding, per rank
        self.codecs = (make_codec(a.pp_compress_prev, seed), make_codec(a.pp_compress_next, seed),
                       make_codec(a.dp_compress))
        self.phase = errors.JOIN
        self.ckpt = checkpoint.locate(self.cfg.checkpoint_dir, a.job_id,
                                      self.cfg.checkpoint_every)
        self._resumed = -1  # the checkpoint step this run resumed after, once known
        self.outer: OuterSync | None = None  # with --sync-every > 1 (`_build_comm`)
        self._held_figures: dict[str, float] = {}  # --pipeline-delay: not yet in an event
        self._moments_averager: GradAverager | None = None

    def _deadline(self) -> Deadline:
        """How long each wait may block (`deadline.py`): a start-up budget sized by the model,
        the layer split and this device's measured speed, then a multiple of the measured step
        time; DTFM_TIMEOUT_S is the ceiling."""
        a, spec = self.a, self.spec
        ranges = layer_ranges(spec.n_layers, a.stages, list(a.layer_splits) or None)
        ranges.append((a.layer_begin, a.layer_end))  # without splits, the others are a guess
        flops = measure_flops(self.device) / compute_slowdown()
        dl = deadline.for_stages(
            spec, ranges, self.cfg.global_batch // a.replicas * spec.seq_len, flops,
            deadline.operator_ceiling(os.environ.get(ENV_TIMEOUT)),
            # a pair that moves to its relay stops traffic the ranks past it wait for
            resume.MEND_S if a.backend == DTFM else deadline.Policy.floor_s,
        )
        log.info("rank %d: collectives and pipeline receives may block %s until steps are "
                 "measured; ceiling %g s", self.rank, dl.current().why, dl.policy.ceiling_s)
        return dl

    def _check_layers(self, a: common_pb2.Assignment) -> None:
        """The stage's layer range must agree with the splits (or, without them, be sane)."""
        n = self.spec.n_layers
        if list(a.layer_splits):
            expected = layer_ranges(n, a.stages, list(a.layer_splits))[a.stage]
            if expected != (a.layer_begin, a.layer_end):
                raise ValueError(
                    f"assignment layer range [{a.layer_begin}, {a.layer_end}) disagrees with "
                    f"stage {a.stage}'s range {expected} from the layer splits"
                )
        bad = not 0 <= a.layer_begin < a.layer_end <= n
        bad |= (a.stage == 0) != (a.layer_begin == 0)
        bad |= (a.stage == a.stages - 1) != (a.layer_end == n)
        if bad:
            raise ValueError(
                f"assignment layer range [{a.layer_begin}, {a.layer_end}) is impossible for "
                f"stage {a.stage} of {a.stages} in a {n}-layer model (the first stage starts "
                f"at layer 0, the last ends at layer {n})"
            )

    # ---- setup ----
    def _check_world(self) -> None:
        a = self.a
        if a.world_size != self.layout.world_size:
            raise ValueError(f"world size {a.world_size} != stages x replicas of the layout")
        dp_ranks = self.layout.dp_ranks(a.stage)
        if list(a.dp_group_ranks) and list(a.dp_group_ranks) != dp_ranks:
            raise ValueError(f"assignment dp group {list(a.dp_group_ranks)} != {dp_ranks}")
        self.dp_ranks = dp_ranks

    # ---- main ----
    def run(self) -> None:
        a, cfg = self.a, self.cfg
        self._check_world()
        # Build and load before joining: the slowest rank gates the join anyway.
        self.stage, opt, sampler, val_tokens = self._build_local()
        self.world = world = join(a, self.layout, self.deadline, self.device)
        self.links, self.dp_group = world.links, world.dp_group
        self.phase = errors.TRAIN
        pipe, averager = self._build_comm()
        self.checks = ReplicaChecks(  # --verify: evidence against a bad peer (replicacheck.py)
            resolve(cfg.verify, cfg.dp_mode), world=world, averager=averager, model=self.stage,
            dp_ranks=self.dp_ranks, rank=self.rank, sync_every=cfg.sync_every,
            emit=self.progress.emit, fault=self.fault, epoch=a.epoch,
            weights=self.outer.synced if self.outer is not None else None)
        self.checks.attach(pipe)  # the pipeline links' figures, for the coordinator
        self.delayed = None if not cfg.pipeline_delay else DelayedSteps(
            pipe, self.stage, world, opt, sampler, cfg.steps, cfg.global_batch,
            cfg.micro_batches, cfg.lr, cfg.warmup_steps, cfg.grad_clip, a.replica, a.replicas,
            self.stage.is_last, Versions(self.stage),
            sent_scale=lambda s: self.fault.sent_scale(self.rank, s, a.epoch)
            if self.fault else None)
        start = self._resumed = self._resume(opt, sampler)
        if cfg.init_from and (start == 0 or cfg.lora_rank):  # LoRA checkpoints hold no base
            self._import(cfg.init_from)
            if cfg.lora_init and start == 0:  # continue a peft adapter's training
                lora.load_adapters(self.stage, lora.read_adapter_dir(cfg.lora_init),
                                   self.spec, cfg)
            if self.outer is not None:  # the first round starts from the imported weights
                self.outer.load([])
        log.info(
            "rank %d: stage %d/%d replica %d/%d layers [%d, %d), %d params, steps %d..%d",
            self.rank, a.stage, a.stages, a.replica, a.replicas, a.layer_begin, a.layer_end,
            sum(p.numel() for p in self.stage.parameters()), start + 1, cfg.steps,
        )
        self.deadline.start()
        for step in range(start + 1, cfg.steps + 1):
            self.at_step = step
            if self.fault:
                self.fault.maybe_fire(self.rank, step, a.epoch, a)
            pipe.slowdown = compute_slowdown()  # an emulated device may slow while it runs
            save = self._step(step, pipe, averager, opt, sampler) if self.delayed is None \
                else self._delayed_step(step)
            self.deadline.step_finished()
            if self.ckpt and save:
                self._wanted = False
                if self.outer is not None:  # one inner state for the checkpoint (outer.py)
                    self.deadline.sync_point()  # just synced: no round apart
                    average_moments(opt, self.outer.params, self._exact_averager())
                # every rank notes it: a peer's save makes this rank wait in the next step
                saved_s = None
                if self.ckpt.writes(a.replica):
                    t0 = time.perf_counter()
                    self._save(step, opt, sampler)
                    saved_s = time.perf_counter() - t0
                self.deadline.checkpoint(saved_s)
                self._checkpointed = step
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                self._evaluate(pipe, val_tokens, step)
                self.deadline.start()  # the next step's time is measured without it
        if cfg.steps == 0 and self.ckpt and self.ckpt.writes(a.replica):
            self._save(0, opt, sampler)  # --steps 0: the initial (imported) weights, to export
        val = self._evaluate(pipe, val_tokens, max(start, cfg.steps))
        self.progress.emit(DoneEvent(val_loss=None if math.isnan(val) else val, rank=self.rank,
                                     step=max(start, cfg.steps), resumed_step=start))
        dist.destroy_process_group()

    def _build_local(self) -> tuple[Stage, torch.optim.Optimizer, Sampler, Any]:
        """The stage, its optimizer and the data: everything that needs no peer."""
        a, cfg, spec = self.a, self.cfg, self.spec
        torch.manual_seed(cfg.seed)
        if cfg.init_from:  # before joining: a machine lacking the checkpoint fails at once
            check_init_dir(cfg.init_from, a.init_hash, spec, extra=a.rank == 0)
        if cfg.lora_init:
            lora.read_adapter_dir(cfg.lora_init, check_only=True)
        stage = Stage(spec, a.layer_begin, a.layer_end, cfg.seed).to(self.device)
        if lora.apply(stage, spec, cfg):  # --lora-rank: freeze the base, adapters only train
            (t_bytes, t_dtypes), (f_bytes, f_dtypes) = lora.held(stage).values()
            log.info("rank %d: LoRA adapters %d bytes in %s, frozen base %d bytes in %s",
                     self.rank, t_bytes, t_dtypes, f_bytes, f_dtypes)
        opt = make_optimizer(stage, cfg.lr, cfg.weight_decay, cfg.moments_dtype)
        train_tokens, val_tokens = load_splits(cfg.data_path, spec.vocab_size,
                                               model_tokenizer_hash(cfg.init_from))
        return stage, opt, Sampler(train_tokens, spec.seq_len, cfg.seed), val_tokens

    def _build_comm(self) -> tuple[Pipeline, GradAverager]:
        a, cfg = self.a, self.cfg
        micro_size = cfg.global_batch // a.replicas // cfg.micro_batches
        pipe = Pipeline(
            self.stage, self.links, a.stage, a.stages, micro_size, self.device, self.amp,
            comm_dtype=self.amp or torch.float32, deadline=self.deadline,
            slowdown=compute_slowdown(),
            codec_prev=self.codecs[0], codec_next=self.codecs[1],  # compress.py
        )
        synchronous = cfg.sync_every == 1
        averager = GradAverager(
            self.stage, self.dp_group, self.dp_ranks, cfg.dp_mode,
            extras=1 if self.stage.is_last and synchronous else 0, deadline=self.deadline,
            codec=self.codecs[2], shares=list(a.dp_shares) or None,
        )
        self._averager = averager  # its byte and codec counters go into step events
        # local steps: the replicas average pseudo-gradients every sync_every steps (outer.py)
        self.outer = None if synchronous else OuterSync(
            self.stage, averager, every=cfg.sync_every, lr=cfg.outer_lr,
            momentum=cfg.outer_mu(), delay=cfg.outer_delay)
        return pipe, averager

    def _exact_averager(self) -> GradAverager:
        """An uncompressed averager over the stage's replicas, for the AdamW moments at a
        checkpoint (`outer.average_moments`): the job's own when it compresses nothing, else
        one built the first time it is needed."""
        if self._averager.codec is None:
            return self._averager
        if self._moments_averager is None:
            a = self.a
            self._moments_averager = GradAverager(
                self.stage, self.dp_group, self.dp_ranks, self.cfg.dp_mode,
                deadline=self.deadline, shares=list(a.dp_shares) or None)
        return self._moments_averager

    def _step(
        self, step: int, pipe: Pipeline, averager: GradAverager, opt: torch.optim.Optimizer,
        sampler: Sampler,
    ) -> bool:
        """One optimizer step: pipeline (DP sync overlapped), norm exchange, clip, AdamW;
        whether it ends with a checkpoint (`_checkpoint_now`).

        With local steps (`self.outer`) the replicas exchange nothing here: the pipeline's
        loss and norm are this replica's, and a step that ends a round then syncs the
        replicas (`outer.OuterSync.sync`)."""
        a, cfg, last = self.a, self.cfg, self.stage.is_last
        outer = self.outer
        t0, cpu0 = time.perf_counter(), time.process_time()
        self.checks.begin_step(step)
        averager.step = step  # a peer's NaN in it is blamed at this step (nonfinite.py)
        ids = replica_slice(sampler.next_global(cfg.global_batch), a.replica, a.replicas)
        x, y = sampler.windows(ids)
        lr = lr_at(step - 1, cfg.lr, cfg.warmup_steps, cfg.steps)
        set_lr(opt, lr)
        opt.zero_grad(set_to_none=True)
        # this step's data-parallel and norm-exchange receives, posted a pipeline ahead
        if outer is None:
            averager.prepost()
        exchange = self.world.post_exchange(2)
        local_loss, times = pipe.train_step(
            cfg.schedule, list(x.chunk(cfg.micro_batches)), list(y.chunk(cfg.micro_batches)),
            before_last_backward=None if outer else (
                lambda loss: averager.arm([loss] if last else [])),
            step=step,
        )
        if outer is not None:  # --outer-delay 1: send back the averages whose copies are in
            outer.progress()
        dp_s, extras = averager.finish() if outer is None else (0.0, [local_loss])
        t1 = time.perf_counter()
        sq = float(local_sq_norm(self.stage))
        table = self.world.pipeline_exchange(
            [sq, extras[0] if last else 0.0], exchange,
            self.fault.sent_scale(self.rank, step, a.epoch) if self.fault else None)
        norm, loss = globalnorm.checked(table, self.world.pipeline, self.rank, a.replica,
                                        step)
        sync_s = time.perf_counter() - t1
        if outer is None:
            self.checks.note_norms(step, [row[0] for row in table])
        clip_(self.stage, norm, cfg.grad_clip)
        opt.step()
        save = self._checkpoint_now(step)
        synced, outer_s = self._sync_point(step, save)
        self.checks.end_step(step, cfg.steps)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        times.cpu_s = time.process_time() - cpu0  # every thread's: the cores it held
        self._emit_step(step, loss, norm, lr, time.perf_counter() - t0, times,
                        dp_s, sync_s, synced, outer_s)
        return save

    def _delayed_step(self, step: int) -> bool:
        """One step that does not flush the pipeline (`--pipeline-delay 1`, delayed.py): the
        updates that fell due are applied and reported; a flush step (a step of the learning
        rate's warm-up, a sync point, an evaluation, a checkpoint, the last step) applies
        every pending one first."""
        cfg, outer, delayed = self.cfg, self.outer, self.delayed
        assert delayed is not None
        t0, cpu0 = time.perf_counter(), time.process_time()
        self.checks.begin_step(step)
        save = self._checkpoint_now(step)  # before the pass: it decides the flush
        due = outer is not None and outer.due(step, cfg.steps)
        flush = save or due or step == cfg.steps or step <= cfg.warmup_steps or bool(
            cfg.eval_every and step % cfg.eval_every == 0)
        applied = delayed.run(step, flush)
        if outer is not None:  # --outer-delay 1: send back the averages whose copies are in
            outer.progress()
        synced, outer_s = self._sync_point(step, save)
        self.checks.end_step(step, cfg.steps)
        # a window's link figures go out once, with the next step event: a pass reports none
        # after a flush, several at a flush
        held = self._held_figures = self.checks.figures or self._held_figures
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        this = delayed.current
        assert this is not None
        this.dt, this.times.cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
        this.outer_s, this.synced = outer_s, synced
        for u in applied:  # each with its own pass's figures
            self.checks.figures, held, self._held_figures = held, {}, {}
            p = u.of
            self._emit_step(u.step, u.loss, u.norm, u.lr, p.dt, p.times, 0.0, p.wait_s,
                            p.synced, p.outer_s)
        return save

    def _sync_point(self, step: int, save: bool) -> tuple[SyncResult | None, float]:
        """With local steps, a step that ends a round syncs the replicas (`OuterSync.sync`):
        what it exchanged and its seconds; (None, 0.0) on any other step."""
        outer = self.outer
        if outer is None or not outer.due(step, self.cfg.steps):
            return None, 0.0
        self.deadline.sync_point(outer.every)  # the exchange's waits: not an inner step's
        t2 = time.perf_counter()
        # --outer-delay 1: a checkpoint and the last step hold no exchange in flight
        synced = outer.sync(step, flush=save or step == self.cfg.steps)
        return synced, time.perf_counter() - t2

    def _checkpoint_now(self, step: int) -> bool:
        """Whether this step ends with a checkpoint: one fell due (local steps: inside the
        round, written at its end). Read before the step's outer sync, which it flushes, and
        before its checks end, which then check what the flush exchanged. A requested step
        counts only if heard of by then: every rank then agrees."""
        cfg = self.cfg
        self._wanted |= bool(self.ckpt and (self.ckpt.due(step, cfg.steps)
                                            or step == self.requests.step()))
        return self._wanted and (self.outer is None or self.outer.due(step, cfg.steps))

    def _emit_step(
        self, step: int, loss: float, norm: float, lr: float, dt: float, times: Timings,
        dp_s: float, sync_s: float, synced: SyncResult | None = None, outer_s: float = 0.0,
    ) -> None:
        a, cfg = self.a, self.cfg
        dp_bytes, codec_s = self._averager.sent_bytes, self._averager.codec_s
        # the data-parallel codec work its hooks did inside backward (so inside compute_s)
        hidden_s = codec_s - self._averager.finish_codec_s
        outer: dict[str, Any] = {}
        if self.outer is not None:  # local steps: only a sync point exchanges anything
            dp_bytes, codec_s = (synced.dp_bytes, synced.codec_s) if synced else (0, 0.0)
            hidden_s = 0.0  # nothing is averaged in backward: the sync point does it all
            outer = {"sync_round": round_of(step, self.outer.every), "outer_s": outer_s}
            if synced:
                dp_s = synced.dp_s
                outer.update(drift=synced.drift, param_checksum=synced.checksum)
        self.progress.emit(StepEvent(
            step=step, loss=loss, tokens_per_s=cfg.global_batch * self.spec.seq_len / dt,
            total_steps=cfg.steps, rank=self.rank, stage=a.stage, replica=a.replica,
            lr=lr, grad_norm=norm, step_s=dt, compute_s=times.compute_s,
            pp_wait_s=times.recv_wait_s + times.send_wait_s, dp_s=dp_s, sync_s=sync_s,
            recv_wait_s=times.recv_wait_s, send_wait_s=times.send_wait_s,
            stored_peak=times.peak_stored, pp_bytes=times.sent_bytes,
            dp_bytes=dp_bytes, codec_s=times.codec_s + codec_s, pp_codec_s=times.codec_s,
            codec_hidden_s=hidden_s, cpu_s=times.cpu_s,
            resumed_step=self._resumed, sync_every=cfg.sync_every,
            checkpoint_step=self._checkpointed, verify_s=self.checks.take_spent(),
            judged_through=self.checks.judged_through, **outer,
            **self.checks.figures,
        ))

    def _save(self, step: int, opt: torch.optim.Optimizer, sampler: Sampler) -> None:
        """Checkpoint this stage; a refused write raises `errors.StorageError` (kind config)."""
        assert self.ckpt is not None
        a = self.a
        checkpoint.save_stage(
            self.ckpt.dir, a.stage, step,
            {
                "buffers": checkpoint.stage_buffers(self.stage),  # weights: the safetensors
                "optimizer": opt.state_dict(),
                "data_position": sampler.position.to_dict(),
                "layers": [a.layer_begin, a.layer_end],
                # AdamW's state is numbered by position: names let another split regroup it
                "param_names": checkpoint.optimizer_names(self.stage, opt),
                **({"outer": self.outer.state_dict()} if self.outer else {}),
            },
            job_id=a.job_id, layers=(a.layer_begin, a.layer_end),
            weights=lora.adapter_tensors(self.stage, self.spec, self.cfg) if self.cfg.lora_rank
            else checkpoint.stage_weights_hf(self.stage, self.spec),
        )

    def _import(self, model_dir: str) -> None:
        """Start from the Hugging Face checkpoint's values of this stage's tensors only
        (memory-mapped; no process reads the whole model)."""
        from agent.worker.hfload import load_parts_from_hf

        t0 = time.perf_counter()
        load_parts_from_hf(self.stage.parts(), self.spec, model_dir)
        log.info("rank %d: loaded layers [%d, %d) from %s in %.1f s", self.rank,
                 self.a.layer_begin, self.a.layer_end, model_dir, time.perf_counter() - t0)

    def _resume(self, opt: torch.optim.Optimizer, sampler: Sampler) -> int:
        """Load the newest step every rank holds intact; returns that completed step (0: none).

        Every rank must load the same step, so the ranks agree on it (`checkpoint.agree`),
        falling back past any checkpoint that fails its manifest or checksum; each rejected
        file is logged with the reason. When the job's checkpoints are cut at other stages
        (`checkpoint_splits`: it re-planned on another stage count), this stage's layers are
        read from every old stage that held some of them, at a step all of those hold.
        """
        loc, a = self.ckpt, self.a
        if loc is None:
            return 0
        others = checkpoint.other_jobs(loc.root, a.job_id)
        if others:
            log.info("rank %d: ignoring checkpoints of other jobs in %s (%s): this is job %s, "
                     "which resumes only from its own", self.rank, loc.root,
                     ", ".join(others), a.job_id)
        srcs = checkpoint.sources(self.spec.n_layers, a.stage, (a.layer_begin, a.layer_end),
                                  list(a.checkpoint_splits))
        finder = checkpoint.SpanFinder(loc.dir, srcs, job_id=a.job_id,
                                       on_reject=self._rejected)
        step = checkpoint.agree(finder, self.world.world_min, a.resume_before)
        mine = finder.newest_intact(a.resume_before - 1 if a.resume_before else None)
        held = ", ".join(f"stage {s.stage} (layers {s.layers[0]}-{s.layers[1] - 1})"
                         for s in srcs)
        if step == 0:
            if mine:
                log.warning("rank %d: starting from step 0 although %s hold step %d intact in "
                            "%s: another rank holds no intact step this one does (its agent "
                            "could not fetch one from a peer: see its log)", self.rank, held,
                            mine, loc.dir)
            return 0
        if mine > step:
            log.info("rank %d: %s hold step %d, but not every rank does: resuming from step "
                     "%d", self.rank, held, mine, step)
        states = checkpoint.load_span(loc.dir, srcs, step, job_id=a.job_id)
        own = srcs == [checkpoint.Source(a.stage, (a.layer_begin, a.layer_end))]
        for st in states:  # weights from the safetensors file, under this stage's names
            st["model"] = {**st.get("buffers", {}), **lora.adapter_state(
                st["weights_hf"], self.stage, self.spec, self.cfg, piece=not own)} \
                if self.cfg.lora_rank else checkpoint.model_state(st, self.spec)
        if own:
            state = states[0]
        else:
            state = checkpoint.merge_states(states, srcs, self.stage, opt, self._optimizer_names)
        self.stage.load_state_dict(state["model"], strict=not self.cfg.lora_rank)
        opt.load_state_dict(state["optimizer"])
        sampler.position = Position.from_dict(state["data_position"])
        outer = ""
        if self.outer is not None:  # the anchor is the model just loaded (a sync point's)
            self.outer.load([st.get("outer") for st in states])
            self.outer.rounds = round_of(step, self.outer.every)
            outer = (f", with the outer momentum of round {self.outer.rounds} (norm "
                     f"{self.outer.momentum_norm():.4g})")
        log.info("rank %d: resumed at step %d from %s in %s%s", self.rank, step, held, loc.dir,
                 outer)
        return step

    def _optimizer_names(self, src: checkpoint.Source) -> list[str]:
        """A checkpoint's parameter names in its optimizer's order, for one written before
        checkpoints listed them: rebuilt from a stage of its layers (the one optimizer rule)."""
        old = Stage(self.spec, src.layers[0], src.layers[1], self.cfg.seed)
        return checkpoint.optimizer_names(old, make_optimizer(old, self.cfg.lr,
                                                              self.cfg.weight_decay))

    def _rejected(self, step: int, path: Path, reason: str) -> None:
        log.warning("rank %d: checkpoint %s (step %d) is not used: %s; falling back to an "
                    "older step", self.rank, path, step, reason)

    def _evaluate(self, pipe: Pipeline, val_tokens: Any, step: int) -> float:
        """The validation loss of the weights after `step`, on every rank (NaN: none), reported
        in an eval event. Every rank calls it at the same step. It draws no random number
        (fixed batches; `eval()` turns LoRA dropout off) and keeps no gradient, so training
        after it is exactly what it would have been without it."""
        cfg, a = self.cfg, self.a
        if cfg.eval_batches == 0:
            return float("nan")
        self.stage.eval()
        sampler = Sampler(val_tokens, self.spec.seq_len, cfg.seed)
        total = 0.0
        with torch.no_grad():
            for ids in val_batches(val_tokens, self.spec.seq_len, cfg.global_batch,
                                   cfg.eval_batches):
                x, y = sampler.windows(replica_slice(ids, a.replica, a.replicas))
                total += pipe.eval_step(
                    list(x.chunk(cfg.micro_batches)), list(y.chunk(cfg.micro_batches))
                )
        self.stage.train()
        last_total = self.world.pipeline_exchange([total])[-1][0]  # the last stage's
        loss_sum = float(self.world.dp_all_reduce(last_total, dist.ReduceOp.SUM))
        val = loss_sum / (a.replicas * cfg.eval_batches)
        self.progress.emit(EvalEvent(step=step, val_loss=val, rank=self.rank))
        return val


def run_assignment(a: common_pb2.Assignment, progress_path: str | None,
                   requests_path: str | None = None) -> None:
    """Run the worker for a parsed `dtfm.v1.Assignment`.

    A failure ends with an `error` event whose `kind` (config, rendezvous, peer, internal)
    and `phase` (join, train) tell the coordinator whether retrying can help. A `PeerError`
    then ends the process itself (`errors.exit_now`: a collective whose wait gave up would
    hold a normal exit until the group's own timeout), so call this only as the body of a
    worker process; other failures are raised.
    """
    threads = os.environ.get(ENV_THREADS)
    if threads:
        torch.set_num_threads(int(threads))
    progress = Progress(progress_path)
    worker: Worker | None = None
    try:
        worker = Worker(a, progress, CheckpointRequests(requests_path))
        worker.run()
    except BaseException as e:
        phase = worker.phase if worker is not None else errors.JOIN
        step = worker.at_step if worker is not None else 0
        if isinstance(e, NonFinitePeerValue):  # evidence for the ledger, not only a failure
            progress.emit(e.evidence)
        progress.emit(ErrorEvent(
            message=errors.describe(e), rank=a.rank,
            kind=errors.classify(e, phase), phase=phase, step=step,
        ))
        what = f"worker rank {a.rank} failed {failed_at(step)}"
        if isinstance(e, errors.PeerError):
            progress.close()
            errors.exit_now(e, what)
        e.add_note(what)  # the traceback the worker's entry point logs names the step
        raise
    finally:
        progress.close()


def read_assignment(path: str | Path) -> common_pb2.Assignment:
    msg = common_pb2.Assignment()
    msg.ParseFromString(Path(path).read_bytes())
    return msg
