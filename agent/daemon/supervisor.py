"""Runs the training worker as a child process and follows its progress, like torchrun's agent.

The daemon must never block on training, so the worker is a separate process in its own
session (a stop kills its whole group), started and followed through `dtfm.launcher`; its
JSON-lines progress becomes `WorkerProgress`. Whatever the worker does — finish, crash, hang on
a dead peer — the supervisor reports a state the coordinator can act on.

With `prewarm` (the agent's default) it keeps one spare worker (`dtfm.launcher.Spare`) that
has already imported python, torch and the worker's modules, and hands it the next
assignment instead of starting a process then: that import was the largest part of the time
from an assignment to the first step on a busy machine, and every recovery pays it again.
The spare is a zygote (agent/worker/zygote.py): once warm it forks each assignment's worker,
already warm, and stays for the next, so a recovery, a move or the next job costs no import
at all. An assignment that finds it still importing raises it to the agent's priority and
waits for it (what a fresh worker would pay from scratch). Only a spare that is gone or
started with another environment is replaced, after the worker's first step, so its import
does not compete with that worker's start. The spare is in its own session like a worker,
dies with the agent (parent-death signal, and end of its stdin), and `close` ends it; its
forked workers die with it. A spare that refuses to fork (CUDA initialized in it, or
`DTFM_FORK_WORKERS=0`) makes this agent's spares plain ones from then on: each becomes the
worker it is handed, as before zygotes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agent.daemon.statedir import checkpoint_dir, private_dir
from dtfm.checkpoints.copies import CheckpointCopier
from dtfm.checkpoints.push import CheckpointPushes
from dtfm.core.breakdown import Breakdown, measured
from dtfm.core.events import (
    DoneEvent,
    ErrorEvent,
    EvalEvent,
    IntegrityEvent,
    ProgressEvent,
    StepEvent,
    WorkerEnv,
    failed_at,
)
from dtfm.core.limits import MAX_LINK_WINDOWS, MAX_PENDING_EVIDENCE, MAX_VALIDATIONS
from dtfm.core.requests import ask_checkpoint
from dtfm.core.spareprio import raise_to_mine
from dtfm.core.workerstate import WorkerState
from dtfm.launcher import SPARE_LOG, Spare, WorkerFiles, WorkerProcess, launch, worker_env
from dtfm.net.dataplane import HANDOFF_ENV
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
    failed_step: int = -1  # the step its error event says it failed at (-1: no error event)
    step_s: float = 0.0  # the last step's time and its split
    compute_s: float = 0.0
    pp_wait_s: float = 0.0
    dp_s: float = 0.0
    pp_bytes_sent: int = 0  # this epoch's totals, from each step's counters
    dp_bytes_sent: int = 0
    startup_s: float = 0.0  # from the assignment to its first step event (0: none yet)
    resumed_step: int = -1  # the step the worker resumed after (-1: not known yet)
    checkpoint_step: int = 0  # the newest step the worker has checkpointed (0: none yet)
    sync_every: int = 1  # local steps: H, the round of the last step, the last sync's drift
    sync_round: int = 0
    drift: float = 0.0
    # (step, validation loss) of the worker's newest evaluations, oldest first (--eval-every)
    validations: list[tuple[int, float]] = field(default_factory=list)
    # the worker's failed replica checks (--verify) that no heartbeat has delivered yet,
    # oldest first: each heartbeat carries the oldest MAX_EVIDENCE and the acknowledged ones
    # leave (`delivered`). It used to carry the newest 16, and a fast job's heartbeat then
    # missed an attack's first steps: the coordinator proved it bad from step 13, not 8, and
    # a rollback bound 5 steps late keeps 5 poisoned updates.
    integrity: list[IntegrityEvent] = field(default_factory=list)
    integrity_dropped: int = 0  # records past MAX_PENDING_EVIDENCE (newest dropped)
    dropped_from: int = 0  # the step of the first record dropped (0: none)
    # the newest step whose records the worker has all emitted, as its last step event
    # said (-1: that step's; a weights digest in flight keeps the steps it covers open)
    judged_through: int = -1
    # the last step split into parts that add up to it (dtfm/core/breakdown.py)
    breakdown: Breakdown = field(default_factory=Breakdown)
    # (window step, its four pipeline-link figures) of the worker's newest windows, oldest
    # first (agent/worker/linkstats.py): each heartbeat carries them all
    link_windows: list[tuple[int, tuple[float, ...]]] = field(default_factory=list)

    def delivered(self, count: int) -> None:
        """A heartbeat carrying the oldest `count` integrity records was acknowledged."""
        del self.integrity[:count]

    def evidence_through(self, sending: int) -> int:
        """The newest step whose records will all have been sent once a heartbeat carrying
        the oldest `sending` of them is: the worker emits a step's records before its step
        event, so with none left waiting that is its step, or the step before the ones a
        weights digest still in flight covers (`judged_through`). The coordinator waits for every
        member's before it calls a checkpoint known-good, so a fast job whose evidence lags
        its steps by a heartbeat does not vet a checkpoint that evidence still in flight
        would have condemned."""
        through = self.step if self.judged_through < 0 else min(self.step, self.judged_through)
        if waiting := self.integrity[sending:]:
            through = min(through, min(e.step for e in waiting) - 1)
        if self.dropped_from:  # those records are gone: nothing from there on is complete
            through = min(through, self.dropped_from - 1)
        return max(through, 0)

    def apply(self, event: ProgressEvent) -> None:
        """Fold one worker event in. A NaN loss or time leaves the last real value shown."""
        if isinstance(event, StepEvent):
            self.state = WorkerState.TRAINING
            self.step = event.step
            self.judged_through = event.judged_through
            self.total_steps = event.total_steps or self.total_steps
            if not math.isnan(event.loss):
                self.loss = event.loss
            self.tokens_per_s = event.tokens_per_s
            if event.resumed_step >= 0:
                self.resumed_step = event.resumed_step
            self.checkpoint_step = event.checkpoint_step
            self.pp_bytes_sent += event.pp_bytes
            self.dp_bytes_sent += event.dp_bytes
            self.sync_every, self.sync_round = event.sync_every, event.sync_round
            for name in ("step_s", "compute_s", "pp_wait_s", "dp_s", "drift"):
                value = getattr(event, name)
                if not math.isnan(value):
                    setattr(self, name, value)
            if math.isfinite(event.step_s):
                self.breakdown = measured(asdict(event))
            figures = (event.link_act_out, event.link_act_in, event.link_grad_out,
                       event.link_grad_in)
            if not all(math.isnan(f) for f in figures):
                self.link_windows = [*self.link_windows, (event.step, figures)][
                    -MAX_LINK_WINDOWS:]
        elif isinstance(event, EvalEvent):
            if math.isfinite(event.val_loss) and event.step >= 1:
                self.validations = [*self.validations, (event.step, event.val_loss)][
                    -MAX_VALIDATIONS:]
        elif isinstance(event, IntegrityEvent):
            if len(self.integrity) < MAX_PENDING_EVIDENCE:
                self.integrity.append(event)
            else:
                self.integrity_dropped += 1
                self.dropped_from = self.dropped_from or max(event.step, 1)
                if self.integrity_dropped == 1:
                    log.warning("the worker found more integrity evidence than the coordinator "
                                "has taken (%d records waiting); newer records are dropped "
                                "until heartbeats deliver them", MAX_PENDING_EVIDENCE)
        elif isinstance(event, DoneEvent):  # the state turns DONE once the worker exits 0
            self.step = max(self.step, event.step)
            if event.resumed_step >= 0:
                self.resumed_step = event.resumed_step
        elif isinstance(event, ErrorEvent):
            self.state = WorkerState.FAILED
            self.error = event.message or "unknown error"
            self.error_kind = event.kind
            self.failed_step = event.step


WARM_WAIT_S = 300.0  # how long an assignment waits for a spare still importing
WARM_POLL_S = 0.05
STARTUP_PREFIX = "worker start-up: "  # the agent log line bench/startup.py parses


@dataclass
class StartupMarks:
    """Wall-clock marks of one worker's start, logged once its first step arrives (or it
    ends without one): what `bench/startup.py` adds to the worker's own marks."""

    job_id: str
    epoch: int
    rank: int
    assigned_at: float  # the supervisor got the assignment
    prepared_at: float = 0.0  # checkpoints fetched from peers (when needed): the worker starts
    spare: bool = False  # a spare took it (else a fresh process)
    pid: int = 0
    first_step_at: float = 0.0  # its first step event was read (polled every FOLLOW_POLL_S)

    def line(self) -> str:
        return STARTUP_PREFIX + json.dumps(self.__dict__)


class Supervisor:
    def __init__(self, workdir: Path, on_change: Callable[[], None] = lambda: None,
                 python: str = sys.executable, bind_interface: str = "",
                 checkpoints: CheckpointCopier | None = None, prewarm: bool = False,
                 pushes: CheckpointPushes | None = None, data_handoff: str = "") -> None:
        self.workdir = workdir
        self.bind_interface = bind_interface
        # the abstract socket the worker takes its data-plane connections from, when the
        # agent serves them on its gRPC port (dtfm/net/handoff.py); "": it listens itself
        self.data_handoff = data_handoff
        # copies stage checkpoints from peers: before a worker starts, and mirrors while it runs
        self.checkpoints = checkpoints
        self.pushes = pushes  # copies pushed to or from agents nobody can dial
        self._preparing: asyncio.Task[None] | None = None
        self.on_change = on_change
        self.python = python
        self.progress = WorkerProgress()
        self._worker: WorkerProcess | None = None
        self._task: asyncio.Task[None] | None = None
        self.prewarm = prewarm
        self._spare: Spare | None = None
        self._forking = True  # spares fork workers (zygotes) until one refuses
        self._marks: StartupMarks | None = None
        self._closed = False
        self.restock()

    @property
    def running(self) -> bool:
        return self._worker is not None and self._worker.poll() is None

    @property
    def spare_pid(self) -> int | None:
        """The idle spare's pid (None: no spare), for tests and logs."""
        spare = self._spare
        return spare.pid if spare is not None and spare.popen.poll() is None else None

    @property
    def spare_warm(self) -> bool:
        """The spare is warm and forks the next assignment's worker (a zygote)."""
        return self._spare is not None and self._spare.ready

    def _env(self) -> dict[str, str]:
        """The worker's environment: the same for a fresh worker and a spare started now."""
        env = worker_env(bind_interface=self.bind_interface)
        # checkpoints are on by default: in this agent's state dir (workdir's parent) unless
        # the job names a --checkpoint-dir
        env[WorkerEnv.AGENT_CHECKPOINT_DIR] = str(checkpoint_dir(self.workdir.parent))
        if self.data_handoff:
            env[HANDOFF_ENV] = self.data_handoff
        else:
            env.pop(HANDOFF_ENV, None)
        return env

    def restock(self) -> None:
        """Start a spare worker unless one is idle (prewarm only; never after `close`).

        Called from the event loop's thread on purpose: the spare's parent-death signal
        follows the thread that started it."""
        if not self.prewarm or self._closed or self.spare_pid is not None:
            return
        if self._spare is not None:  # it died idle (a crash at import): reap it, say so
            log.warning("the spare worker pid %d exited with status %s; see %s",
                        self._spare.pid, self._spare.popen.wait(), self.workdir / SPARE_LOG)
        private_dir(self.workdir)
        try:
            self._spare = Spare.start(self.workdir, self._env(), python=self.python,
                                      zygote=self._forking)
        except OSError as exc:
            self._spare = None
            log.warning("cannot start a spare worker (%s); workers start when assigned", exc)
            return
        log.info("spare worker started as pid %d", self._spare.pid)

    def _launch(self, assignment: common_pb2.Assignment, files: WorkerFiles,
                assigned_at: float) -> tuple[WorkerProcess, bool]:
        """The assignment's worker, and whether the spare forked it (it does when it fits:
        warm, alive, same environment), else a fresh process. A spare that does not fit is
        ended (a new one comes later)."""
        env, spare, self._spare = self._env(), self._spare, None
        if spare is not None:
            if not spare.fits(env, self.python):
                log.info("the spare worker (pid %d) was started with another environment; "
                         "starting a fresh one", spare.pid)
            elif spare.replies is None:  # a plain spare (forking was refused): it becomes it
                if (worker := spare.take(assignment, files, assigned_at)) is not None:
                    return worker, True
                log.warning("the spare worker (pid %d) is gone (exit status %s); starting a "
                            "fresh one", spare.pid, spare.popen.returncode)
            elif (worker := spare.fork(assignment, files, assigned_at)) is not None:
                self._spare = spare  # it stays for the next assignment
                return worker, True
            elif spare.replies.refusal:
                self._forking = False
                log.warning("the spare worker (pid %d) refused to fork a worker (%s); this "
                            "agent's spares become their worker from now on", spare.pid,
                            spare.replies.refusal)
            else:
                log.warning("the spare worker (pid %d) did not fork a worker (exit status %s; "
                            "see %s); starting a fresh one", spare.pid, spare.popen.poll(),
                            self.workdir / SPARE_LOG)
            # SIGKILL at once (it runs no worker: the last one was stopped), synchronously:
            # an await here would let a stop() run between the checkpoint fetch and this
            # worker's start, and miss it
            spare.stop(grace_s=0.0)
        return launch(assignment, files, env, python=self.python, assigned_at=assigned_at), False

    async def _warm_spare(self) -> None:
        """Wait (bounded) for a spare still importing: raised to this process's priority, it
        finishes the import a fresh worker would start only now, and then forks this worker
        and every later one."""
        spare = self._spare
        if (spare is None or spare.replies is None or spare.ready
                or not spare.fits(self._env(), self.python)):
            return
        raise_to_mine(spare.pid)
        deadline = time.monotonic() + WARM_WAIT_S
        while (not spare.ready and spare.popen.poll() is None
               and time.monotonic() < deadline):
            await asyncio.sleep(WARM_POLL_S)

    async def start(self, assignment: common_pb2.Assignment) -> None:
        assigned_at = time.time()
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
        marks = StartupMarks(assignment.job_id, assignment.epoch, assignment.rank,
                             assigned_at, prepared_at=time.time())
        worker, marks.spare = self._launch(assignment, files, assigned_at)
        self._worker, marks.pid = worker, worker.pid
        self._marks = marks
        log.info("worker for %s rank %d (stage %d, replica %d) started as pid %d (%s); log %s",
                 assignment.job_id, assignment.rank, assignment.stage, assignment.replica,
                 worker.pid, "a spare" if marks.spare else "a fresh process", files.log)
        self._task = asyncio.create_task(self._follow(worker))
        if self.checkpoints is not None:
            self.checkpoints.start_mirrors(assignment)
        if self.pushes is not None:
            self.pushes.start(assignment)

    async def _prepare(self, assignment: common_pb2.Assignment) -> bool:
        """Fetch the stage's checkpoint from a peer when this agent lacks it (see
        `CheckpointCopier.prepare`) while a spare still importing gets warm; False when a stop
        or a newer assignment cancelled them, so this worker must not start."""
        steps = [self._warm_spare()]
        if self.checkpoints is not None:
            steps.append(self.checkpoints.prepare(assignment))
        task = asyncio.ensure_future(asyncio.gather(*steps))
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
        # This worker's own progress: a new assignment replaces self.progress, and the last
        # events of a worker that has already exited must never land in the next epoch's
        # (its heartbeat would carry the new epoch with the old worker's step and resumed
        # step, and the coordinator would record the recovery as resumed from the old one).
        p = self.progress
        async for event in worker.follow():
            p.apply(event)
            if isinstance(event, StepEvent) and self._marks is not None:
                self._started(worker)  # its first step (not every step: restock polls a pid)
            self.on_change()
        if worker.returncode == 0 and p.state != WorkerState.FAILED:
            p.state = WorkerState.DONE
        elif p.state not in (WorkerState.FAILED, WorkerState.STOPPED):
            p.state = WorkerState.FAILED
            p.error = p.error or f"worker exited with code {worker.returncode}: {worker.log_tail()}"
        # "failed in step 6" after step events up to 5: a rank its peers finished a step
        # without (they checkpoint it, the recovery resumes after it; ErrorEvent says more)
        log.info("worker pid %d ended: %s%s (its last step: %d)%s", worker.pid, p.state,
                 f" {failed_at(p.failed_step)}" if p.failed_step >= 0 else "", p.step,
                 f": {p.error}" if p.error else "")
        self._started(worker)
        self.on_change()

    def _started(self, worker: WorkerProcess) -> None:
        """The worker trained its first step (or ended): log its start-up once, and start the
        next spare now that this worker's own start no longer competes for the CPU."""
        marks = self._marks
        if marks is not None and marks.pid == worker.pid:
            self._marks = None
            if self.progress.step > 0:
                marks.first_step_at = time.time()
                self.progress.startup_s = marks.first_step_at - marks.assigned_at
                log.info("rank %d of %s: first step %.1f s after the assignment",
                         marks.rank, marks.job_id, self.progress.startup_s)
            log.info("%s", marks.line())
        self.restock()

    def request_checkpoint(self, job_id: str, epoch: int, step: int, reason: str) -> bool:
        """Pass the coordinator's ask for a checkpoint after `step` to the running worker of
        that job's epoch (`dtfm.core.requests`); False, logged, when this agent runs no such
        worker or it has already trained that step (then the regular checkpoint serves)."""
        worker, p = self._worker, self.progress
        if worker is None or worker.poll() is not None or (p.job_id, p.epoch) != (job_id,
                                                                                  epoch):
            log.info("not asking for a checkpoint after step %d of job %s epoch %d: no worker "
                     "of it runs here", step, job_id, epoch)
            return False
        if p.step >= step:
            log.info("not asking for a checkpoint after step %d of job %s: the worker has "
                     "trained step %d already", step, job_id, p.step)
            return False
        ask_checkpoint(worker.files.requests, step)
        log.info("asked the worker for a checkpoint after step %d of job %s: %s", step, job_id,
                 reason)
        return True

    async def stop(self, reason: str) -> None:
        if self.checkpoints is not None:
            await self.checkpoints.stop_mirrors()
        if self.pushes is not None:
            await self.pushes.stop()
        preparing, self._preparing = self._preparing, None
        if preparing is not None:
            log.info("cancelling the checkpoint fetch before the worker started: %s", reason)
            preparing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await preparing
            self.progress.state = WorkerState.IDLE
            self.on_change()
        worker = self._worker
        if worker is None:
            return
        if worker.poll() is not None:
            # Exited (or stopped by an earlier call still under way): its follower may still
            # be reading its last events, and what starts next must not begin before them.
            if self._task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(self._task)
            return
        log.info("stopping worker pid %d: %s", worker.pid, reason)
        self.progress.state = WorkerState.STOPPED
        await worker.stop_async()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.progress.state = WorkerState.IDLE
        self.on_change()

    async def close(self, reason: str) -> None:
        """Stop the worker and end the spare for good (the agent is shutting down)."""
        self._closed = True
        await self.stop(reason)
        spare, self._spare = self._spare, None
        if spare is not None:
            await spare.stop_async(grace_s=1.0)
