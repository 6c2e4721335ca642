"""Runs the training worker as a child process and follows its progress, like torchrun's agent.

The daemon must never block on training, so the worker is a separate process in its own
session (a stop kills its whole group), started and followed through `dtfm.launcher`; its
JSON-lines progress becomes `WorkerProgress`. Whatever the worker does — finish, crash, hang on
a dead peer — the supervisor reports a state the coordinator can act on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.checkpoints import CheckpointCopier
from agent.statedir import checkpoint_dir, private_dir
from dtfm.core.events import ErrorEvent, ProgressEvent, StepEvent, WorkerEnv
from dtfm.core.spec import WorkerState
from dtfm.launcher import WorkerFiles, WorkerProcess, launch, worker_env
from protos.dtfm.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass
class WorkerProgress:
    job_id: str = ""
    epoch: int = 0
    state: WorkerState = WorkerState.IDLE  # STOPPED while a stop kills it, then IDLE
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
    pp_bytes_sent: int = 0  # this epoch's totals, from each step's counters
    dp_bytes_sent: int = 0

    def apply(self, event: ProgressEvent) -> None:
        """Fold one worker event in. A NaN loss or time leaves the last real value shown."""
        if isinstance(event, StepEvent):
            self.state = WorkerState.TRAINING
            self.step = event.step
            self.total_steps = event.total_steps or self.total_steps
            if not math.isnan(event.loss):
                self.loss = event.loss
            self.tokens_per_s = event.tokens_per_s
            self.pp_bytes_sent += event.pp_bytes
            self.dp_bytes_sent += event.dp_bytes
            for name in ("step_s", "compute_s", "pp_wait_s", "dp_s"):
                value = getattr(event, name)
                if not math.isnan(value):
                    setattr(self, name, value)
        elif isinstance(event, ErrorEvent):
            self.state = WorkerState.FAILED
            self.error = event.message or "unknown error"
            self.error_kind = event.kind


class Supervisor:
    def __init__(self, workdir: Path, on_change: Callable[[], None] = lambda: None,
                 python: str = sys.executable, bind_interface: str = "",
                 checkpoints: CheckpointCopier | None = None) -> None:
        self.workdir = workdir
        self.bind_interface = bind_interface
        # copies stage checkpoints from peers: before a worker starts, and mirrors while it runs
        self.checkpoints = checkpoints
        self._preparing: asyncio.Task[None] | None = None
        self.on_change = on_change
        self.python = python
        self.progress = WorkerProgress()
        self._worker: WorkerProcess | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._worker is not None and self._worker.poll() is None

    async def start(self, assignment: common_pb2.Assignment) -> None:
        await self.stop("replaced by a new assignment")
        private_dir(self.workdir)
        files = WorkerFiles.in_dir(
            self.workdir, f"{assignment.job_id}-e{assignment.epoch}-r{assignment.rank}")
        self.progress = WorkerProgress(job_id=assignment.job_id, epoch=assignment.epoch,
                                       state=WorkerState.STARTING,
                                       total_steps=assignment.train.steps)
        self.on_change()
        if not await self._prepare(assignment):
            return
        env = worker_env(bind_interface=self.bind_interface)
        # checkpoints are on by default: in this agent's state dir (workdir's parent) unless
        # the job names a --checkpoint-dir
        env[WorkerEnv.AGENT_CHECKPOINT_DIR] = str(checkpoint_dir(self.workdir.parent))
        self._worker = worker = launch(assignment, files, env, python=self.python)
        log.info("worker for %s rank %d (stage %d, replica %d) started as pid %d; log %s",
                 assignment.job_id, assignment.rank, assignment.stage, assignment.replica,
                 worker.pid, files.log)
        self._task = asyncio.create_task(self._follow(worker))
        if self.checkpoints is not None:
            self.checkpoints.start_mirrors(assignment)

    async def _prepare(self, assignment: common_pb2.Assignment) -> bool:
        """Fetch the stage's checkpoint from a peer when this agent lacks it (see
        `CheckpointCopier.prepare`); False when a stop or a newer assignment cancelled the
        fetch, so this worker must not start."""
        if self.checkpoints is None:
            return True
        task = asyncio.ensure_future(self.checkpoints.prepare(assignment))
        self._preparing = task
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                if self._preparing is task:
                    self._preparing = None
                raise
        if self._preparing is not task:  # stop() took it away, even if it had just finished
            return False
        self._preparing = None
        return True

    async def _follow(self, worker: WorkerProcess) -> None:
        async for event in worker.follow():
            self.progress.apply(event)
            self.on_change()
        if worker.returncode == 0 and self.progress.state != WorkerState.FAILED:
            self.progress.state = WorkerState.DONE
        elif self.progress.state not in (WorkerState.FAILED, WorkerState.STOPPED):
            self.progress.state = WorkerState.FAILED
            self.progress.error = (
                self.progress.error
                or f"worker exited with code {worker.returncode}: {worker.log_tail()}"
            )
        log.info("worker pid %d ended: %s %s", worker.pid, self.progress.state,
                 self.progress.error)
        self.on_change()

    async def stop(self, reason: str) -> None:
        if self.checkpoints is not None:
            await self.checkpoints.stop_mirrors()
        preparing, self._preparing = self._preparing, None
        if preparing is not None:
            log.info("cancelling the checkpoint fetch before the worker started: %s", reason)
            preparing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await preparing
            self.progress.state = WorkerState.IDLE
            self.on_change()
        worker = self._worker
        if worker is None or worker.poll() is not None:
            return
        log.info("stopping worker pid %d: %s", worker.pid, reason)
        self.progress.state = WorkerState.STOPPED
        await worker.stop_async()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.progress.state = WorkerState.IDLE
        self.on_change()
