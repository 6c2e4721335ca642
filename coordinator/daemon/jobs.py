"""Jobs submitted to a running coordinator: the queue, and what is kept of ended jobs.

A coordinator used to run the one job its `start` flags described; a second job meant
restarting it. `coordinator submit` (`Coordinator.SubmitJob`) now queues a job described by
the same job flags (coordinator/jobflags.py); the daemon's scheduler starts them in order, side
by side where the agents suffice (coordinator/daemon/jobcalls.py, `run_jobs`), each on live
agents that no other running job holds, without restarting the agents. Each job keeps its own
id, its state directory row, its checkpoints (keyed by its id) and its history.

`JobQueue` holds the jobs waiting, in the order submitted, and the submitted jobs running now.
With `--state-dir` every submitted job that has not ended has a row in the store
(`JobStore.queue_*`), written before the submitter hears its id, so a restarted coordinator
keeps the queue and continues the jobs that were running (their `job` rows, by id).

What a submitter can make the daemon hold is bounded: `MAX_QUEUED_JOBS` waiting, each
submission's words (`jobflags.size_problem`), `MAX_ENDED` ended jobs listed and
`HISTORIES_KEPT` ended jobs' histories.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from coordinator.daemon.config import JobConfig
from coordinator.daemon.jobstore import JobStore
from coordinator.jobflags import parse_submitted
from dtfm.rpc import ConfigError
from protos.dtfm.v1 import coordinator_pb2

log = logging.getLogger(__name__)

MAX_QUEUED_JOBS = 32  # jobs waiting (those running are bounded by the agents they hold)
MAX_ENDED = 64  # ended jobs `coordinator jobs` still lists (the newest)
HISTORIES_KEPT = 8  # ended jobs whose per-step history `coordinator report --job` still has
ENDED = (coordinator_pb2.JOB_STATE_DONE, coordinator_pb2.JOB_STATE_FAILED,
         coordinator_pb2.JOB_STATE_CANCELLED)


class QueueFull(Exception):
    """The queue holds `MAX_QUEUED_JOBS` already."""


@dataclass
class Submitted:
    """One submitted job: its id (given at submission), its flags, and when it came."""

    job_id: str
    config: JobConfig
    args: list[str]
    submitted_unix_s: float
    seq: int = 0


@dataclass
class JobQueue:
    """Submitted jobs in order: `waiting`, then `running` once `take` hands them out."""

    store: JobStore | None = None
    limit: int = MAX_QUEUED_JOBS
    parse: Callable[[Sequence[str]], JobConfig] = parse_submitted
    waiting: list[Submitted] = field(default_factory=list)
    running: dict[str, Submitted] = field(default_factory=dict)  # by id, as started
    _seq: int = 0
    _added: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        for job_id, seq, args, at in self.store.queue_rows() if self.store else []:
            self._seq = max(self._seq, seq)
            try:
                config = self.parse(args)
            except ConfigError as exc:  # this coordinator's version refuses what one took
                log.error("queued job %s no longer parses (%s); dropped from the queue",
                          job_id, exc)
                self.store.queue_remove(job_id)  # type: ignore[union-attr]
                continue
            self.waiting.append(Submitted(job_id, config, list(args), at, seq))
        if self.waiting:
            log.info("state dir holds %d submitted job(s): %s", len(self.waiting),
                     ", ".join(s.job_id for s in self.waiting))
            self._added.set()

    def submit(self, args: Sequence[str]) -> Submitted:
        """Queue the job `args` describe; ConfigError (naming the flag) when they are bad,
        QueueFull when `limit` jobs wait already."""
        if len(self.waiting) >= self.limit:
            raise QueueFull(f"{len(self.waiting)} jobs are queued, the most a coordinator "
                            f"holds: wait for one to start, or `coordinator cancel` one")
        config = self.parse(args)
        self._seq += 1
        job = Submitted(f"job-{uuid.uuid4().hex[:8]}", config, list(args), time.time(),
                        self._seq)
        if self.store is not None:  # before the submitter hears of it: a restart keeps it
            self.store.queue_put(job.job_id, job.seq, job.args, job.submitted_unix_s)
        self.waiting.append(job)
        self._added.set()
        return job

    def position(self, job_id: str) -> int:
        """Jobs ahead of `job_id` in the queue (the running ones not counted)."""
        return [s.job_id for s in self.waiting].index(job_id)

    def cancel(self, job_id: str) -> Submitted | None:
        """Take a waiting job out of the queue (None: none waits by that id)."""
        for i, job in enumerate(self.waiting):
            if job.job_id == job_id:
                del self.waiting[i]
                if self.store is not None:
                    self.store.queue_remove(job_id)
                return job
        return None

    def take(self) -> Submitted:
        """The first job waiting (there is one); it is `running` from then on."""
        job = self.waiting.pop(0)
        self.running[job.job_id] = job
        return job

    async def next(self) -> Submitted:
        """The first job waiting, once there is one (`take`)."""
        while not self.waiting:
            self._added.clear()
            await self._added.wait()
        return self.take()

    def ended(self, job_id: str) -> None:
        """A running submitted job ended: its row goes (the job's own row stays)."""
        if self.running.pop(job_id, None) is not None and self.store is not None:
            self.store.queue_remove(job_id)


def entry(status: coordinator_pb2.JobStatus, submitted: Submitted | None
          ) -> coordinator_pb2.JobEntry:
    """A `coordinator jobs` row of a job with this status."""
    return coordinator_pb2.JobEntry(
        job_id=status.job_id, state=status.state, model=status.model,
        agents=status.agents_wanted, step=status.step, total_steps=status.total_steps,
        loss=status.loss, message=status.message,
        submitted_unix_s=submitted.submitted_unix_s if submitted else 0.0,
        args=submitted.args if submitted else [])


def queued_entry(job: Submitted) -> coordinator_pb2.JobEntry:
    """The row of a job waiting in the queue."""
    return coordinator_pb2.JobEntry(
        job_id=job.job_id, state=coordinator_pb2.JOB_STATE_QUEUED, model=job.config.model,
        agents=job.config.agents, total_steps=job.config.train.steps,
        message="queued", submitted_unix_s=job.submitted_unix_s, args=job.args)


History = Callable[..., coordinator_pb2.JobHistory]


class Archive:
    """What is kept of ended jobs: their last rows, and the newest ones' histories."""

    def __init__(self) -> None:
        self.entries: deque[coordinator_pb2.JobEntry] = deque(maxlen=MAX_ENDED)
        self.histories: OrderedDict[str, History] = OrderedDict()
        self.statuses: dict[str, coordinator_pb2.JobStatus] = {}  # the same jobs' last status

    def add(self, row: coordinator_pb2.JobEntry, history: History | None = None,
            status: coordinator_pb2.JobStatus | None = None) -> None:
        self.entries.append(row)
        if history is not None:
            self.histories[row.job_id] = history
            if status is not None:
                self.statuses[row.job_id] = status
            while len(self.histories) > HISTORIES_KEPT:
                self.statuses.pop(self.histories.popitem(last=False)[0], None)
