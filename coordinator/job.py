"""The job state machine: waiting -> measuring -> scheduling -> running -> done/failed.

One job per coordinator. It waits for enough live agents, has them measure their links, runs
the scheduler off the event loop (it is CPU-bound), pushes one assignment per agent, follows
their progress and, when an agent is lost or a worker fails mid-run, stops everyone and goes
round again with a new epoch (recovering), resuming from checkpoints when the job has them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import multiprocessing
import secrets
import statistics
import time
import uuid
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from coordinator import sync_auto
from coordinator.config import JobConfig
from coordinator.jobstore import JobSnapshot, JobStore, fingerprint
from coordinator.linkstore import LinkStore, matrix_arrays
from coordinator.measure import LinkMeasurer
from coordinator.placement import Placement, address_key, fixed_grid, score
from coordinator.recovery import Recoveries, layout_text
from coordinator.registry import AgentRecord, Registry
from coordinator.replan import Replanner
from coordinator.scheduler import Network
from coordinator.scheduler.compression import Compression
from coordinator.scheduler.compute import (
    Devices,
    Workload,
    even_is_enough,
    plan_split,
    tasklet_seconds,
)
from coordinator.scheduler.memory import DoesNotFit, check_fit, packs, stages_bytes
from coordinator.scheduler.steptime import StepShape, StepTime, dp_shares, simulate_step
from dtfm.core.assignment import build_assignments, mirror_stages
from dtfm.core.layout import Layout, layer_splits
from dtfm.core.rounds import newest_checkpoint
from dtfm.core.shape import choose_layout, elastic_layout
from dtfm.core.spec import SYNC_AUTO, TrainConfig, WorkerState
from protos.dtfm.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)
S = coordinator_pb2  # state constants live in the generated module
STATE_NAMES = {S.JOB_STATE_WAITING: "waiting", S.JOB_STATE_MEASURING: "measuring",
               S.JOB_STATE_SCHEDULING: "scheduling", S.JOB_STATE_RUNNING: "running",
               S.JOB_STATE_RECOVERING: "recovering", S.JOB_STATE_DONE: "done",
               S.JOB_STATE_FAILED: "failed", S.JOB_STATE_IDLE: "idle"}
ADOPT_WAIT_S = 60.0  # how long an adopted job waits for its members to report again
UNREACHABLE_HOLD_S = 600.0  # how long an agent its peers could not reach is left out
# a spare whose links failed in a background measurement is not probed again before this
SPARE_REMEASURE_S = 60.0
INTERNAL_RETRY_S = 5.0  # before an epoch that hit a coordinator error is planned again


def job_fingerprint(cfg: JobConfig) -> str:
    """What makes a stored job the same job: its model, shape, training and placement flags
    (not operational ones such as --max-restarts or --min-agents)."""
    return fingerprint({"model": cfg.model, "agents": cfg.agents, "stages": cfg.stages,
                        "replicas": cfg.replicas, "train": asdict(cfg.train),
                        "placement": cfg.placement, "layer_split": cfg.layer_split,
                        "seed": cfg.seed,
                        **({"init_hash": cfg.init_hash} if cfg.init_hash else {})})


def _search(delay: np.ndarray, bandwidth: np.ndarray, stages: int, replicas: int,
            dp_gb: float, pp_gb: float, seed: int, seconds: float, work: Workload,
            flops: list[float]) -> dict[str, Any]:
    """Runs in a worker process (the scheduler is pure numpy and CPU-bound): the paper's
    search, then its grid polished against the step model for half as long again
    (`placement.polished_grid`; `flops`: each agent's FLOP/s, 0 where unknown)."""
    from coordinator.placement import polished_grid
    from coordinator.scheduler import Network, search_plan

    net = Network(delay_ms=delay, bandwidth_gbps=bandwidth)
    result = search_plan(net, stages=stages, replicas=replicas, dp_gb=dp_gb, pp_gb=pp_gb,
                         seed=seed, seconds=seconds, compression=work.compression)
    grid, before, after = polished_grid(net, result.grid, work, flops, seed,
                                        max(1.0, seconds / 2))
    return {"grid": grid, "seconds": result.seconds, "searched_step_s": before,
            "polished_step_s": after}


def _split(delay: np.ndarray, bandwidth: np.ndarray, grid: list[list[int]], work: Workload,
           dev: Devices, move: bool, seconds: float) -> tuple[list[list[int]], list[int], str]:
    """Runs in a worker process: the grid and layer split for the devices' speed and memory."""
    placed = plan_split(Network(delay_ms=delay, bandwidth_gbps=bandwidth), grid, work, dev,
                        move=move, seconds=seconds)
    return placed.best.grid, placed.best.splits, placed.reason


def agent_flops(records: list[AgentRecord], dtype: str) -> list[float]:
    """Each agent's FLOP/s in the training dtype (0: unknown)."""
    return [r.info.device.flops_bf16 if dtype == "bf16" and r.info.device.flops_bf16 > 0
            else r.info.device.flops for r in records]


def device_figures(records: list[AgentRecord], dtype: str) -> Devices:
    """Each agent's FLOP/s in the training dtype, its memory free for training, and the
    memory pool it shares with agents on the same machine (`_place` checks a pool once)."""
    memory = [min(r.info.device.free_memory_bytes or r.info.device.memory_bytes, 2**62)
              for r in records]  # uint64 on the wire; 4 EiB is plenty
    return Devices.of(agent_flops(records, dtype), memory,
                      [r.info.device.memory_pool for r in records])


STEP_WINDOW = 5  # measured step time: the median over the members' last steps


@dataclass
class _Prediction:
    """The running plan's step-time model, refined as workers report their compute.

    Before the first steps, compute is estimated from each agent's measured FLOP/s and its
    stage's layers (the plan's split); once a member has reported steps, its own median
    compute time replaces the estimate."""

    net: Network
    grid: list[list[int]]  # stage x replica -> index into `agents`
    work: Workload
    splits: list[int]
    agents: list[str]
    flops: list[float]  # 0: unknown (no compute estimated)
    _comm: StepTime | None = field(default=None, repr=False)

    @property
    def shape(self) -> StepShape:
        return self.work.step_shape(self.splits)

    @property
    def comm_s(self) -> float:
        if self._comm is None:
            self._comm = simulate_step(self.net, self.grid, self.shape)
        return self._comm.step_s

    def predict(self, compute_per_step: dict[str, float]) -> StepTime:
        """`compute_per_step[agent]`: its measured compute seconds per step, where known."""
        m = self.work.micro_batches
        known = [f if f > 0 else math.inf for f in self.flops]  # unknown speed: no estimate
        estimate = tasklet_seconds(self.work, self.grid, known, self.splits)
        compute = [[compute_per_step[self.agents[d]] / m if self.agents[d] in compute_per_step
                    else float(estimate[j, k]) for k, d in enumerate(row)]
                   for j, row in enumerate(self.grid)]
        return simulate_step(self.net, self.grid, self.shape, compute)


class Job:
    def __init__(self, config: JobConfig, registry: Registry, measurer: LinkMeasurer,
                 links: LinkStore, store: JobStore | None = None) -> None:
        self.config = config
        self.registry = registry
        self.measurer = measurer
        self.links = links
        self.state = S.JOB_STATE_WAITING if config.model else S.JOB_STATE_IDLE
        self.job_id = f"job-{uuid.uuid4().hex[:8]}" if config.model else ""
        self.epoch = 0
        self.plan: common_pb2.Plan | None = None
        self.message = "" if config.model else "no job: start with --model and --agents"
        self.members: list[str] = []
        self.restarts = 0
        self._wake = asyncio.Event()
        self._progress: dict[str, coordinator_pb2.ProgressReport] = {}
        self._failure: str = ""
        self._failure_kind: str = ""
        self._last_epoch_failure: tuple[str, int] = ("", 0)  # (kind, steps done) of the last
        self._steps: dict[str, deque[coordinator_pb2.ProgressReport]] = {}
        self._model: _Prediction | None = None
        # the split the newest checkpoint holds, and this epoch's: they differ after the job
        # re-planned on another stage count, until this epoch writes a checkpoint of its own
        self._trained_splits: list[int] | None = None
        self._epoch_splits: list[int] = []
        self._port_epoch, self._port = -1, 0
        self.started_unix_s = 0.0
        # Churn: the layout the job wants (set by its first epoch; replicas shrink below it when
        # agents are lost and grow back at a checkpoint), this epoch's training config (more
        # micro-batches per replica when shrunk), the newest step every member has passed a
        # checkpoint at, and when a recovery began (by the registry's clock: agents that have
        # not heartbeated since may be dead and are not planned on).
        self._wanted: Layout | None = None
        self._layout: Layout | None = None
        self._train: TrainConfig = config.train
        # --sync-every: the job's H for its life; with auto (SYNC_AUTO) chosen on the first
        # plan (coordinator/sync_auto.py), with the reason the plan shows
        self._sync_every, self._sync_note = config.train.sync_every, ""
        self.checkpoint_step = 0
        self._epoch_checkpoint = 0
        self._settle_after = -math.inf
        self._grid_ids: list[list[str]] = []
        self._adopt_deadline = 0.0
        self._first_steps: dict[str, int] = {}  # each member's first step this epoch
        # agents the others could not reach, left out until they re-join or the time passes:
        # their heartbeats still arrive, and measuring them again would loop forever
        self._unreachable: dict[str, float] = {}
        self._spare_task: asyncio.Task[None] | None = None  # measuring newcomers' links
        self._spare_retry_at = 0.0
        self.recoveries = Recoveries()
        self.replan = Replanner(self)  # drift watch and re-planning while training
        self.store = store
        if store is not None and config.model:
            self._adopt(store.unfinished(job_fingerprint(config)))

    # --- the coordinator's state directory ---
    def _adopt(self, snap: JobSnapshot | None) -> None:
        """Continue a job a previous coordinator process drove: same id (the agents'
        checkpoints are keyed by it), epoch, plan and recoveries."""
        if snap is None:
            return
        self.job_id, self.epoch, self.restarts = snap.job_id, snap.epoch, snap.restarts
        self.checkpoint_step = self._epoch_checkpoint = snap.checkpoint_step
        self.recoveries = Recoveries(snap.recoveries)
        self.replan.restore(snap.replans)
        self._grid_ids = snap.grid
        if snap.grid:
            self._wanted = Layout(snap.wanted_stages or len(snap.grid),
                                  max(snap.wanted_replicas, len(snap.grid[0])))
            self._layout = Layout(len(snap.grid), len(snap.grid[0]))
        self._epoch_splits = list(snap.splits)
        if snap.checkpoint_splits or snap.splits:  # older snapshots: one split for both
            self._trained_splits = list(snap.checkpoint_splits or snap.splits)
        self.started_unix_s = snap.started_unix_s
        if self._sync_every == SYNC_AUTO and snap.sync_every:
            self._sync_every = snap.sync_every
            self._sync_note = f"auto: every {snap.sync_every} steps, chosen on the first plan"
        if snap.state == "running" and snap.members:
            self.members = list(snap.members)
            self._train = replace(self.config.train, micro_batches=snap.micro_batches
                                  or self.config.train.micro_batches)
            self.plan = common_pb2.Plan(
                stages=len(snap.grid), replicas=len(snap.grid[0]), epoch=self.epoch,
                grid=[common_pb2.PlanStage(agent_ids=row) for row in snap.grid],
                placement="adopted", layer_splits=snap.splits)
            self._adopt_deadline = time.monotonic() + ADOPT_WAIT_S
        log.info("job %s: adopted from the state directory after a coordinator restart "
                 "(epoch %d, %s, newest checkpoint step %d)", self.job_id, self.epoch,
                 snap.state, self.checkpoint_step)

    def _persist(self, finished: bool = False) -> None:
        if self.store is None or not self.config.model:
            return
        snap = JobSnapshot(
            job_id=self.job_id, fingerprint=job_fingerprint(self.config),
            state=STATE_NAMES.get(self.state, "waiting"), epoch=self.epoch,
            restarts=self.restarts, members=list(self.members), grid=self._grid_ids,
            splits=list(self._epoch_splits), checkpoint_splits=list(self._trained_splits or []),
            checkpoint_step=self.checkpoint_step,
            recoveries=self.recoveries.to_json(), replans=self.replan.to_json(),
            started_unix_s=self.started_unix_s,
            micro_batches=self._train.micro_batches,
            wanted_replicas=self._wanted.replicas if self._wanted else 0,
            wanted_stages=self._wanted.stages if self._wanted else 0,
            sync_every=self._sync_every)
        try:
            self.store.save(snap, finished=finished)
        except Exception as exc:  # a full disk must not stop training; say so loudly
            log.error("job %s: could not save its state in %s: %s", self.job_id,
                      self.store.path, exc)

    # --- events from the server ---
    def poke(self) -> None:
        self._wake.set()

    def on_join(self, rec: AgentRecord) -> None:
        # a re-join may come with a corrected --advertise: measure it again
        self._unreachable.pop(rec.agent_id, None)
        self.poke()

    def on_progress(self, rec: AgentRecord, report: coordinator_pb2.ProgressReport) -> None:
        """Take a member's report for this epoch; `rec` is the agent its secret proved, so
        no one else's report can mark a member done or fail the job."""
        if (report.job_id and report.job_id == self.job_id and report.epoch == self.epoch
                and rec.agent_id in self.members):
            self._progress[rec.agent_id] = report
            if report.step > 0:
                self._first_steps.setdefault(rec.agent_id, report.step)
            if report.step > 0 and self.recoveries.pending and self.state == S.JOB_STATE_RUNNING:
                self.recoveries.trained(report.resumed_step + 1
                                        if report.HasField("resumed_step") else report.step)
                self._persist()
            steps = self._steps.setdefault(rec.agent_id, deque(maxlen=STEP_WINDOW))
            if report.step >= 2 and report.step_s > 0 and (
                    not steps or steps[-1].step != report.step):
                steps.append(report)  # step 1 carries warm-up; later ones are steady
                self.replan.observe(rec.agent_id, report)
            failed = WorkerState.from_wire(report.worker_state) is WorkerState.FAILED
            if failed and not self._failure:
                self._failure = f"worker on {rec.agent_id} failed: {report.error or 'no reason'}"
                self._failure_kind = report.error_kind or "internal"
            self.poke()

    def on_lost(self, lost: list[AgentRecord]) -> None:
        if self.state == S.JOB_STATE_RUNNING:
            ids = [r.agent_id for r in lost if r.agent_id in self.members]
            if ids and not self._failure:
                self._failure = f"lost agent(s) {', '.join(ids)}"
        self.poke()

    def checkpoint_floor(self) -> int:
        """The oldest checkpoint step every agent must keep (0: no floor, `write_floor`).

        Only a layout of one-replica stages has mirrors (`mirror_stages`). Losing a stage's
        agent leaves its mirror's newest step as the newest that stage has, so the recovery
        resumes there, and every other stage must still hold it. Before a mirror has reported
        a copy, the floor is 1: keep everything (up to MAX_HELD), since whatever it copies
        first must stay matched."""
        train, grid = self._train, self._grid_ids
        mirrors = mirror_stages(self._layout) if self._layout else {}
        if (train.checkpoint_dir or train.checkpoint_every <= 0 or not mirrors
                or self.state != S.JOB_STATE_RUNNING):
            return 0
        held = []
        for stage, by in mirrors.items():
            report = self._progress.get(grid[by][0])
            held.append(report.mirrored_steps.get(stage, 0) if report else 0)
        return max(1, min(held))

    def busy_training(self) -> bool:
        return self.state in (S.JOB_STATE_RUNNING, S.JOB_STATE_SCHEDULING,
                              S.JOB_STATE_MEASURING)

    def measured_step_s(self) -> float:
        """Median step time over the members' last few steady steps (0 before any)."""
        times = [r.step_s for steps in self._steps.values() for r in steps]
        return statistics.median(times) if times else 0.0

    def _refresh_prediction(self) -> None:
        """Replace estimated compute by what members measured, once they have."""
        if self._model is None or self.plan is None:
            return
        measured = {a: statistics.median(r.compute_s for r in steps)
                    for a, steps in self._steps.items() if steps and a in self.members}
        predicted = self._model.predict(measured)
        self.plan.predicted_step_s = predicted.step_s
        self.plan.predicted_compute_s = predicted.compute_s

    def status(self) -> coordinator_pb2.JobStatus:
        reports = list(self._progress.values())
        step = max((r.step for r in reports), default=0)
        with_loss = [r for r in reports if r.step == step and r.loss > 0]
        self._refresh_prediction()
        measured = self.measured_step_s()
        tokens = self.config.train.global_batch * self.config.model_spec().seq_len \
            if self.config.model else 0
        return coordinator_pb2.JobStatus(
            job_id=self.job_id, state=self.state, model=self.config.model,
            model_spec=self.config.model_spec().to_proto() if self.config.model else None,
            agents_wanted=self.config.agents, epoch=self.epoch, step=step,
            total_steps=self.config.train.steps,
            loss=with_loss[0].loss if with_loss else 0.0,
            tokens_per_s=tokens / measured if measured else 0.0, message=self.message,
            placement=self.plan.placement if self.plan else "",
            predicted_step_s=self.plan.predicted_step_s if self.plan else 0.0,
            measured_step_s=measured,
            agents_min=self.config.min_agents or self.config.agents,
            stages=self._layout.stages if self._layout else 0,
            replicas=self._layout.replicas if self._layout else 0,
            checkpoint_step=self.checkpoint_step, restarts=self.restarts,
            recoveries=self.recoveries.items, replans=self.replan.records,
        )

    # --- the machine ---
    def _set(self, state: int, message: str) -> None:
        if (state, message) == (self.state, self.message):
            return  # the same wait, woken again: say it once
        self.state = state
        self.message = message
        log.info("job %s: %s — %s", self.job_id,
                 coordinator_pb2.JobState.Name(state).removeprefix("JOB_STATE_").lower(),
                 message)

    async def _wait(self, timeout: float = 1.0) -> None:
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            pass

    async def run(self) -> None:
        if not self.config.model:
            return
        if self._adopt_deadline:
            self._set(S.JOB_STATE_RUNNING, f"epoch {self.epoch}: adopted after a coordinator "
                      f"restart; waiting for its {len(self.members)} members to report")
            await self._follow()
        errors = 0
        while self.state not in (S.JOB_STATE_DONE, S.JOB_STATE_FAILED):
            try:
                await self._run_epoch()
                errors = 0
            except Exception as exc:  # noqa: BLE001 - any bug here must not hang the job
                # e.g. the scheduler's search process killed (BrokenProcessPool): without
                # this the task died silently and the job sat in "scheduling" for ever
                errors += 1
                state = coordinator_pb2.JobState.Name(self.state).removeprefix("JOB_STATE_")
                log.exception("job %s: coordinator error while %s", self.job_id, state.lower())
                what = f"coordinator error while {state.lower()}: {exc!r}"
                if errors > max(self.config.max_restarts, 1):
                    self._set(S.JOB_STATE_FAILED, f"{what}; gave up after {errors} tries "
                              "(the coordinator log has the traceback; please report it)")
                    self._persist(finished=True)
                    return
                self._set(S.JOB_STATE_WAITING, f"{what}; trying again in "
                          f"{INTERNAL_RETRY_S:.0f} s ({errors} of "
                          f"{max(self.config.max_restarts, 1)})")
                await asyncio.sleep(INTERNAL_RETRY_S)

    async def _run_epoch(self) -> None:
        cfg = self.config
        spec = cfg.model_spec()
        placement = cfg.parsed_placement()
        members = await self._gather(placement)
        wanted = len(members)
        ids = [m.agent_id for m in members]
        if cfg.links_file:
            try:
                delay, bandwidth = self._known_links(ids)
            except ValueError as exc:
                self._set(S.JOB_STATE_FAILED, str(exc))
                return
        elif cfg.measure_links and wanted > 1 and self.epoch and self.links.complete_for(ids):
            # a recovery among agents measured before: their links did not change because
            # someone else died, and measuring again would cost a minute of stall
            delay, bandwidth = matrix_arrays(self.links.matrix(ids))
        elif cfg.measure_links and wanted > 1:
            self._cancel_spare_measurement()
            # a recovery measures only the links it has no figure for (newcomers'): the
            # others did not change because an agent came or went
            missing = len(self.measurer.missing_links(ids)) if self.epoch else \
                wanted * (wanted - 1)
            self._set(S.JOB_STATE_MEASURING, f"measuring {missing} links")
            matrix = await self.measurer.measure(members, only_missing=bool(self.epoch))
            bad = self.links.unreachable_agents(ids)
            if bad:
                self._set(S.JOB_STATE_WAITING,
                          f"leaving out unreachable agent(s) {', '.join(bad)}; waiting for others")
                self._hold_out(bad)
                return
            delay, bandwidth = matrix_arrays(matrix)
        else:
            delay = np.ones((wanted, wanted))
            bandwidth = np.ones((wanted, wanted))
        net = Network.measured(delay, bandwidth)
        layout, train = self._epoch_layout(members, spec.n_layers)
        self._set(S.JOB_STATE_SCHEDULING, f"placing {layout.stages} stages x "
                  f"{layout.replicas} replicas ({placement.label})")
        work = Workload(spec, layout.stages, layout.replicas, train.global_batch,
                        train.micro_batches, cfg.train.schedule, cfg.train.dtype,
                        act_dtype=cfg.train.dtype,  # the worker sends activations in it
                        dp_mode=cfg.train.dp_mode, moments_dtype=cfg.train.moments_dtype,
                        sync_every=self._sync_every or 1,  # local steps: exchange every H
                        lora_rank=cfg.train.lora_rank, lora_targets=cfg.train.lora_targets,
                        compression=Compression.for_job(  # --pp/--dp-compress, counted per link
                            cfg.train.pp_compress, cfg.train.dp_compress, dtype=cfg.train.dtype,
                            dp_mode=cfg.train.dp_mode,
                            device_kinds=[m.info.device.kind for m in members]))
        flops = agent_flops(members, cfg.train.dtype)
        try:
            found = await self._place(placement, net, layout, ids, work,
                                      device_figures(members, cfg.train.dtype), flops,
                                      warm=self._warm_grid(layout, ids, placement))
        except DoesNotFit as exc:
            self._set(S.JOB_STATE_FAILED, f"{cfg.model} on {layout.stages} stages x "
                      f"{layout.replicas} replicas does not fit: {exc}")
            return
        except ValueError as exc:
            self._set(S.JOB_STATE_FAILED, f"placement {placement.label}: {exc}")
            return
        if self._sync_every == SYNC_AUTO:
            try:
                work = self._choose_sync(net, found, work, flops, members, ids, train.steps)
            except DoesNotFit as exc:
                self._set(S.JOB_STATE_FAILED, f"{cfg.model} with --sync-every "
                          f"{self._sync_every} (auto) does not fit: {exc}")
                return
        train = replace(train, sync_every=self._sync_every)
        self.epoch += 1
        self._layout, self._train = layout, train
        self._epoch_checkpoint = self.checkpoint_step
        self._grid_ids = [[ids[d] for d in row] for row in found["grid"]]
        self.recoveries.placed(layout_text(layout.stages, layout.replicas))
        self._epoch_splits = list(found["splits"])
        if self._trained_splits is None and (cfg.train.checkpoint_dir
                                             or cfg.train.checkpoint_every):
            self._trained_splits = list(found["splits"])  # the first epoch: nothing re-cut
        resplit = self._trained_splits if self._trained_splits != self._epoch_splits else None
        by_rank = layout.devices_by_rank(found["grid"])
        ranked = [int(d) for d in by_rank]
        records = [members[d] for d in ranked]
        self._model = _Prediction(net=net, grid=found["grid"], work=work,
                                  splits=found["splits"], agents=ids, flops=flops)
        predicted = self._model.predict({})
        self.plan = common_pb2.Plan(
            stages=layout.stages, replicas=layout.replicas,
            grid=[common_pb2.PlanStage(agent_ids=[ids[d] for d in row],
                                       dp_shares=found["dp_shares"][j] if found["dp_shares"]
                                       else [])
                  for j, row in enumerate(found["grid"])],
            cost=found["cost"], dp_cost=found["dp_cost"], pp_cost=found["pp_cost"],
            seconds=found["seconds"], algorithm=found["algorithm"], epoch=self.epoch,
            placement=placement.label, predicted_step_s=predicted.step_s,
            predicted_comm_s=self._model.comm_s, predicted_compute_s=predicted.compute_s,
            layer_splits=found["splits"], sync_every=self._sync_every,
            sync_note=self._sync_note,
        )
        assignments = build_assignments(
            job_id=self.job_id, epoch=self.epoch, layout=layout, spec=spec, train=train,
            master_addr=records[0].info.host, master_port=self._rendezvous_port(),
            backend="nccl" if all(r.info.device.kind == "cuda" for r in records) else "gloo",
            bind_addrs=[r.info.host for r in records], splits=found["splits"],
            codecs=found["codecs"],
            members=[(r.info.host, r.info.port) for r in records],
            checkpoint_splits=resplit, dp_shares=found["dp_shares"],
            init_hash=cfg.init_hash,
            member_gbps=net.bandwidth_gbps[np.ix_(ranked, ranked)].tolist(),
        )
        self.members = [r.agent_id for r in records]
        self._progress.clear()
        self._steps.clear()
        self._first_steps.clear()
        self._failure, self._failure_kind = "", ""
        for rec, assignment in zip(records, assignments, strict=True):
            self.registry.send(rec.agent_id, coordinator_pb2.Command(assign=assignment))
        self.started_unix_s = time.time()
        self._set(S.JOB_STATE_RUNNING,
                  f"epoch {self.epoch}: {layout.stages} stages x {layout.replicas} replicas, "
                  f"{placement.label} placement, layers {found['split_note']}, predicted "
                  f"cost {found['cost']:.3f} s, predicted step {predicted.step_s:.2f} s"
                  + (f", compression {found['codecs'].summary()}"
                     if work.compression and work.compression.active else "")
                  + (f", {train.micro_batches} micro-batches per replica (shrunk from "
                     f"{layout_text(self._wanted.stages, self._wanted.replicas)})"
                     if self._wanted and layout != self._wanted else "")
                  + (f", resuming from checkpoints cut as "
                     f"{','.join(map(str, resplit))} layers per stage" if resplit else ""))
        self.replan.start_epoch(predicted.step_s)
        self._persist()
        await self._follow()

    def _choose_sync(self, net: Network, found: dict[str, Any], work: Workload,
                     flops: list[float], members: Sequence[AgentRecord], ids: list[str],
                     steps: int) -> Workload:
        """`--sync-every auto`, on the first plan: H by the step model on this grid
        (`sync_auto.choose`), checked to fit with the outer state H > 1 keeps per parameter.
        Raises `DoesNotFit`."""
        choice = sync_auto.choose(net, found["grid"], work, flops, found["splits"], steps,
                                  self.config.sync_overhead)
        self._sync_every, self._sync_note = choice.every, choice.note
        log.info("job %s: --sync-every %s", self.job_id, choice.note)
        work = replace(work, sync_every=choice.every)
        dev = device_figures(list(members), self.config.train.dtype)
        check_fit(found["grid"], stages_bytes(work.memory(), found["splits"]), dev.memory,
                  names=ids, pools=dev.pools or None, moments_dtype=work.moments_dtype)
        return work

    def _epoch_layout(self, members: Sequence[AgentRecord],
                      n_layers: int) -> tuple[Layout, TrainConfig]:
        """The first epoch's layout is the job's; later ones take fewer replicas, then fewer
        stages, when agents are missing (`_elastic`), with more micro-batches each, so the
        global batch and the loss curve stay the same."""
        cfg = self.config
        if self._wanted is None:
            self._wanted = choose_layout(len(members), n_layers, cfg.stages, cfg.replicas)
            return self._wanted, cfg.train
        shrunk = self._elastic(members)
        assert shrunk is not None, "_gather returned agents no layout fits on"
        layout, micro = shrunk
        if layout == self._wanted:
            return layout, cfg.train
        return layout, replace(cfg.train, micro_batches=micro)

    def _elastic(self, agents: Sequence[AgentRecord]) -> tuple[Layout, int] | None:
        """The layout `elastic_layout` picks for these agents, checked against their memory."""
        assert self._wanted is not None
        cfg = self.config
        dev = device_figures(list(agents), cfg.train.dtype)
        return elastic_layout(len(agents), self._wanted.stages, self._wanted.replicas,
                              cfg.train.global_batch, cfg.train.micro_batches,
                              fits=lambda layout, micro: self._fits(layout, micro, dev))

    def _fits(self, layout: Layout, micro: int, dev: Devices) -> bool:
        """Whether `layout` with `micro` micro-batches per replica fits the devices' memory
        (0: unknown, taken to fit), agents on one machine sharing its memory: the kept split,
        or an even one when the stages are re-cut (`memory.packs`). `_place` checks the
        placement it makes again (`check_fit`)."""
        cfg = self.config
        work = Workload(cfg.model_spec(), layout.stages, layout.replicas,
                        cfg.train.global_batch, micro, cfg.train.schedule, cfg.train.dtype,
                        moments_dtype=cfg.train.moments_dtype, sync_every=self._sync_every or 1,
                        lora_rank=cfg.train.lora_rank, lora_targets=cfg.train.lora_targets)
        kept = self._trained_splits if self._trained_splits and len(
            self._trained_splits) == layout.stages else None
        needs = [n for n in stages_bytes(work.memory(), kept) for _ in range(layout.replicas)]
        return packs(needs, dev.memory.tolist(), dev.pools or None)

    def _warm_grid(self, layout: Layout, ids: list[str],
                   placement: Placement) -> tuple[list[list[int]], str] | None:
        """The previous epoch's grid when the same agents form the same layout again (a
        coordinator restart, a worker crash): no search, and every agent keeps the stage
        whose checkpoints it holds. A re-plan's move (coordinator/replan.py) brings its grid.
        With it, how it was found (the plan's `algorithm`)."""
        planned = self.replan.planned_grid(ids)
        if planned is not None and layout == Layout(len(planned), len(planned[0])):
            return planned, "re-planned on re-measured links (hybrid-ga + step-time polish)"
        if placement.kind != "scheduled" or len(self._grid_ids) != layout.stages:
            return None
        index = {a: i for i, a in enumerate(ids)}
        rows = [[index[a] for a in row if a in index][:layout.replicas]
                for row in self._grid_ids]
        newcomers = iter(sorted(set(range(len(ids))) - {d for row in rows for d in row}))
        for row in rows:  # a grow-back: new agents fill the new replicas (and fetch)
            row.extend(itertools.islice(newcomers, layout.replicas - len(row)))
        if any(len(row) != layout.replicas for row in rows):
            return None
        # kept: still say which search first found it (a user reading status after a restart)
        found = (self.plan.algorithm if self.plan is not None else "").split(", kept from")[0]
        return rows, (f"{found}, kept from epoch {self.epoch}" if found
                      else f"kept from epoch {self.epoch}")

    def _known_links(self, ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The members' rows of the `--links` file (read again: it may have been refreshed)."""
        from coordinator.linkstore import load_links_file

        obj = load_links_file(self.config.links_file)
        index = {a: i for i, a in enumerate(obj["agents"])}
        missing = [a for a in ids if a not in index]
        if missing:
            raise ValueError(f"--links {self.config.links_file} has no row for agent(s) "
                             f"{', '.join(missing)}: measure them with `coordinator links "
                             f"--measure --json`")
        rows = [index[a] for a in ids]
        pick = np.ix_(rows, rows)
        return (np.array(obj["delay_ms"], dtype=float)[pick],
                np.array(obj["bandwidth_gbps"], dtype=float)[pick])

    async def _gather(self, placement: Placement) -> list[AgentRecord]:
        """Wait for the agents the job needs: the pinned plan's, or any `--agents` live ones.

        Members are in address order, the order a network-blind launcher would use."""
        wanted = self.config.agents
        pinned = placement.pinned.agents if placement.pinned is not None else []
        while True:
            # after a fault, only agents heard from since count: a dead one is swept by its
            # missed heartbeats instead of being planned on (and probed for a minute)
            now = time.monotonic()
            everyone = [a for a in self.registry.alive()
                        if self._unreachable.get(a.agent_id, 0.0) <= now]
            alive = [a for a in everyone if a.last_seen >= self._settle_after]
            if pinned:
                by_id = {a.agent_id: a for a in alive}
                missing = [a for a in pinned if a not in by_id]
                if not missing:
                    return [by_id[a] for a in pinned]
                what = f"the pinned plan's agents: {len(missing)} of {wanted} not alive " \
                       f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
            else:
                ordered = sorted(alive, key=lambda a: address_key(a.info.host, a.info.port))
                if len(alive) >= wanted:
                    return self._prefer_previous(ordered, wanted)[:wanted]
                fewer = self._shrink_to(alive)
                if fewer and len(everyone) == len(alive):
                    return self._prefer_previous(ordered, fewer)[:fewer]
                what = f"agents: {len(alive)} of {wanted} alive" + (
                    f" (--min-agents {self.config.min_agents})" if self.config.min_agents
                    else "")
                if alive and not fewer and len(alive) >= (self.config.min_agents or wanted):
                    what += "; no smaller layout fits their memory"
            if self.state != S.JOB_STATE_RECOVERING or alive:
                self._set(S.JOB_STATE_RECOVERING if self.state == S.JOB_STATE_RECOVERING
                          else S.JOB_STATE_WAITING, f"waiting for {what}")
            await self._wait()

    def _prefer_previous(self, ordered: list[AgentRecord], count: int) -> list[AgentRecord]:
        """Agents of the last epoch first, as many per stage as the new layout has replicas:
        they hold their stage's checkpoints, so keeping them where they were costs no copy.
        A re-plan's move (coordinator/replan.py) picks its own, a spare perhaps among them."""
        by_id = {a.agent_id: a for a in ordered}
        if (moving := self.replan.planned_members()) and all(a in by_id for a in moving):
            return [by_id[a] for a in moving] + [a for a in ordered if a.agent_id not in moving]
        if not self._grid_ids:
            return ordered
        per_stage = max(count // len(self._grid_ids), 1)
        picked = [by_id[a] for row in self._grid_ids
                  for a in [x for x in row if x in by_id][:per_stage]]
        return picked + [a for a in ordered if a not in picked]

    def _shrink_to(self, alive: Sequence[AgentRecord]) -> int:
        """How many of the `alive` agents a shrunk layout uses (0: wait for more instead)."""
        if self._wanted is None or len(alive) < (self.config.min_agents or self.config.agents):
            return 0
        shrunk = self._elastic(alive)
        return shrunk[0].stages * shrunk[0].replicas if shrunk else 0

    async def _place(self, placement: Placement, net: Network, layout: Layout,
                     ids: list[str], work: Workload, dev: Devices,
                     flops: list[float], warm: tuple[list[list[int]], str] | None = None
                     ) -> dict[str, Any]:
        """The grid (searched, then polished against the step model; or fixed), its layer
        split, and the paper's cost of the grid. `flops`: each agent's measured FLOP/s as
        reported (0: unknown), for the polish's compute.

        Raises `DoesNotFit` when some member cannot hold its stage under that split."""
        cfg = self.config
        from coordinator.scheduler import comm_gb

        dp_gb, pp_gb = comm_gb(work.spec, layout.stages, layout.replicas,
                               cfg.train.global_batch, dtype=cfg.train.dtype,
                               lora_rank=cfg.train.lora_rank, lora_targets=cfg.train.lora_targets)
        grid = warm[0] if warm else fixed_grid(placement, layout.stages, layout.replicas, ids)
        if warm is not None:
            found = {"grid": warm[0], "seconds": 0.0, "algorithm": warm[1]}
        elif grid is None:
            found = {**await self._in_pool(_search, net.delay_ms, net.bandwidth_gbps,
                                           layout.stages, layout.replicas, dp_gb, pp_gb,
                                           cfg.seed, cfg.search_seconds, work, flops),
                     "algorithm": "hybrid-ga + step-time polish"}
            log.info("job %s: the step-time polish took the searched grid's predicted step "
                     "from %.3f s to %.3f s", self.job_id, found["searched_step_s"],
                     found["polished_step_s"])
        else:
            found = {"grid": grid, "seconds": 0.0, "algorithm": placement.kind}
        found["grid"], found["splits"], why = await self._choose_split(
            net, found["grid"], work, dev, move=grid is None)
        found["split_note"] = f"{','.join(map(str, found['splits']))} ({why})"
        check_fit(found["grid"], stages_bytes(work.memory(), found["splits"]), dev.memory,
                  names=ids, pools=dev.pools or None, moments_dtype=work.moments_dtype)
        assert work.compression is not None
        found["codecs"] = work.compression.choose(net, found["grid"])  # per link, for auto
        found["dp_shares"] = None
        if work.dp_mode == "sharded" and layout.replicas > 1:
            found["dp_shares"] = dp_shares(net, found["grid"], work.step_shape(found["splits"]))
            log.info("job %s: data-parallel shares per stage (replica order): %s", self.job_id,
                     "; ".join(",".join(f"{x:.2f}" for x in row) for row in found["dp_shares"]))
        return {**found, **score(net, found["grid"], dp_gb, pp_gb, work.compression)}

    async def _choose_split(self, net: Network, grid: list[list[int]], work: Workload,
                            dev: Devices, move: bool) -> tuple[list[list[int]], list[int], str]:
        """`--layer-split`: as given, even, or chosen for speed and memory (auto)."""
        cfg, n = self.config, work.spec.n_layers
        given = cfg.parsed_split()
        if given is not None and len(given) != work.stages:  # shrunk to fewer stages
            return grid, layer_splits(n, work.stages), (
                f"even: --layer-split {cfg.layer_split} is for {len(given)} stages")
        if cfg.layer_split != "auto":
            return grid, layer_splits(n, work.stages, given), cfg.layer_split
        if (planned := self.replan.planned_splits(work.stages)) is not None:
            return grid, planned, "re-planned for the devices' measured speed"
        kept = self._trained_splits
        if kept is not None and len(kept) == work.stages:
            # checkpoints hold these layer ranges: the workers resume without re-cutting
            return grid, list(kept), f"kept from epoch {self.epoch}: checkpoints hold it"
        if even_is_enough(grid, work, dev):
            return grid, layer_splits(n, work.stages), "even: the devices are alike"
        return await self._in_pool(_split, net.delay_ms, net.bandwidth_gbps, grid, work, dev,
                                   move, cfg.search_seconds)

    @staticmethod
    async def _in_pool(fn: Any, *args: Any) -> Any:
        """Run a CPU-bound scheduler call in a spawned process (a fork of grpc is unsafe)."""
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def _rendezvous_port(self) -> int:
        """Rank 0's store port for this epoch: drawn per epoch from 29500-30498 (even ports;
        the store's neighbour is left free), so a stranger cannot know it in advance; the
        assignment carries it."""
        if self._port_epoch != self.epoch:
            self._port_epoch, self._port = self.epoch, 29500 + 2 * secrets.randbelow(500)
        return self._port

    async def _follow(self) -> None:
        while True:
            fresh_checkpoint = self._note_checkpoint()
            self._check_adopted()
            if self._failure:
                await self._recover(self._failure)
                return
            self._measure_spares()
            self.replan.tick()
            if fresh_checkpoint and (grow := self._grow_reason() or self.replan.move_reason()):
                self.recoveries.begin(grow, self._layout_text(), self._last_step(), planned=True)
                await self._stop_members(f"recovering: {grow}")
                self._set(S.JOB_STATE_RECOVERING, grow)
                self._persist()
                return
            done = [a for a in self.members
                    if (p := self._progress.get(a)) is not None
                    and WorkerState.from_wire(p.worker_state) is WorkerState.DONE]
            if len(done) == len(self.members):
                self._set(S.JOB_STATE_DONE, f"trained {self.config.train.steps} steps")
                self._persist(finished=True)
                return
            await self._wait()

    def _hold_out(self, bad: list[str]) -> None:
        """Leave out agents the others cannot reach until they re-join or the time passes."""
        for agent_id in bad:  # the registry logs it and tells whoever listens
            self._unreachable[agent_id] = time.monotonic() + UNREACHABLE_HOLD_S
            self.registry.mark_lost(agent_id, "unreachable from the other agents "
                                    "when the job measured its links; left out for "
                                    f"{UNREACHABLE_HOLD_S:.0f} s or until it re-joins "
                                    "(check its --advertise address and firewall)")

    def _spares(self) -> list[AgentRecord]:
        """Live agents outside the job that a recovery or a grow-back could use."""
        now = time.monotonic()
        return [a for a in self.registry.alive() if a.agent_id not in self.members
                and self._unreachable.get(a.agent_id, 0.0) <= now]

    def _measure_spares(self) -> None:
        """While the job trains, measure the links of agents that joined since it was
        planned (to and from every member and spare, nothing else), so that growing back, or
        replacing a lost member, reuses stored links instead of stalling for a measurement."""
        cfg = self.config
        if (not cfg.measure_links or cfg.links_file or self.measurer.running
                or (self._spare_task is not None and not self._spare_task.done())
                or time.monotonic() < self._spare_retry_at):
            return
        spares = self._spares()
        ids = self.members + [a.agent_id for a in spares]
        if not spares or not self.measurer.missing_links(ids):
            return
        records = [r for a in self.members if (r := self.registry.get(a)) is not None]

        async def measure() -> None:
            await self.measurer.measure(records + spares, only_missing=True)
            if bad := self.links.unreachable_agents(ids):
                self._hold_out([a for a in bad if a not in self.members])
            self.poke()

        log.info("job %s: measuring the links of %d new agent(s) while training",
                 self.job_id, len(spares))
        self._spare_retry_at = time.monotonic() + SPARE_REMEASURE_S  # a failed link waits
        self._spare_task = asyncio.get_running_loop().create_task(measure())

    def _cancel_spare_measurement(self) -> None:
        if self._spare_task is not None and not self._spare_task.done():
            self._spare_task.cancel()
        self._spare_task = None

    async def _recover(self, failure: str) -> None:
        self.replan.cancel()  # a re-plan in the making is moot: the recovery plans anew
        self.recoveries.begin(failure, self._layout_text(), self._last_step())
        self._settle_after = self.registry.now()
        await self._stop_members(f"recovering: {failure}")
        self.restarts += 1
        permanent = self._permanent(failure)
        budget = self.config.max_restarts
        if permanent:
            self._set(S.JOB_STATE_FAILED, permanent)
        elif self.restarts > budget:
            self._set(S.JOB_STATE_FAILED,
                      f"{failure}; gave up after {budget} restarts in a row without a new "
                      f"checkpoint (raise --max-restarts, or find what keeps failing)")
        else:
            self._set(S.JOB_STATE_RECOVERING,
                      f"{failure}; rescheduling (restart {self.restarts} of {budget} "
                      f"without progress)")
        self._persist(finished=self.state == S.JOB_STATE_FAILED)

    def _last_step(self) -> int:
        return max((r.step for r in self._progress.values()), default=self.checkpoint_step)

    def _layout_text(self) -> str:
        return layout_text(self._layout.stages, self._layout.replicas) if self._layout else ""

    def _note_checkpoint(self) -> bool:
        """Whether every member has just passed a new checkpoint step. Progress refills the
        restart budget: faults days apart on a long job are not a failing job."""
        every = self.config.train.checkpoint_every
        if every <= 0 or not self.members:
            return False
        steps = [p.step for a in self.members if (p := self._progress.get(a)) is not None]
        if len(steps) < len(self.members) or min(steps) < 1:
            return False
        # a worker reports step s before it has written s's checkpoint; s + 1 proves it
        passed = newest_checkpoint(min(steps) - 1, every, self._sync_every or 1)
        # and a requested one (the re-plan's, `dtfm.core.requests`) once every member wrote it
        passed = max(passed, min(self._progress[a].checkpoint_step for a in self.members))
        done = all(WorkerState.from_wire(self._progress[a].worker_state) is WorkerState.DONE
                   for a in self.members)
        if done:
            passed = min(steps)  # the final checkpoint is written before a worker says done
        self._note_split(passed)
        if passed <= self.checkpoint_step:
            return False
        self.checkpoint_step = passed
        # one this epoch wrote (not the one it resumed from) is progress
        fresh = passed >= max(self._first_steps.values(), default=passed)
        if fresh:
            self.restarts = 0
        self._persist()
        return fresh

    def _note_split(self, passed: int) -> None:
        """Once every member has passed a checkpoint this epoch wrote (even one that rewrote
        an older step), the checkpoints hold this epoch's layer split: the next epoch re-cuts
        from it, not from the one this epoch resumed from."""
        wrote = passed > 0 and passed >= max(self._first_steps.values(), default=math.inf)
        if not wrote or not self._epoch_splits or self._trained_splits in (None,
                                                                            self._epoch_splits):
            return
        log.info("job %s: the checkpoint of step %d holds layers %s per stage (was %s)",
                 self.job_id, passed, ",".join(map(str, self._epoch_splits)),
                 ",".join(map(str, self._trained_splits or [])))
        self._trained_splits = list(self._epoch_splits)
        self._persist()

    def _grow_reason(self) -> str:
        """Why to stop at this checkpoint and re-plan on more agents ('' to go on)."""
        if self._wanted is None or self._layout is None or self._layout == self._wanted:
            return ""
        spare = self._spares()
        if self.config.measure_links and not self.config.links_file:
            # only newcomers already measured in the background: growing waits for them
            # instead of stalling every member for a measurement
            spare = [a for a in spare
                     if self.links.complete_for(self.members + [a.agent_id])]
        total = len(self.members) + len(spare)
        wanted = self._wanted.stages * self._wanted.replicas
        target = wanted if total >= wanted else self._shrink_to(
            [r for a in self.members if (r := self.registry.get(a)) is not None] + spare)
        if target <= len(self.members):
            return ""
        return (f"{len(spare)} more agent(s) alive: growing back from {self._layout_text()} "
                f"at the checkpoint of step {self.checkpoint_step}")

    def _check_adopted(self) -> None:
        """An adopted epoch goes on only if its members report again in time."""
        if not self._adopt_deadline:
            return
        silent = [a for a in self.members if a not in self._progress]
        if not silent:
            self._adopt_deadline = 0.0
            log.info("job %s: every member of epoch %d reported after the restart",
                     self.job_id, self.epoch)
        elif time.monotonic() > self._adopt_deadline:
            self._adopt_deadline = 0.0
            if not self._failure:
                self._failure = (f"member(s) {', '.join(silent)} did not report within "
                                 f"{ADOPT_WAIT_S:.0f} s of the coordinator's restart")

    def _permanent(self, failure: str) -> str:
        """Why `failure` will repeat the same way on every retry ('' when a retry may help).

        A rejected assignment or configuration fails identically every time; workers that
        cannot join their world in two epochs running, without training a step in either,
        point at addresses or ports that a retry will not fix (a lost agent would have been
        reported as lost instead)."""
        kind = self._failure_kind
        steps = max((r.step for r in self._progress.values()), default=0)
        last, self._last_epoch_failure = self._last_epoch_failure, (kind, steps)
        if kind == "config":
            return (f"{failure} (the job's configuration is invalid and would fail the same "
                    f"way again: fix it and restart the coordinator)")
        if kind == "rendezvous" and steps == 0 and last == ("rendezvous", 0):
            return (f"{failure} (workers could not join their world twice in a row: check that "
                    f"every agent's --advertise address is reachable from the others, that TCP "
                    f"ports 29500-30499 are open between them, or set the "
                    f"agents' --bind-interface)")
        return ""

    async def _stop_members(self, reason: str) -> None:
        for agent_id in self.members:
            rec = self.registry.get(agent_id)
            if rec is not None and rec.state == S.AGENT_STATE_ALIVE:
                self.registry.send(agent_id, coordinator_pb2.Command(
                    stop=coordinator_pb2.StopCommand(job_id=self.job_id, reason=reason)))

    async def shutdown(self) -> None:
        """Stop the members, unless the job is kept in a state directory: then the workers
        train on and the next coordinator process adopts them."""
        self._cancel_spare_measurement()
        self.replan.cancel()
        if self.state == S.JOB_STATE_RUNNING and self.store is None:
            await self._stop_members("coordinator shutting down")
        elif self.store is not None:
            self._persist()
            log.info("job %s: left running for the next coordinator (state in %s)",
                     self.job_id, self.store.path)
