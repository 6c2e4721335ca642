"""The coordinator's calls about submitted jobs (`SubmitJob`, `ListJobs`, `CancelJob`) and
the scheduler that runs them (`run_jobs`): in turn, or side by side when the agents suffice.

A part of `CoordinatorService` (coordinator/daemon/server.py), kept in a module of its own so
the service's module stays one screenful of routing; the queue itself and what is kept of
ended jobs live in coordinator/daemon/jobs.py, who holds which agents in
coordinator/daemon/share.py and how many each job gets in coordinator/daemon/jobsplit.py.
Like every call these pass the join token (or mTLS) check of `dtfm.rpc` before they run;
`SubmitJob` and `CancelJob` also need the operator token when the coordinator has one
(coordinator/daemon/operator.py): the join token is every volunteer's.

The scheduler starts the queue's next job as soon as the free agents (those no running job
holds) meet its need, beside the jobs running already; when none runs, the first job starts
alone (it sees every agent and waits for its own as a single job always did) unless the
second fits beside it too, and then the two split the free agents by predicted cost. A job
that has not yet placed its first epoch holds no agents of its own yet, so nothing starts
beside it until it has. A job that ends gives its agents back; they keep running, idle as
spares until the next job takes them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import cast

import grpc

from coordinator.daemon.config import CoordinatorConfig
from coordinator.daemon.history import History
from coordinator.daemon.jobs import (
    ENDED,
    Archive,
    JobQueue,
    QueueFull,
    Submitted,
    entry,
    queued_entry,
)
from coordinator.daemon.jobsplit import ask_of, split, why
from coordinator.daemon.operator import OperatorGate
from coordinator.daemon.registry import Registry
from coordinator.daemon.share import AgentPool, AgentShare
from coordinator.job.checkpointcopies import CoordinatorCopies
from coordinator.job.machine import Job
from dtfm.core.limits import MAX_AGENTS, MAX_STATUS_AGENTS
from dtfm.rpc import ConfigError
from protos.dtfm.v1 import coordinator_pb2

log = logging.getLogger(__name__)
GATHERING_POLL_S = 0.5  # how often a job still gathering its agents is looked at again
# Running jobs one status answer carries in full (`ClusterStatus.jobs`), the oldest first: each
# holds at least one agent, so thousands of agents could run thousands of one-agent jobs.
MAX_STATUS_JOBS = 16


@dataclass
class RunningJob:
    """One job the coordinator drives now, and what the server keeps for it."""

    job: Job
    share: AgentShare
    submitted: Submitted | None = None  # None: `coordinator start`'s own job
    history: History = field(default_factory=History)
    export_source: coordinator_pb2.ExportSource | None = None
    driving: asyncio.Future[None] | None = None


class JobCalls:
    """What `CoordinatorService` adds for submitted jobs; it provides the attributes below."""

    job: Job
    history: History
    runs: dict[str, RunningJob]
    pool: AgentPool
    queue: JobQueue
    archive: Archive
    stopping: asyncio.Event
    wake: asyncio.Event

    config: CoordinatorConfig
    registry: Registry
    operator: OperatorGate
    copies: CoordinatorCopies

    def new_job(self, submitted: Submitted, registry: Registry) -> Job: ...
    def history_of_job(self, run: RunningJob | None = None
                       ) -> Callable[..., coordinator_pb2.JobHistory]: ...
    def job_status(self, run: RunningJob | None = None) -> coordinator_pb2.JobStatus: ...

    # --- the running jobs ---
    def adopt_run(self, job: Job, share: AgentShare, submitted: Submitted | None,
                  note: str) -> RunningJob:
        """Make `job` (over `share`) one of the running jobs; the oldest is the primary one
        (`job`: what status, the web view and the metrics show first)."""
        share.why = note
        self.pool.bind(share, job.job_id, lambda: job.members)
        job.planner.taken_ports = lambda: {r.job.planner.port for r in self.runs.values()
                                           if r.job is not job}  # rank 0s may share a host
        run = RunningJob(job, share, submitted)
        self.runs[job.job_id] = run
        self._primary()
        return run

    def use_job(self, submitted: Submitted, assigned: Iterable[str] = (),
                note: str = "") -> RunningJob:
        """Start driving `submitted` on the agents `assigned` to it (none: it runs alone and
        sees every agent)."""
        share = self.pool.share("", assigned)
        job = self.new_job(submitted, cast(Registry, share))
        note = note or "alone: every live agent is its to use"
        if job.members and share.assigned:  # adopted after a restart: it holds its members
            share.assigned = set(job.members)
            note = f"adopted with its members {', '.join(job.members)}"
        log.info("job %s: starting (%s), submitted with %s; %s", job.job_id,
                 job.config.model, " ".join(submitted.args), note)
        return self.adopt_run(job, share, submitted, note)

    def _primary(self) -> None:
        if self.runs:
            first = next(iter(self.runs.values()))
            self.job, self.history = first.job, first.history

    def run_of(self, job_id: str) -> RunningJob | None:
        """The running job of this id (None: none runs by it)."""
        return self.runs.get(job_id) if job_id else None

    def run_status(self, run: RunningJob) -> coordinator_pb2.JobStatus:
        """`run`'s status with the agents it holds (at most `MAX_STATUS_AGENTS`, in id
        order) and the scheduler's word on why."""
        status = self.job_status(run)
        status.held_agents.extend(sorted(run.share.held())[:MAX_STATUS_AGENTS])
        status.share = run.share.why[:2000]
        return status

    def status_jobs(self) -> tuple[coordinator_pb2.JobStatus, list[coordinator_pb2.JobStatus],
                                   int]:
        """A status answer's jobs: the first running one in full (`ClusterStatus.job`; the
        last one driven when none runs), every running one (the oldest `MAX_STATUS_JOBS`,
        without their export sources: a `StatusRequest.job_id` answers those) and how many
        more run."""
        runs = list(self.runs.values())
        jobs = [self.run_status(run) for run in runs[:MAX_STATUS_JOBS]]
        first = coordinator_pb2.JobStatus()
        if jobs:
            first.CopyFrom(jobs[0])
        else:
            first = self.job_status()
        for status in jobs:
            status.ClearField("export_source")
        return first, jobs, len(runs) - len(jobs)

    def jobs_now(self) -> list[Job]:
        """Every job running now (the primary one when none runs)."""
        return [r.job for r in self.runs.values()] or [self.job]

    async def drive(self, run: RunningJob) -> None:
        """Drive the job (and its export) until it ends or is cancelled; the coordinator's
        checkpoint copies of the job go when it ends (kept while it is unfinished: a
        restarted coordinator continues it)."""
        job = run.job
        if job.job_id:
            await self.copies.keep_only(*self.runs)
        try:
            await self._run_and_export(run)
        except asyncio.CancelledError:
            if job.state != coordinator_pb2.JOB_STATE_CANCELLED:
                raise  # the coordinator stops
        if job.job_id and job.state in ENDED:
            await self.copies.remove(job.job_id, "the job ended")

    async def _run_and_export(self, run: RunningJob) -> None:
        """Drive the job; after its last step, write --export-dir when given."""
        await run.job.run()
        job = run.job.config
        if not (job.export_dir and run.job.state == coordinator_pb2.JOB_STATE_DONE):
            return
        from coordinator.job.export import export_from_status
        from dtfm.core.hfexport import ExportError

        status = coordinator_pb2.ClusterStatus(
            agents=[a.to_proto() for a in self.registry.status_rows(MAX_AGENTS)[0]],
            job=self.job_status(run))
        try:
            step, out = await export_from_status(status, self.config.security,
                                                 job.export_dir, merged=job.export_merged,
                                                 say=log.info)
        except ExportError as exc:
            log.error("export to %s failed: %s (run `coordinator export` to try again)",
                      job.export_dir, exc)
            return
        log.info("exported step %d of job %s to %s", step, run.job.job_id, out)

    # --- the scheduler ---
    async def run_jobs(self) -> None:
        """Drive `start`'s job (if any), then the submitted ones, side by side where the
        agents suffice, each ended one's agents handed to the next."""
        for run in list(self.runs.values()):
            self._launch(run)
        while not self.stopping.is_set():
            self.wake.clear()
            self.reap()
            gathering = self.start_what_fits()
            try:
                await asyncio.wait_for(self.wake.wait(),
                                       GATHERING_POLL_S if gathering else None)
            except TimeoutError:
                pass

    def _launch(self, run: RunningJob) -> None:
        run.driving = asyncio.ensure_future(self.drive(run))
        run.driving.add_done_callback(lambda _: self.wake.set())

    def reap(self) -> None:
        """Archive the jobs that ended; their agents go back to the pool."""
        for job_id, run in list(self.runs.items()):
            if run.driving is None or not run.driving.done():
                continue
            status = self.job_status(run)  # what `coordinator export --job` reads
            self.archive.add(entry(status, run.submitted), self.history_of_job(run), status)
            self.queue.ended(job_id)
            self.pool.release(job_id)
            del self.runs[job_id]
            log.info("job %s ended (%s): its %d agent(s) are free for the next job", job_id,
                     coordinator_pb2.JobState.Name(run.job.state).removeprefix("JOB_STATE_")
                     .lower(), len(run.share.held()))
        self._primary()

    def start_what_fits(self) -> bool:
        """Start the queued jobs that fit now; True while a job still gathers its agents
        (what it will hold is not known yet, so nothing may start beside it)."""
        while self.queue.waiting:
            if any(r.job.state != coordinator_pb2.JOB_STATE_RUNNING for r in self.runs.values()):
                return True
            heads = self.queue.waiting[: 1 if self.runs else 2]
            if any(s.config.parsed_placement().pinned is not None for s in heads):
                heads = heads[:1]  # a pinned plan names its agents: it runs alone
                if self.runs:
                    return False
            free = self.pool.free()
            asks = [ask_of(s.job_id, s.config) for s in heads]
            counts = split(len(free), asks)
            if counts is None and len(asks) == 2:
                asks, heads, counts = asks[:1], heads[:1], None
            if counts is None or (len(asks) == 1 and not self.runs):
                if self.runs:
                    return False  # too few free agents: it waits for a job to end
                self._launch(self.use_job(self.queue.take()))
                continue
            lines, taken = why(asks, counts), 0
            for n, line in zip(counts, lines, strict=True):
                assigned = [a.agent_id for a in free[taken:taken + n]]
                taken += n
                more = f" and {len(assigned) - 8} more" if len(assigned) > 8 else ""
                note = f"{line}: {', '.join(assigned[:8])}{more}" + (
                    f"; beside {', '.join(self.runs)}" if self.runs else "")
                run = self.use_job(self.queue.take(), assigned, note)
                self._launch(run)
                if run.job.members:  # adopted after a restart: it holds its members, and
                    break  # what is free for the next one is counted again
        return False

    # --- the calls ---
    async def SubmitJob(self, request: coordinator_pb2.SubmitJobRequest,
                        context: grpc.aio.ServicerContext) -> coordinator_pb2.SubmitJobReply:
        await self.operator.check(context, "SubmitJob")
        try:
            job = self.queue.submit(request.args)
        except ConfigError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # unreachable: abort raises
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            raise  # unreachable: abort raises
        self.wake.set()
        ahead = self.queue.position(job.job_id) + len(self.runs)
        log.info("job %s submitted (%d ahead): %s", job.job_id, ahead, " ".join(job.args))
        return coordinator_pb2.SubmitJobReply(
            job_id=job.job_id, position=ahead,
            message=f"queued {job.job_id} ({job.config.model}, {job.config.agents} agents); "
                    + (f"{ahead} job(s) ahead of it; it starts beside them when the free "
                       "agents suffice" if ahead else "it starts now"))

    async def ListJobs(self, request: coordinator_pb2.ListJobsRequest,
                       context: grpc.aio.ServicerContext) -> coordinator_pb2.JobList:
        current = []  # an ended one until `reap` moves it to the archive, too
        for run in self.runs.values():
            row = entry(self.job_status(run), run.submitted)
            if len(self.runs) > 1 or run.share.assigned:  # which agents, and why
                row.message = (f"{row.message}; holds {len(run.share.held())} agent(s): "
                               f"{run.share.why}")[:2000]
            current.append(row)
        return coordinator_pb2.JobList(jobs=[*self.archive.entries, *current,
                                             *map(queued_entry, self.queue.waiting)])

    async def CancelJob(self, request: coordinator_pb2.CancelJobRequest,
                        context: grpc.aio.ServicerContext) -> coordinator_pb2.CancelJobReply:
        await self.operator.check(context, "CancelJob")
        job_id, reason = request.job_id[:100], request.reason[:200] or "`coordinator cancel`"
        if (run := self.runs.get(job_id)) is not None and run.job.state not in ENDED:
            await run.job.cancel(reason)
            if run.driving is not None:
                run.driving.cancel()
            return coordinator_pb2.CancelJobReply(
                message=f"cancelled {job_id}: its members were told to stop; the next queued "
                        "job starts on the agents")
        if (queued := self.queue.cancel(job_id)) is not None:
            row = queued_entry(queued)
            row.state, row.message = coordinator_pb2.JOB_STATE_CANCELLED, reason
            self.archive.add(row)
            return coordinator_pb2.CancelJobReply(message=f"cancelled {job_id}: it had not "
                                                  "started")
        await context.abort(grpc.StatusCode.NOT_FOUND,
                            f"no job {job_id!r} is queued or running (ended ones cannot be "
                            "cancelled); `coordinator jobs` lists them")
        raise  # unreachable: abort raises
