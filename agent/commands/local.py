"""`agent local`: a whole training job on this machine, like `torchrun --standalone`.

Owns turning a handful of flags into one `dtfm.v1.Assignment` per rank (the same message the
coordinator sends), spawning the workers through `dtfm.launcher` exactly as the agent's
supervisor does, merging their progress into one stream, and tearing the job down the moment
any worker fails: the rest are killed and the error names the rank, its exit code and its
last stderr lines. This is the one worker-side module allowed to read `dtfm.core.presets`,
to turn a preset name into a spec.

A run's job id, and so its folder under --checkpoint-dir, is `local-<fingerprint>` of the
flags that must match to resume (`dtfm.core.fingerprint`, the coordinator's rule): rerunning
the same command resumes it, a run with other flags starts from step 0 beside it (a single id
`local` let a run with another seed "resume" a finished one and report done untrained), and a
rerun of a finished run says there is nothing to train instead of "done".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from dtfm import flags
from dtfm.core import checkpoints as ondisk
from dtfm.core import hfexport, lora
from dtfm.core.assignment import build_assignments
from dtfm.core.causes import EXPLAINED_BY_OTHERS, most_telling
from dtfm.core.events import FAULT_EXIT_CODE, DoneEvent, ErrorEvent, EvalEvent, StepEvent
from dtfm.core.fingerprint import fingerprinted, is_local_job, local_job_id
from dtfm.core.hfdir import check_dir, dir_hash, model_tokenizer_hash, resolve_spec
from dtfm.core.layout import Layout, layer_ranges, layer_splits
from dtfm.core.loradir import check_adapter_dir
from dtfm.core.presets import PRESETS
from dtfm.core.spec import SYNC_AUTO, TrainConfig
from dtfm.core.tokenfiles import SPLITS, check_data_path
from dtfm.core.words import stages_x_replicas
from dtfm.launcher import (
    Spare,
    WorkerFiles,
    WorkerProcess,
    launch,
    start_zygote,
    stop_all,
    worker_env,
)
from dtfm.procs import TERMINATED_STATUS, Terminated, sigterm_unwinds
from dtfm.rpc import free_port

DEFAULT_MODEL = "gpt-tiny"
POLL_S = 0.05
KILL_GRACE_S = 3.0
# how long a failure that another's usually explains (a peer's, a rendezvous') waits for the
# other workers' reports before it is named: the worker that refused its input exits first,
# but its neighbour's "Connection closed by peer" may be the first exit this loop sees
HOLD_S = 3.0


def _splits(text: str) -> str:
    """--layer-splits: empty, or comma-separated layer counts >= 1."""
    parts = [s.strip() for s in text.split(",") if s.strip()]
    if not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"expected layer counts >= 1 such as 3,1, got {text!r}")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `agent local` flags (validated by their types, as `coordinator start`'s are).

    The training flags are `coordinator start`'s own (`dtfm.flags.add_train_args`); `--warmup`,
    this command's old spelling of `--warmup-steps`, still works as argparse's unambiguous
    abbreviation of it.
    """
    p, positive = parser, flags.positive_count
    p.add_argument("--model", default="", help=f"preset: {', '.join(PRESETS)} (default: "
                   f"{DEFAULT_MODEL}, or the model --init-from names)")
    p.add_argument("--stages", type=positive, default=2, help="pipeline stages S")
    p.add_argument("--replicas", type=positive, default=2, help="data-parallel replicas R")
    p.add_argument("--layer-splits", type=_splits, default="",
                   help="layers per stage, e.g. 3,1")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=flags.number(int, 0, maximum=4096), default=0,
                   help="torch threads per worker (0: auto)")
    p.add_argument("--timeout", type=flags.seconds, default=300.0,
                   help="collective timeout, seconds")
    p.add_argument("--log-interval", type=positive, default=10,
                   help="steps between progress lines")
    p.add_argument("--json", action="store_true", help="one JSON object per step, then done")
    p.add_argument("--workdir", default="", help="keep assignments, progress and logs here")
    p.add_argument("--export-dir", default="", metavar="DIR",
                   help="after the last step, write the trained model there as a Hugging Face "
                   "directory (config.json, model.safetensors, tokenizer files)")
    p.add_argument("--tokenizer", default="", metavar="PATH",
                   help="with --export-dir: the tokenizer.json (or its directory) to export "
                   "(default: the one in --data's directory, else --init-from's)")
    p.add_argument("--force", action="store_true",
                   help="with --export-dir: replace a directory that is not empty")
    p.add_argument("--export-merged", action="store_true",
                   help="with --export-dir and --lora-rank: write the base with the adapters "
                   "merged in, a plain Hugging Face directory (default: a peft adapter "
                   "directory, adapter_config.json naming the base)")
    flags.add_train_args(p)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The job's `TrainConfig`, paths made absolute: they must not depend on a worker's cwd."""
    train = flags.train_config_from_args(args)
    for name in ("data_path", "checkpoint_dir", "init_from", "lora_init"):
        if getattr(train, name):
            setattr(train, name, str(Path(getattr(train, name)).resolve()))
    return train


@dataclass
class Proc:
    """One rank's worker and what its progress said so far."""

    rank: int
    worker: WorkerProcess
    done: DoneEvent | None = None
    dp_bytes: list[int] = field(default_factory=list)  # each step's data-parallel bytes sent
    error: str = ""
    kind: str = ""  # the error event's kind, "" until one arrives (dtfm/core/causes.py)


def dp_bytes_per_step(procs: list[Proc], sync_every: int = 1) -> int:
    """The data-parallel bytes one step sends, summed over every rank: each rank's median
    round of `sync_every` steps (a first step or a resumed one may differ) over its steps,
    measured by the workers' own counters. By round, since with local steps only a sync
    point sends (the median step would be 0)."""
    total = 0
    for p in procs:
        rounds = [sum(p.dp_bytes[i:i + sync_every])
                  for i in range(0, len(p.dp_bytes) - sync_every + 1, sync_every)]
        if rounds:
            total += int(statistics.median(rounds) / sync_every)
    return total


def root_failure(failed: list[Proc]) -> Proc:
    """The failed worker to name: the fault seam's victim (the others died of losing it),
    else the most telling kind (a worker that refused its input over the neighbours whose
    connections it closed), the lowest rank among equals."""
    victims = [p for p in failed if p.worker.returncode == FAULT_EXIT_CODE]
    return victims[0] if victims else most_telling(failed, lambda p: p.kind)


class LocalJob:
    """The spawned workers of one local job."""

    def __init__(self, args: argparse.Namespace, out: IO[str]) -> None:
        self.args, self.out = args, out
        self.train = train_config(args)
        self.train.validate(args.replicas)
        if self.train.sync_every == SYNC_AUTO:
            raise ValueError("--sync-every auto picks H from the links the coordinator "
                             "measured; agent local trains on one machine: give a number "
                             "(1: synchronous)")
        self.spec = resolve_spec(args.model or ("" if self.train.init_from else DEFAULT_MODEL),
                                 self.train.init_from, self.train.seq_len)
        lora.check(self.train, self.spec)
        if self.train.lora_init:  # its tensors must be the adapters the job says, here
            check_adapter_dir(self.train.lora_init, self.spec, self.train,
                              "--lora-init" if args.lora_init else "--init-from")
        self.init_hash = ""
        if self.train.init_from:
            check_dir(self.train.init_from)
            self.init_hash = dir_hash(self.train.init_from)
        self.layout = Layout(args.stages, args.replicas)
        check_local_data(self.train.data_path)
        check_data_path(self.train.data_path, self.spec.vocab_size,
                        model_tokenizer_hash(self.train.init_from))
        self.export = self._plan_export(args)
        splits = [int(s) for s in args.layer_splits.split(",") if s.strip()] or None
        self.splits = layer_splits(self.spec.n_layers, args.stages, splits)
        self.job_id = local_job_id(self.job_flags())
        self.backend = "nccl" if args.device == "cuda" else "gloo"
        self.gpus = self._check_gpus() if args.device == "cuda" else 0
        self.procs: list[Proc] = []
        self.zygote: Spare | None = None  # forks the workers (spawn); stopped by kill_all
        self.report_rank = self.layout.rank(self.layout.stages - 1, 0)
        self._first_step: tuple[int, float] | None = None

    def job_flags(self) -> dict[str, Any]:
        """What must match for a run to resume this one's checkpoints: the coordinator's rule
        (`coordinator.job.job_fingerprint`) for one machine: the model, the stages x replicas
        layout and its layer split, every training flag (seed, --lr, --steps, which shape the
        schedule, --data...) but where checkpoints go, and the --init-from weights' hash.
        Its fingerprint names the job and so its checkpoint folder (`dtfm.core.fingerprint`)."""
        train = {k: v for k, v in fingerprinted(self.train).items() if k != "checkpoint_dir"}
        return {"model": asdict(self.spec), "stages": self.layout.stages,
                "replicas": self.layout.replicas, "layer_split": self.splits, "train": train,
                **({"init_hash": self.init_hash} if self.init_hash else {})}

    def job_dir(self) -> Path | None:
        """This run's checkpoint folder (None: checkpoints off, or nowhere to keep them)."""
        if not self.train.checkpoint_dir or self.train.checkpoint_every == 0:
            return None
        return ondisk.job_dir(self.train.checkpoint_dir, self.job_id)

    def finished_step(self) -> int:
        """The step this run's checkpoints already hold intact in every stage when that is
        its last (an earlier run with the same flags finished it), else 0. Says on stderr what
        the workers are about to do with the checkpoint directory: resume this run's own
        steps, or start from step 0 beside other runs' folders, which they never load."""
        jdir = self.job_dir()
        if jdir is None:
            return 0
        common = self._common_steps(jdir)
        newest = max(common, default=0)
        last = self.train.steps
        if last > 0 and newest >= last and self._intact(jdir, newest):
            return newest
        if newest > 0:
            _note(f"resuming this run's checkpoints in {jdir} (every stage holds step {newest} "
                  f"of {last})")
            return 0
        others = [j for j in ondisk.other_jobs(self.train.checkpoint_dir, self.job_id)
                  if is_local_job(j)]
        if others:
            _note(f"{self.train.checkpoint_dir} holds checkpoints of {len(others)} other local "
                  f"run(s) ({', '.join(others)}), started with other flags (model, layout, "
                  f"training flags, data or --init-from): a run resumes only its own, so this "
                  f"one starts at step 0 in {jdir}")
        return 0

    def _common_steps(self, jdir: Path) -> set[int]:
        """Steps every stage holds complete (manifest and sizes: the cheap check)."""
        held = [{m.step for m in ondisk.complete_steps(jdir, s, self.job_id)}
                for s in range(self.layout.stages)]
        return set(held[0]).intersection(*held[1:])

    def _intact(self, jdir: Path, step: int) -> bool:
        """Whether every stage's `step` passes its checksums with this run's layer ranges."""
        ranges = layer_ranges(self.spec.n_layers, self.layout.stages, self.splits)
        return all(ondisk.verify(jdir, s, step, job_id=self.job_id, layers=ranges[s]) is None
                   for s in range(self.layout.stages))

    def report_finished(self, step: int) -> None:
        """Say that nothing was trained because the checkpoints already end the run: never a
        "done" line, which would read as a run that trained."""
        jdir = self.job_dir()
        if self.args.json:
            self._write({"nothing_to_train": True, "checkpoint_step": step,
                         "checkpoints": str(jdir)})
        print(f"agent local: nothing to train: {jdir} already holds step {step}, this run's "
              f"last, from an earlier run with the same flags; to train again from step 0, "
              f"delete that folder or give another --checkpoint-dir (a run with other flags, "
              f"--steps included, starts a folder of its own)", file=sys.stderr, flush=True)

    def _plan_export(self, args: argparse.Namespace) -> Path | None:
        """--export-dir: checked before training (a non-empty directory is refused unless
        --force, the base model or a directory holding it or inside it always, an unwritable
        place too); the stages' weights come from their checkpoints of the last step, in the
        workdir unless --checkpoint-dir names a place."""
        if args.export_merged and not (args.export_dir and self.train.lora_rank):
            raise ValueError("--export-merged writes a LoRA job's base with its adapters "
                             "merged: give it with --export-dir and --lora-rank")
        if not args.export_dir:
            return None
        if self.train.checkpoint_every == 0:
            raise ValueError("--export-dir needs the last step's checkpoint, which "
                             "--checkpoint-every 0 turns off: drop it")
        hfexport.check_not_base(args.export_dir, self.train.init_from, "--export-dir")
        hfexport.check_destination(args.export_dir, args.force, "--export-dir")
        hfexport.make_parent(args.export_dir, "--export-dir")  # writable: not after training
        if args.tokenizer:
            hfexport.tokenizer_sources(args.tokenizer)
        return Path(args.export_dir).resolve()

    def write_export(self, workdir: Path) -> None:
        """Write --export-dir from the stages' checkpoints of the newest step all hold."""
        assert self.export is not None
        root = Path(self.train.checkpoint_dir or workdir / "checkpoints")
        step, files = hfexport.local_stage_files(root, self.job_id, self.layout.stages)
        source = hfexport.export_source(self.train.data_path, self.train.init_from,
                                        self.args.tokenizer)
        say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        if self.train.lora_rank:  # a peft adapter directory, or the base with them merged
            from agent.worker.loramerge import write_lora_export  # torch: only here

            write_lora_export(self.export, self.spec, self.train, files, source=source,
                              force=self.args.force, merged=self.args.export_merged,
                              progress=say)
        else:
            hfexport.write_export(self.export, self.spec, files, source=source,
                                  force=self.args.force, progress=say)
        if not self.args.json:
            print(f"exported step {step} to {self.export}", file=self.out, flush=True)
        else:
            self._write({"exported": str(self.export), "export_step": step})

    def _check_gpus(self) -> int:
        import torch

        gpus = torch.cuda.device_count()
        if gpus < self.layout.world_size:
            raise RuntimeError(
                f"--device cuda needs one GPU per worker (NCCL cannot put two ranks on one "
                f"device): {self.layout.world_size} workers, {gpus} GPUs visible"
            )
        return gpus

    def spawn(self, workdir: Path) -> None:
        a = self.args
        assignments = build_assignments(
            job_id=self.job_id, epoch=0, layout=self.layout, spec=self.spec, train=self.train,
            master_addr="127.0.0.1", master_port=free_port(), backend=self.backend,
            splits=self.splits, init_hash=self.init_hash,
        )
        threads = a.threads or max(1, (os.cpu_count() or 1) // self.layout.world_size)
        envs = [worker_env(threads=threads, timeout_s=a.timeout,
                           local_rank=msg.rank % self.gpus if self.gpus else None)
                for msg in assignments]
        # one warm process forks every worker: S x R imports of torch become one
        if len(envs) > 1 and all(env == envs[0] for env in envs):
            self.zygote = start_zygote(workdir, envs[0])
        for msg, env in zip(assignments, envs, strict=True):
            files = WorkerFiles.in_dir(workdir, f"rank{msg.rank}")
            worker = self.zygote.fork(msg, files) if self.zygote is not None else None
            if worker is None:
                worker = launch(msg, files, env)
            self.procs.append(Proc(msg.rank, worker))

    def kill_all(self) -> None:
        stop_all([p.worker for p in self.procs], KILL_GRACE_S)
        if self.zygote is not None:
            self.zygote.stop(grace_s=1.0)

    def describe(self, p: Proc) -> str:
        stage, replica = self.layout.coords(p.rank)
        return f"rank {p.rank} (stage {stage}, replica {replica})"

    @staticmethod
    def _should_hold(failed: list[Proc], codes: list[int | None]) -> bool:
        """Whether to wait for more reports before naming the failure: every failure so far is
        one that another's usually explains, and some worker is still running."""
        return (any(c is None for c in codes)
                and all(p.worker.returncode != FAULT_EXIT_CODE
                        and (not p.kind or p.kind in EXPLAINED_BY_OTHERS) for p in failed))

    def monitor(self) -> int:
        """Merge progress until every worker exits; 0 on success, 1 on the first failure."""
        t_start, last_line, steps_seen = time.monotonic(), 0, 0
        failed_at = 0.0  # when the first failure was seen (HOLD_S)
        while True:
            codes = [p.worker.poll() for p in self.procs]  # before reading: no line is missed
            for p in self.procs:
                for ev in p.worker.read_events():
                    if isinstance(ev, ErrorEvent):
                        p.error, p.kind = ev.message, ev.kind
                    elif isinstance(ev, DoneEvent):
                        p.done = ev
                    elif isinstance(ev, EvalEvent) and p.rank == self.report_rank:
                        self._print_eval(ev)
                    elif isinstance(ev, StepEvent):
                        p.dp_bytes.append(ev.dp_bytes)
                        if p.rank != self.report_rank:
                            continue
                        steps_seen += 1
                        last_line = self._print_step(ev, t_start, steps_seen, last_line)
            failed = [p for p, c in zip(self.procs, codes, strict=True) if c not in (None, 0)]
            if failed and self._should_hold(failed, codes):
                failed_at = failed_at or time.monotonic()
                if time.monotonic() - failed_at < HOLD_S:
                    time.sleep(POLL_S)
                    continue
            if failed:
                first = root_failure(failed)
                self.kill_all()
                tail = first.worker.log_tail(15, sep="\n")
                msg = (
                    f"worker {self.describe(first)} exited with code {first.worker.returncode}"
                    + (f": {first.error}" if first.error else "")
                    + f"; stopped the other {len(self.procs) - 1} workers.\n"
                    f"last stderr lines of rank {first.rank}:\n{tail}"
                )
                if self.args.json:
                    self._write({"error": msg, "rank": first.rank,
                                 "exit_code": first.worker.returncode})
                print(f"agent local: {msg}", file=sys.stderr, flush=True)
                return 1
            if all(c == 0 for c in codes):
                if steps_seen == 0 and self.train.steps > 0:  # resumed at the last step
                    self.report_finished(self.train.steps)
                    return 0
                done = next((p.done for p in self.procs if p.rank == self.report_rank), None)
                val = None if done is None else done.val_loss
                if self.args.json:
                    self._write({"done": True, "val_loss": val,
                                 "dp_bytes_per_step": dp_bytes_per_step(self.procs,
                                                                         self.train.sync_every)})
                else:
                    print(f"done in {time.monotonic() - t_start:.1f}s | val loss {val:.4f}"
                          if isinstance(val, float) else "done", file=self.out, flush=True)
                return 0
            time.sleep(POLL_S)

    def _write(self, obj: dict[str, Any]) -> None:
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()

    def _print_eval(self, ev: EvalEvent) -> None:
        """A validation evaluation (`--eval-every`, and after the last step)."""
        if self.args.json:
            self._write({"val_step": ev.step, "val_loss": ev.val_loss})
        else:
            print(f"step {ev.step:>6} | val loss {ev.val_loss:.4f}", file=self.out, flush=True)

    def _print_step(self, ev: StepEvent, t0: float, seen: int, last: int) -> int:
        step, total = ev.step, ev.total_steps or self.train.steps
        if self.args.json:
            self._write({"step": step, "loss": ev.loss, "tokens_per_s": ev.tokens_per_s})
            return step
        interval = max(1, self.args.log_interval)
        if step % interval and step != total and seen != 1:
            return last
        now = time.monotonic()
        if self._first_step is None:
            self._first_step = (step, now)
        first, t_first = self._first_step
        eta = (now - t_first) / (step - first) * (total - step) if step > first else float("nan")
        print(
            f"step {step:>6}/{total} | loss {ev.loss:.4f} | "
            f"{ev.tokens_per_s:,.0f} tok/s | ETA {flags.hms(eta)}",
            file=self.out, flush=True,
        )
        return step


def check_local_data(data_path: str) -> None:
    """`--data` must be on this machine, where every worker reads it: refused before any
    worker starts (a coordinator cannot check this; its agents hold the data)."""
    if not data_path:
        return
    p = Path(data_path)
    if not p.exists():
        raise ValueError(f"--data {data_path}: no such file or directory; give the directory "
                         f"`agent prepare` wrote (train.bin, val.bin, meta.json) or a .bin "
                         f"token file, or leave --data out to train on the bundled corpus")
    if p.is_dir():
        missing = [name for name in SPLITS.values() if not (p / name).is_file()]
        if missing:
            raise ValueError(f"--data {data_path}: the directory holds no "
                             f"{' and no '.join(missing)}; give the directory `agent prepare` "
                             f"wrote (train.bin, val.bin, meta.json) or a .bin token file")


def _note(message: str) -> None:
    print(f"agent local: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Run a local job; returns the process exit status."""
    try:
        job = LocalJob(args, sys.stdout)
    except (ValueError, RuntimeError, hfexport.ExportError) as e:
        print(f"agent local: {e}", file=sys.stderr)
        return 2
    if not args.json:
        print(
            f"agent local: {job.spec.name} ({job.spec.param_count():,} params) on "
            f"{stages_x_replicas(args.stages, args.replicas)}, layers {job.splits}, "
            f"{args.schedule}, dp {args.dp_mode}, batch {args.batch} in "
            f"{args.micro_batches} micro-batches, {args.steps} steps",
            flush=True,
        )
    ctx = (tempfile.TemporaryDirectory(prefix="dtfm-local-") if not args.workdir
           else _KeepDir(args.workdir))
    with ctx as workdir, sigterm_unwinds():
        try:
            if job.export is not None and not job.train.checkpoint_dir:
                job.train.checkpoint_dir = str(Path(workdir).resolve() / "checkpoints")
            finished = job.finished_step()
            if finished:
                job.report_finished(finished)
                code = 0
            else:
                job.spawn(Path(workdir))
                code = job.monitor()
            if code == 0 and job.export is not None:
                job.write_export(Path(workdir))
            return code
        except hfexport.ExportError as e:
            print(f"agent local: export failed: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("agent local: interrupted; stopping workers", file=sys.stderr)
            return 130
        except Terminated:
            print("agent local: terminated (SIGTERM); stopping workers", file=sys.stderr)
            return TERMINATED_STATUS
        finally:
            job.kill_all()


class _KeepDir:
    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> str:
        Path(self.path).mkdir(parents=True, exist_ok=True)
        return self.path

    def __exit__(self, *exc: object) -> None:
        return None


def main(argv: list[str] | None = None) -> int:
    return flags.standalone("agent local", "Train on this machine with S x R worker processes.",
                              add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
