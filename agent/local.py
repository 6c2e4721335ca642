"""`agent local`: a whole training job on this machine, like `torchrun --standalone`.

Owns turning a handful of flags into one `dtfm.v1.Assignment` per rank (the same message the
coordinator sends), spawning the workers through `dtfm.launcher` exactly as the agent's
supervisor does, merging their progress into one stream, and tearing the job down the moment
any worker fails: the rest are killed and the error names the rank, its exit code and its
last stderr lines. This is the one worker-side module allowed to read `dtfm.core.presets`,
to turn a preset name into a spec.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from dtfm import flags
from dtfm.core import hfexport, lora
from dtfm.core.assignment import build_assignments
from dtfm.core.events import FAULT_EXIT_CODE, DoneEvent, ErrorEvent, StepEvent
from dtfm.core.hfconfig import read_hf_config
from dtfm.core.hfdir import check_dir, dir_hash, model_tokenizer_hash, resolve_spec
from dtfm.core.layout import Layout, layer_splits
from dtfm.core.presets import PRESETS
from dtfm.core.spec import SYNC_AUTO, TrainConfig
from dtfm.core.tokenfiles import check_data_path
from dtfm.launcher import WorkerFiles, WorkerProcess, launch, stop_all, worker_env
from dtfm.rpc import free_port

DEFAULT_MODEL = "gpt-tiny"
POLL_S = 0.05
KILL_GRACE_S = 3.0


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
    for name in ("data_path", "checkpoint_dir", "init_from"):
        if getattr(train, name):
            setattr(train, name, str(Path(getattr(train, name)).resolve()))
    return train


@dataclass
class Proc:
    """One rank's worker and what its progress said so far."""

    rank: int
    worker: WorkerProcess
    done: DoneEvent | None = None
    error: str = ""


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
        self.init_hash = ""
        if self.train.init_from:
            check_dir(self.train.init_from)
            self.init_hash = dir_hash(self.train.init_from)
        self.layout = Layout(args.stages, args.replicas)
        self.export = self._plan_export(args)
        check_data_path(self.train.data_path, self.spec.vocab_size,
                        model_tokenizer_hash(self.train.init_from))
        splits = [int(s) for s in args.layer_splits.split(",") if s.strip()] or None
        self.splits = layer_splits(self.spec.n_layers, args.stages, splits)
        self.backend = "nccl" if args.device == "cuda" else "gloo"
        self.gpus = self._check_gpus() if args.device == "cuda" else 0
        self.procs: list[Proc] = []
        self.report_rank = self.layout.rank(self.layout.stages - 1, 0)
        self._first_step: tuple[int, float] | None = None

    def _plan_export(self, args: argparse.Namespace) -> Path | None:
        """--export-dir: checked before training (a non-empty directory is refused unless
        --force); the stages' weights come from their checkpoints of the last step, in the
        workdir unless --checkpoint-dir names a place."""
        if args.export_merged and not (args.export_dir and self.train.lora_rank):
            raise ValueError("--export-merged writes a LoRA job's base with its adapters "
                             "merged: give it with --export-dir and --lora-rank")
        if not args.export_dir:
            return None
        if self.train.checkpoint_every == 0:
            raise ValueError("--export-dir needs the last step's checkpoint, which "
                             "--checkpoint-every 0 turns off: drop it")
        hfexport.check_destination(args.export_dir, args.force)
        if args.tokenizer:
            hfexport.tokenizer_sources(args.tokenizer)
        return Path(args.export_dir).resolve()

    def write_export(self, workdir: Path) -> None:
        """Write --export-dir from the stages' checkpoints of the newest step all hold."""
        assert self.export is not None
        root = Path(self.train.checkpoint_dir or workdir / "checkpoints")
        step, files = hfexport.local_stage_files(root, "local", self.layout.stages)
        tokenizer = self.args.tokenizer or hfexport.find_tokenizer(self.train.data_path,
                                                                   self.train.init_from)
        source = read_hf_config(self.train.init_from) if self.train.init_from else None
        if self.train.lora_rank:  # a peft adapter directory, or the base with them merged
            from agent.worker.loramerge import write_lora_export  # torch: only here

            write_lora_export(self.export, self.spec, self.train, files, tokenizer=tokenizer,
                              force=self.args.force, merged=self.args.export_merged,
                              progress=lambda line: print(line, file=sys.stderr, flush=True))
        else:
            hfexport.write_export(self.export, self.spec, files, tokenizer=tokenizer,
                                  force=self.args.force, source_config=source,
                                  progress=lambda line: print(line, file=sys.stderr,
                                                              flush=True))
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
            job_id="local", epoch=0, layout=self.layout, spec=self.spec, train=self.train,
            master_addr="127.0.0.1", master_port=free_port(), backend=self.backend,
            splits=self.splits, init_hash=self.init_hash,
        )
        threads = a.threads or max(1, (os.cpu_count() or 1) // self.layout.world_size)
        for msg in assignments:
            r = msg.rank
            env = worker_env(threads=threads, timeout_s=a.timeout,
                             local_rank=r % self.gpus if self.gpus else None)
            worker = launch(msg, WorkerFiles.in_dir(workdir, f"rank{r}"), env)
            self.procs.append(Proc(r, worker))

    def kill_all(self) -> None:
        stop_all([p.worker for p in self.procs], KILL_GRACE_S)

    def describe(self, p: Proc) -> str:
        stage, replica = self.layout.coords(p.rank)
        return f"rank {p.rank} (stage {stage}, replica {replica})"

    def monitor(self) -> int:
        """Merge progress until every worker exits; 0 on success, 1 on the first failure."""
        t_start, last_line, steps_seen = time.monotonic(), 0, 0
        while True:
            codes = [p.worker.poll() for p in self.procs]  # before reading: no line is missed
            for p in self.procs:
                for ev in p.worker.read_events():
                    if isinstance(ev, ErrorEvent):
                        p.error = ev.message
                    elif isinstance(ev, DoneEvent):
                        p.done = ev
                    elif isinstance(ev, StepEvent) and p.rank == self.report_rank:
                        steps_seen += 1
                        last_line = self._print_step(ev, t_start, steps_seen, last_line)
            failed = [p for p, c in zip(self.procs, codes, strict=True) if c not in (None, 0)]
            if failed:
                # the fault seam's victim first: the others died of losing it
                first = min(failed, key=lambda p: p.worker.returncode != FAULT_EXIT_CODE)
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
                done = next((p.done for p in self.procs if p.rank == self.report_rank), None)
                val = None if done is None else done.val_loss
                if self.args.json:
                    self._write({"done": True, "val_loss": val})
                else:
                    print(f"done in {time.monotonic() - t_start:.1f}s | val loss {val:.4f}"
                          if isinstance(val, float) else "done", file=self.out, flush=True)
                return 0
            time.sleep(POLL_S)

    def _write(self, obj: dict[str, Any]) -> None:
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()

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


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


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
            f"{args.stages} stages x {args.replicas} replicas, layers {job.splits}, "
            f"{args.schedule}, dp {args.dp_mode}, batch {args.batch} in "
            f"{args.micro_batches} micro-batches, {args.steps} steps",
            flush=True,
        )
    ctx = (tempfile.TemporaryDirectory(prefix="dtfm-local-") if not args.workdir
           else _KeepDir(args.workdir))
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    with ctx as workdir:
        try:
            if job.export is not None and not job.train.checkpoint_dir:
                job.train.checkpoint_dir = str(Path(workdir).resolve() / "checkpoints")
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
        finally:
            job.kill_all()
            signal.signal(signal.SIGTERM, previous)


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
