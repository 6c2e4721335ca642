"""Helpers for the worker tests: run `python -m agent.local` for real and always reap it, or
its workers as the coordinator assigns them."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]


@dataclass
class LocalRun:
    rc: int
    steps: list[dict[str, Any]] = field(default_factory=list)
    done: dict[str, Any] | None = None
    stderr: str = ""
    stdout: str = ""
    nothing_to_train: dict[str, Any] | None = None  # the run found its last step checkpointed
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, val loss)
    failed_at: dict[int, int] = field(default_factory=dict)  # rank -> its error event's step

    @property
    def losses(self) -> list[float]:
        return [float(s["loss"]) for s in self.steps]


STARTUP = " start-up: "  # the worker's own start-up log line (agent/worker/__main__.py)


def worker_pids(workdir: Path, ranks: int) -> dict[int, int]:
    """rank -> pid of the `agent local --workdir` workers that have logged their start-up
    line (forked from a zygote, a worker's command line is the zygote's, so its log says)."""
    found = {}
    for r in range(ranks):
        try:
            text = (workdir / f"rank{r}.log").read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if STARTUP in line:
                found[r] = int(json.loads(line.split(STARTUP, 1)[1])["pid"])
    return found


def run_local(
    *flags: str, timeout: float = 120.0, env: dict[str, str] | None = None
) -> LocalRun:
    """Run a local job with `--json`; kills the launcher's whole session on any exit path."""
    cmd = [sys.executable, "-m", "agent.commands.local", "--json", "--threads", "1", *flags]
    full_env = {**os.environ, "DTFM_LOG_LEVEL": "WARNING", **(env or {})}
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=full_env, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    run = LocalRun(proc.returncode, stderr=err, stdout=out)
    for line in out.splitlines():
        obj = json.loads(line)
        if "step" in obj:
            run.steps.append(obj)
        elif "val_step" in obj:
            run.evals.append((obj["val_step"], obj["val_loss"]))
        elif obj.get("done"):
            run.done = obj
        elif obj.get("nothing_to_train"):
            run.nothing_to_train = obj
    return run


def local_job_dir(ckpt: Path) -> Path:
    """The one `agent local` run's folder under checkpoint directory `ckpt`
    (`local-<fingerprint of its flags>`, `dtfm.core.fingerprint`)."""
    found = sorted(p for p in ckpt.iterdir() if p.name.startswith("local-"))
    assert len(found) == 1, f"expected one local run's folder in {ckpt}: {found}"
    return found[0]


def assert_resumed(resumed: LocalRun, full: LocalRun, after: int, rel: float = 1e-6) -> None:
    """A run resumed after step `after` trained the rest of `full`'s steps to its losses and
    validation loss."""
    assert resumed.rc == 0, resumed.stderr
    assert [s["step"] for s in resumed.steps] == list(range(after + 1, len(full.steps) + 1))
    assert_close(resumed.losses, full.losses[after:], rel)
    assert resumed.done is not None and full.done is not None
    assert abs(resumed.done["val_loss"] - full.done["val_loss"]) <= rel * full.done["val_loss"]


def assert_close(a: list[float], b: list[float], rel: float) -> None:
    assert len(a) == len(b) and a, (a, b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert abs(x - y) <= rel * abs(y), f"step {i + 1}: {x} vs {y} (rel {rel})"


def run_workers(flags: Sequence[str], stages: int, ckpt: Path, workdir: Path,
                old_split: list[int] | None = None, fault: str = "", timeout: float = 120.0,
                checkpoint_at: int = 0, job_id: str = "local") -> LocalRun:
    """Spawn a stages x 1 job's workers (`agent local` flags) from the coordinator's
    assignment builder as job `job_id` (to go on from a local run: `local_job_dir(ckpt).name`,
    as a coordinator's job keeps its id across layouts), with `old_split` as the split the
    checkpoints in `ckpt` hold, and,
    with `checkpoint_at`, ask each for a checkpoint after that step as its agent would
    (`dtfm.core.requests`) right after it starts; the last stage's steps, as `agent local`
    reports them (with each step event's `checkpoint_step`)."""
    from agent.commands.local import add_arguments, train_config
    from dtfm.core.assignment import build_assignments
    from dtfm.core.events import DoneEvent, ErrorEvent, StepEvent
    from dtfm.core.layout import Layout
    from dtfm.core.presets import get_preset
    from dtfm.core.requests import ask_checkpoint
    from dtfm.launcher import WorkerFiles, launch, stop_all, worker_env
    from dtfm.rpc import free_port

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([*flags, "--checkpoint-dir", str(ckpt)])
    layout = Layout(stages, 1)
    assignments = build_assignments(
        job_id=job_id, epoch=1, layout=layout, spec=get_preset(args.model),
        train=train_config(args), master_addr="127.0.0.1", master_port=free_port(),
        checkpoint_splits=old_split)
    workdir.mkdir(parents=True, exist_ok=True)
    env = worker_env(threads=1, timeout_s=30, base={
        **os.environ, "DTFM_LOG_LEVEL": "INFO",
        **({"DTFM_FAULT": fault} if fault else {})})
    workers = [launch(a, WorkerFiles.in_dir(workdir, f"rank{a.rank}"), env)
               for a in assignments]
    run = LocalRun(rc=0)
    try:
        if checkpoint_at:  # seconds before the first step: the worker is importing torch
            for w in workers:
                ask_checkpoint(w.files.requests, checkpoint_at)
        deadline = time.monotonic() + timeout
        while any(w.poll() is None for w in workers):
            assert time.monotonic() < deadline, "workers did not finish in time"
            time.sleep(0.2)
        last = workers[layout.rank(stages - 1, 0)]
        for ev in last.read_events():
            if isinstance(ev, StepEvent):
                run.steps.append({"step": ev.step, "loss": ev.loss,
                                  "checkpoint_step": ev.checkpoint_step})
            elif isinstance(ev, DoneEvent):
                run.done = {"val_loss": ev.val_loss, "step": ev.step,
                            "resumed_step": ev.resumed_step}
            elif isinstance(ev, ErrorEvent):
                run.stderr += ev.message
        run.failed_at = {ev.rank: ev.step for w in workers for ev in w.read_events()
                         if isinstance(ev, ErrorEvent)}
        run.rc = max(abs(w.returncode or 0) for w in workers)
        run.stderr += " | ".join(w.log_tail(20) for w in workers)
    finally:
        stop_all(workers, 5.0)
    return run


@dataclass
class Shrunk:
    """What `shrink_to_one_stage` leaves: the uninterrupted run, and the checkpoint directory
    and job folder the shrunk run went on in (its step 8 on one stage, its old cut's step 4)."""

    full: LocalRun
    ckpt: Path
    job_dir: Path


def shrink_to_one_stage(flags: Sequence[str], tmp_path: Path, rel: float) -> Shrunk:
    """The re-split tests' first half, for a 2-stage job of `flags` (checkpoints every 4 steps,
    at least 10 steps): its uninterrupted run; the same run whose last stage dies before step 6;
    one stage resuming from both old stages' step 4 (`checkpoint_splits` [2, 2], as a coordinator
    assigns it after a shrink) that dies before step 10, after checkpoint 8. Asserts the one
    stage's losses equal the uninterrupted run's to `rel` and that it read both old stages."""
    full = run_local(*flags, "--stages", "2", "--replicas", "1",
                     "--checkpoint-dir", str(tmp_path / "full"))
    assert full.rc == 0, full.stderr
    ckpt = tmp_path / "ckpt"
    two = run_local(*flags, "--stages", "2", "--replicas", "1", "--checkpoint-dir", str(ckpt),
                    env={"DTFM_FAULT": "1:6"})  # the last stage dies before step 6
    assert two.rc != 0 and [s["step"] for s in two.steps] == [1, 2, 3, 4, 5], two.stderr
    job_dir = local_job_dir(ckpt)  # the workers go on as that job, as a coordinator's do
    one = run_workers(flags, 1, ckpt, tmp_path / "one", [2, 2], fault="0:10",
                      job_id=job_dir.name)
    assert [s["step"] for s in one.steps] == [5, 6, 7, 8, 9], one.stderr
    assert_close([float(s["loss"]) for s in one.steps], full.losses[4:9], rel)
    log = (tmp_path / "one" / "rank0.log").read_text()
    assert "resumed at step 4 from stage 0 (layers 0-1), stage 1 (layers 2-3)" in log, log
    return Shrunk(full, ckpt, job_dir)


def step_events(workdir: Path) -> dict[int, list[dict[str, object]]]:
    """Every rank's step events in an `agent local --workdir` folder, by rank."""
    return rank_events(workdir, "step")


def rank_events(workdir: Path, kind: str) -> dict[int, list[dict[str, object]]]:
    """Every rank's events of `kind` ("step", "integrity", ...) in an `agent local
    --workdir` folder, by rank."""
    out: dict[int, list[dict[str, object]]] = {}
    for path in sorted(workdir.glob("rank*.progress.jsonl")):
        rank = int(path.name.removeprefix("rank").split(".")[0])
        out[rank] = [e for line in path.read_text().splitlines()
                     if (e := json.loads(line)).get("event") == kind]
    return out
