"""Runs the training worker as a child process and follows its progress, like torchrun's agent.

The daemon must never block on training, so the worker is a separate process in its own
session (a stop kills its whole group); it appends JSON lines to a progress file that the
supervisor tails. Whatever the worker does — finish, crash, hang on a dead peer — the
supervisor reports a state the coordinator can act on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.statedir import open_private_append, private_dir, write_private
from protos.dtfm.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass
class WorkerProgress:
    job_id: str = ""
    epoch: int = 0
    state: str = "idle"  # idle, starting, training, done, failed
    step: int = 0
    total_steps: int = 0
    loss: float = 0.0
    tokens_per_s: float = 0.0
    error: str = ""
    error_kind: str = ""  # config, rendezvous, peer, internal (see the worker's error event)
    step_s: float = 0.0  # the last step's time and its split
    compute_s: float = 0.0
    pp_wait_s: float = 0.0
    dp_s: float = 0.0


class Supervisor:
    def __init__(self, workdir: Path, on_change: Callable[[], None] = lambda: None,
                 python: str = sys.executable, bind_interface: str = "") -> None:
        self.workdir = workdir
        self.bind_interface = bind_interface
        self.on_change = on_change
        self.python = python
        self.progress = WorkerProgress()
        self._proc: subprocess.Popen[bytes] | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    async def start(self, assignment: common_pb2.Assignment) -> None:
        await self.stop("replaced by a new assignment")
        private_dir(self.workdir)
        stem = f"{assignment.job_id}-e{assignment.epoch}-r{assignment.rank}"
        spec_path = self.workdir / f"{stem}.assignment.pb"
        progress_path = self.workdir / f"{stem}.progress.jsonl"
        log_path = self.workdir / f"{stem}.log"
        write_private(spec_path, assignment.SerializeToString())
        progress_path.unlink(missing_ok=True)
        self.progress = WorkerProgress(job_id=assignment.job_id, epoch=assignment.epoch,
                                       state="starting", total_steps=assignment.train.steps)
        self.on_change()
        # subprocess.Popen, not the event loop's fork: CPython spawns with vfork/posix_spawn,
        # which skips grpc's fork handlers; a plain fork() of this grpc process can crash the
        # child (seen here as SIGSEGV before exec under uvloop).
        with open_private_append(log_path) as log_file:
            self._proc = subprocess.Popen(
                [self.python, "-m", "agent.worker", "--assignment", str(spec_path),
                 "--progress", str(progress_path)],
                stdout=log_file, stderr=log_file, stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=self._worker_env(),
            )
        log.info("worker for %s rank %d (stage %d, replica %d) started as pid %d; log %s",
                 assignment.job_id, assignment.rank, assignment.stage, assignment.replica,
                 self._proc.pid, log_path)
        self._task = asyncio.create_task(self._follow(self._proc, progress_path, log_path))

    def _worker_env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "DTFM_SUPERVISOR_PID": str(os.getpid())}
        if self.bind_interface:
            env["DTFM_BIND_INTERFACE"] = self.bind_interface
        return env

    async def _follow(self, proc: subprocess.Popen[bytes], progress_path: Path,
                      log_path: Path) -> None:
        offset = 0
        while True:
            offset = self._read_progress(progress_path, offset)
            if proc.poll() is not None:
                break
            await asyncio.sleep(0.25)
        self._read_progress(progress_path, offset)
        if proc.returncode == 0 and self.progress.state != "failed":
            self.progress.state = "done"
        elif self.progress.state not in ("failed", "stopped"):
            self.progress.state = "failed"
            self.progress.error = (
                self.progress.error
                or f"worker exited with code {proc.returncode}: {_tail(log_path)}"
            )
        log.info("worker pid %d ended: %s %s", proc.pid, self.progress.state,
                 self.progress.error)
        self.on_change()

    def _read_progress(self, path: Path, offset: int) -> int:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return offset
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            kind = event.get("event")
            if kind == "step":
                self.progress.state = "training"
                self.progress.step = int(event.get("step", 0))
                self.progress.total_steps = int(event.get("total_steps",
                                                          self.progress.total_steps))
                loss = event.get("loss")
                if isinstance(loss, int | float) and loss == loss:
                    self.progress.loss = float(loss)
                self.progress.tokens_per_s = float(event.get("tokens_per_s", 0.0) or 0.0)
                for name in ("step_s", "compute_s", "pp_wait_s", "dp_s"):
                    value = event.get(name)
                    if isinstance(value, int | float) and value == value:
                        setattr(self.progress, name, float(value))
            elif kind == "error":
                self.progress.state = "failed"
                self.progress.error = str(event.get("message", "unknown error"))
                self.progress.error_kind = str(event.get("kind", "internal"))
            self.on_change()
        return offset + end

    async def stop(self, reason: str) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        log.info("stopping worker pid %d: %s", proc.pid, reason)
        self.progress.state = "stopped"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        for _ in range(100):
            if proc.poll() is not None:
                break
            await asyncio.sleep(0.1)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.to_thread(proc.wait)
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.progress.state = "idle"
        self.on_change()


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(deque(text, maxlen=lines)) or "(empty log)"
