"""The coordinator's calls about submitted jobs: `SubmitJob`, `ListJobs`, `CancelJob`, and
the loop that runs the jobs one after another (`run_jobs`).

A part of `CoordinatorService` (coordinator/daemon/server.py), kept in a module of its own so
the service's module stays one screenful of routing; the queue itself and what is kept of
ended jobs live in coordinator/daemon/jobs.py. Like every call these pass the join token (or
mTLS) check of `dtfm.rpc` before they run.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from coordinator.daemon.jobs import (
    ENDED,
    Archive,
    JobQueue,
    QueueFull,
    Submitted,
    entry,
    queued_entry,
)
from coordinator.job.machine import Job
from dtfm.rpc import ConfigError
from protos.dtfm.v1 import coordinator_pb2

log = logging.getLogger(__name__)


class JobCalls:
    """What `CoordinatorService` adds for submitted jobs; it provides the attributes below."""

    job: Job
    queue: JobQueue
    archive: Archive
    stopping: asyncio.Event
    driving: asyncio.Future[None] | None

    async def run_job(self) -> None: ...
    def use_job(self, submitted: Submitted) -> None: ...
    def history_of_job(self) -> Callable[..., coordinator_pb2.JobHistory]: ...
    def job_status(self) -> coordinator_pb2.JobStatus: ...

    async def run_jobs(self) -> None:
        """Drive `start`'s job (if any), then each submitted job in turn, on the same agents."""
        while not self.stopping.is_set():
            await self.run_job()
            if self.job.job_id:
                status = self.job_status()  # what `coordinator export --job` reads
                self.archive.add(entry(status, self.queue.running), self.history_of_job(),
                                 status)
                self.queue.ended(self.job.job_id)
            self.use_job(await self.queue.next())

    async def SubmitJob(self, request: coordinator_pb2.SubmitJobRequest,
                        context: grpc.aio.ServicerContext) -> coordinator_pb2.SubmitJobReply:
        try:
            job = self.queue.submit(request.args)
        except ConfigError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # unreachable: abort raises
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            raise  # unreachable: abort raises
        busy = self.job.state not in (*ENDED, coordinator_pb2.JOB_STATE_IDLE)
        ahead = self.queue.position(job.job_id) + (busy and self.queue.running is None)
        log.info("job %s submitted (%d ahead): %s", job.job_id, ahead, " ".join(job.args))
        return coordinator_pb2.SubmitJobReply(
            job_id=job.job_id, position=ahead,
            message=f"queued {job.job_id} ({job.config.model}, {job.config.agents} agents); "
                    + (f"{ahead} job(s) ahead of it" if ahead else "it starts now"))

    async def ListJobs(self, request: coordinator_pb2.ListJobsRequest,
                       context: grpc.aio.ServicerContext) -> coordinator_pb2.JobList:
        current = ([] if self.job.state == coordinator_pb2.JOB_STATE_IDLE or
                   self.job.state in ENDED else [entry(self.job_status(), self.queue.running)])
        return coordinator_pb2.JobList(jobs=[*self.archive.entries, *current,
                                             *map(queued_entry, self.queue.waiting)])

    async def CancelJob(self, request: coordinator_pb2.CancelJobRequest,
                        context: grpc.aio.ServicerContext) -> coordinator_pb2.CancelJobReply:
        job_id, reason = request.job_id[:100], request.reason[:200] or "`coordinator cancel`"
        if job_id and job_id == self.job.job_id and self.job.state not in ENDED:
            await self.job.cancel(reason)
            if self.driving is not None:
                self.driving.cancel()
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
