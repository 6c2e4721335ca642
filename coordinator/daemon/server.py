"""The coordinator daemon: the `dtfm.v1.Coordinator` service on grpc.aio.

Owns the RPC boundary (validation, status codes) and the daemon's life (liveness sweeps,
graceful shutdown). Cluster logic lives in the registry, the measurer and the job; this
module only routes to them. Nothing a peer sends may crash it: every handler validates first.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import grpc

from coordinator.daemon.config import CoordinatorConfig
from coordinator.daemon.history import History
from coordinator.daemon.jobcalls import JobCalls, RunningJob
from coordinator.daemon.jobs import Archive, JobQueue, Submitted
from coordinator.daemon.jobstore import JobStore
from coordinator.daemon.operator import OperatorGate
from coordinator.daemon.pushgate import PushGate
from coordinator.daemon.registry import LEFT, AgentRecord, IdentityError, Registry
from coordinator.daemon.share import AgentPool
from coordinator.daemon.validate import (
    secret_problem,
    validate_agent_info,
    validate_dial_report,
    validate_leave,
    validate_link_report,
    validate_progress,
)
from coordinator.integrity.corroborate import Corroboration
from coordinator.integrity.reports import IntegrityReports
from coordinator.integrity.status import excluded_rows, integrity_status
from coordinator.job.checkpointcopies import CoordinatorCopies
from coordinator.job.machine import Job
from coordinator.links import relayprobe
from coordinator.links.measure import LinkMeasurer, Pings
from coordinator.links.reachability import ReachChecker, unreachable
from coordinator.links.relayed import serves_relay
from coordinator.links.store import LinkStore
from dtfm import rpc
from dtfm.core.limits import (
    MAX_AGENTS,
    MAX_PING_SPREAD_S,
    MAX_STATUS_AGENTS,
    OMITTED_METADATA,
)
from dtfm.net.front import Front
from protos.dtfm.v1 import agent_pb2, common_pb2, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)

# job states in which it waits for usable agents: where an undialable one is worth a word
WAITING_STATES = (coordinator_pb2.JOB_STATE_WAITING, coordinator_pb2.JOB_STATE_MEASURING,
                  coordinator_pb2.JOB_STATE_SCHEDULING, coordinator_pb2.JOB_STATE_RECOVERING)


def _finite(value: float) -> bool:
    return math.isfinite(value)


class CoordinatorService(JobCalls, coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.registry = Registry(config.liveness_timeout_s, on_change=self._changed,
                                 evict_after_s=config.evict_after_s, on_lost=self._lost,
                                 heartbeat_interval_s=config.heartbeat_interval_s,
                                 heartbeat_budget=config.heartbeat_budget)
        self.links = LinkStore()
        self.measurer = LinkMeasurer(self.registry, self.links)
        self.reach = ReachChecker(self.registry, config.security)
        self.store = JobStore(config.state_dir) if config.state_dir else None
        self.pool = AgentPool(self.registry)  # which running job holds which agents
        self.runs: dict[str, RunningJob] = {}  # the jobs driven now, the oldest first
        self.wake = asyncio.Event()  # the scheduler looks again (coordinator/daemon/jobcalls.py)
        share = self.pool.share("")
        self.job = Job(config.job, share, self.measurer, self.links,  # type: ignore[arg-type]
                       store=self.store, reach=self.reach)  # plans once reach verdicts are in
        self.history = History()
        if config.job.model:  # `start`'s own job, driven first
            self.adopt_run(self.job, share, None, "alone: every live agent is its to use")
        else:
            self.pool.release("")
        self.measurer.punching = self.job.dataplane  # stranded pairs punch through its relay
        # lies about the network are evidence, recorded only (docs/architecture.md, Integrity)
        self.reach.evidence = self.measurer.evidence = self._network_evidence
        self.integrity = IntegrityReports()  # what agents' replica checks found (issue 43)
        self.corroboration = Corroboration()  # ... and when two of them confirm a fault
        self._gate = PushGate(self.registry, self.job_for)
        self.operator = OperatorGate(config.operator_token)  # SubmitJob, CancelJob, Admit
        self.copies = CoordinatorCopies(config.state_dir, config.checkpoint_store_bytes,
                                        self._gate.admit)
        self.queue = JobQueue(self.store)  # submitted jobs (coordinator/daemon/jobs.py)
        self.archive = Archive()  # ... and what is kept of ended ones
        self.stopping = asyncio.Event()

    def _network_evidence(self, agent_id: str, kind: str, detail: str) -> None:
        """A report about the network that the coordinator's checks contradict: evidence
        against its reporter, never enough to exclude on its own."""
        self.job.integrity.ledger.record(agent_id, kind, 0, detail)

    def _changed(self) -> None:
        for job in self.jobs_now():
            job.poke()
        self.wake.set()  # free agents may let the next job start

    def _lost(self, lost: list[AgentRecord]) -> None:
        """The registry lost agents (silent, or unreachable as a job found): tell the jobs
        (each looks for its own members)."""
        for job in self.jobs_now():
            job.on_lost(lost)

    def job_for(self, job_id: str) -> Job:
        """The running job of this id, else the primary one."""
        run = self.run_of(job_id)
        return self.job if run is None else run.job

    def refusal(self, agent_id: str) -> str:
        """Why `agent_id` is refused (an integrity exclusion in any running job), or ''."""
        return next((r for job in self.jobs_now() if (r := job.integrity.refusal(agent_id))), "")

    # --- agents ---
    async def Join(
        self, request: coordinator_pb2.JoinRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.Command]:
        problem = validate_agent_info(request.agent) or secret_problem(request.agent_secret)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if self.stopping.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "coordinator is shutting down")
        if refused := self.refusal(request.agent.agent_id):
            log.warning("refused a Join: %s", refused)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)
        if self.registry.get(request.agent.agent_id) is None and len(self.registry) >= MAX_AGENTS:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the registry holds {MAX_AGENTS} agents, its limit; lost and left ones go "
                "after --evict-after (lower it, or stop agents that keep re-joining)",
            )
        try:
            rec = self.registry.join(request.agent, request.agent_secret)
        except IdentityError as exc:
            log.warning("refused a Join: %s", exc)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
            raise  # unreachable: abort raises
        generation = rec.stream_generation
        queue = rec.commands
        # The dial-back is registered before the first yield: the registry counts the agent
        # alive from `join`, and a job waiting for agents runs while this stream sends its
        # welcome; registered after, the job found no check pending for the newcomer, planned
        # on it as "not checked" and its verdict came in a moment later. Their commands queue
        # behind the welcome.
        self.reach.on_join(rec)  # dials it back; the verdict follows on this stream
        for job in self.jobs_now():
            job.on_join(rec)
        yield coordinator_pb2.Command(
            welcome=coordinator_pb2.Welcome(
                agent_id=rec.agent_id,
                heartbeat_interval_s=self.registry.heartbeat_interval_s,
                liveness_timeout_s=self.registry.liveness_timeout_s,
                agent_secret=rec.secret,
            )
        )
        while not self.stopping.is_set():
            command = await queue.get()
            if command is None or rec.stream_generation != generation:
                return  # shutdown, or the agent re-joined on a newer stream
            yield command

    async def ReportProgress(
        self, request: coordinator_pb2.ProgressReport, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.Ack:
        problem = validate_progress(request)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        await self._authenticate(request, context)
        rec = self.registry.heartbeat(request)
        if rec is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"agent {request.agent_id!r} has not joined: call Join first",
            )
        # the job the report is of: a report of none (an idle agent's) changes no job, and
        # finding its holder would cost O(agents) per heartbeat
        run = self.run_of(request.job_id)
        job, history = (self.job, self.history) if run is None else (run.job, run.history)
        job.on_progress(rec, request)
        floor = 0
        if request.job_id and request.job_id == job.job_id:
            history.record(rec.agent_id, request)
            if request.epoch == job.epoch:
                floor = job.checkpoint_floor()
                layout = job.planner.layout  # stages the coordinator holds count too
                if request.integrity and layout is not None:  # evidence, kept and logged
                    new = self.integrity.record(rec.agent_id, request, job.members,
                                                layout.stages)
                    self.corroboration.feed(new, job.integrity.ledger,
                                            job.integrity.sync_every, job.integrity.defer,
                                            job.integrity.lone)
                    if job.integrity.settle(new):  # an R = 2 dispute: re-plan apart
                        job.poke()
                if job.integrity.witness(rec.agent_id, request):  # pipeline links, both ends
                    job.poke()
                if job.state == coordinator_pb2.JOB_STATE_RUNNING and layout is not None:
                    floor = self.copies.floor(job.job_id, layout.stages, floor)
        return coordinator_pb2.Ack(ok=True, keep_checkpoints_from=floor,
                                   heartbeat_interval_s=self.registry.heartbeat_interval_s)

    async def Leave(
        self, request: coordinator_pb2.LeaveRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.Ack:
        await self._member_report(request, validate_leave(request), context,
                                  "there is nothing to leave")
        self.registry.leave(request.agent_id, request.reason)
        return coordinator_pb2.Ack(ok=True)

    async def ReportLinks(
        self, request: coordinator_pb2.LinkReport, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.Ack:
        await self._member_report(request, validate_link_report(request), context)
        problem = self.measurer.on_report(request)
        if problem:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        return coordinator_pb2.Ack(ok=True)

    async def ReportDial(
        self, request: coordinator_pb2.DialReport, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.Ack:
        await self._member_report(request, validate_dial_report(request), context)
        problem = self.reach.on_report(request)
        if problem:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        return coordinator_pb2.Ack(ok=True)

    async def _member_report(self, request: Any, problem: str | None,
                             context: grpc.aio.ServicerContext,
                             not_joined: str = "call Join first") -> None:
        """Abort unless `request` (carrying agent_id and agent_secret) is well formed
        (`problem` is None) and comes from a joined agent holding its secret."""
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if await self._authenticate(request, context) is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"agent {request.agent_id!r} has not joined: {not_joined}")

    async def _authenticate(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AgentRecord | None:
        """The reporting agent's row, None if unknown; PERMISSION_DENIED if not its secret.

        Its `agent_secret` is cleared once checked: a report is kept (the registry's row, the
        job's progress, the history) and status answers are built from what is kept, so a
        secret that never outlives this check cannot reach any answer, log or metric. An
        agent excluded for an integrity fault is refused (PERMISSION_DENIED: its session ends,
        and its re-join is refused too, until `coordinator admit`)."""
        try:
            rec = self.registry.authenticate(request.agent_id, request.agent_secret)
            if rec is not None and (refused := self.refusal(rec.agent_id)):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)
            return rec
        except IdentityError as exc:
            log.warning("refused a report: %s", exc)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
            raise  # unreachable: abort raises
        finally:
            request.ClearField("agent_secret")

    # --- checkpoint copies of last resort (coordinator/job/checkpointcopies.py) ---
    async def ListCheckpoints(
        self, request: agent_pb2.ListCheckpointsRequest, context: grpc.aio.ServicerContext
    ) -> agent_pb2.CheckpointList:
        return await self.copies.list(request, context)

    async def FetchCheckpoint(
        self, request: agent_pb2.FetchCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[agent_pb2.CheckpointChunk]:
        async for chunk in self.copies.fetch(request, context):
            yield chunk

    async def PushCheckpoint(
        self, request_iterator: AsyncIterator[agent_pb2.CheckpointPush],
        context: grpc.aio.ServicerContext
    ) -> agent_pb2.CheckpointPushReply:
        return await self.copies.push(request_iterator, context)

    # --- people and scripts ---
    def new_job(self, submitted: Submitted, registry: Registry) -> Job:
        """The `Job` of `submitted` over `registry` (its share of the agents): it keeps the
        coordinator's relay, and who a confirmed fault excluded stays out of it."""
        job = Job(submitted.config, registry, self.measurer, self.links,
                  store=self.store, reach=self.reach, job_id=submitted.job_id)
        job.dataplane.share_relay_of(self.job.dataplane)
        excluded = self.job.integrity.ledger.to_json()["exclusions"]
        if excluded and not job.epoch:  # a new job: who a confirmed fault excluded stays out
            job.integrity.restore({"exclusions": excluded})
        self.measurer.punching = job.dataplane  # stranded pairs punch through its relay
        return job

    async def GetStatus(
        self, request: coordinator_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ClusterStatus:
        status, omitted = self.status_answer()
        if request.job_id and request.job_id != status.job.job_id:
            run = self.run_of(request.job_id)  # another running job
            if (ended := self.run_status(run) if run is not None
                    else self.archive.statuses.get(request.job_id)) is None:
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"job {request.job_id[:100]!r} is neither the current job "
                                    f"nor one of the newest ended ones "
                                    f"({', '.join(self.archive.statuses) or 'none'})")
            status = coordinator_pb2.ClusterStatus(agents=status.agents, job=ended,
                                                   now_unix_s=status.now_unix_s)
        if omitted:  # the answer must fit a gRPC message at any number of agents
            context.set_trailing_metadata(((OMITTED_METADATA, str(omitted)),))
        return status

    def status_answer(self) -> tuple[coordinator_pb2.ClusterStatus, int]:
        """What GetStatus answers (the web view reads it too) and how many agents it left
        out."""
        rows, omitted = self.registry.status_rows(MAX_STATUS_AGENTS)
        ids = [a.agent_id for a in rows]
        job, jobs, more = self.status_jobs()  # every running job (coordinator/daemon/jobcalls.py)
        return coordinator_pb2.ClusterStatus(
            agents=[*(integrity_status(a.to_proto(), self.job.integrity.ledger) for a in rows),
                    *excluded_rows(self.job.integrity.ledger, set(ids))],
            job=job, jobs=jobs, jobs_omitted=more,
            plan=self.job.plan or common_pb2.Plan(),
            links=self.links.matrix(ids) if self.links.entries else common_pb2.LinkMatrix(),
            now_unix_s=time.time(),
        ), omitted

    def job_status(self, run: RunningJob | None = None) -> coordinator_pb2.JobStatus:
        """The status of the job `run` drives (the primary one by default) with what an
        export writes beside the weights (token ids, tokenizer, a LoRA job's settings:
        `coordinator.job.export.job_export_source`, read once)."""
        job = self.job if run is None else run.job
        status = job.status()
        status.coordinator_checkpoints.extend(self.copies.held(status.job_id))
        if line := self.unreachable_line(status.state):
            status.message = f"{status.message}; {line}" if status.message else line
        if job.config.model:
            run = run or self.runs.get(job.job_id)
            source = run.export_source if run is not None else None
            if source is None:
                from coordinator.job.export import job_export_source

                source = job_export_source(job.config.train)
                if run is not None:
                    run.export_source = source
            status.export_source.CopyFrom(source)
        return status

    def unreachable_line(self, state: int) -> str:
        """While the job gathers agents or trains, name those nobody can dial: their data
        plane dials out and meets peers at the relay (coordinator/job/dataplane.py)."""
        if state not in WAITING_STATES + (coordinator_pb2.JOB_STATE_RUNNING,):
            return ""
        nowhere = [a for a in unreachable(self.registry) if a.state != LEFT]
        if not nowhere:
            return ""
        shown = ", ".join(f"{a.agent_id} ({a.address})" for a in nowhere[:5])
        more = f" and {len(nowhere) - 5} more" if len(nowhere) > 5 else ""
        relay = self.job.dataplane.relay
        agents = [a.agent_id for a in self.registry.alive() if serves_relay(a)]
        via = " or ".join(
            ([f"the coordinator's relay (port {relay.port})"] if relay is not None else [])
            + ([f"relay agents of their job ({', '.join(agents[:5])})"] if agents else [])
        ) or "no relay (--relay-port 0, no relay agent): two of them cannot meet"
        return (f"{len(nowhere)} agent(s) cannot be dialled by their peers: {shown}{more}; "
                f"their workers dial out (dtfm transport) and are relayed through {via}")

    async def Admit(self, request: coordinator_pb2.AdmitRequest,
                    context: grpc.aio.ServicerContext) -> coordinator_pb2.AdmitReply:
        """An operator lets an excluded agent take part again (`coordinator admit`)."""
        await self.operator.check(context, "Admit")
        for job in self.jobs_now():
            if request.agent_id in job.integrity.ledger.exclusions:
                return coordinator_pb2.AdmitReply(message=job.integrity.admit(request.agent_id))
        try:
            return coordinator_pb2.AdmitReply(message=self.job.integrity.admit(request.agent_id))
        except KeyError:
            excluded = ", ".join(self.job.integrity.ledger.exclusions) or "none"
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"agent {request.agent_id[:200]!r} is not excluded (excluded "
                                f"now: {excluded}); `coordinator status` lists them")
            raise  # unreachable: abort raises

    async def GetPlan(
        self, request: coordinator_pb2.PlanRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.Plan:
        if self.job.plan is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "no plan yet: give the coordinator a job (`coordinator submit --model ... "
                "--agents N`, or start it with them), and wait for the agents to join",
            )
        return self.job.plan

    async def GetHistory(
        self, request: coordinator_pb2.HistoryRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.JobHistory:
        if (run := self.run_of(request.job_id)) is not None:
            return self.history_of_job(run)()
        if request.job_id and request.job_id != self.job.job_id:
            if (ended := self.archive.histories.get(request.job_id)) is None:
                kept = ", ".join(self.archive.histories) or "none"
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"no history of job {request.job_id[:100]!r}: the "
                                    f"coordinator keeps the running job's and the newest ended "
                                    f"jobs' ({kept}); `coordinator jobs` lists the jobs")
                raise  # unreachable: abort raises
            return ended()
        return self.history_answer()

    def history_answer(self, limit: int | None = None, tail: int | None = None
                       ) -> coordinator_pb2.JobHistory:
        """What GetHistory answers; `limit`: at most that many points, spread (the web
        view); `tail`: the newest that many (the TensorBoard log)."""
        return self.history_of_job()(limit, tail)

    def history_of_job(self, run: RunningJob | None = None
                       ) -> Callable[..., coordinator_pb2.JobHistory]:
        """A running job's history answer (the primary one's by default) as it stands, kept
        when the job ends."""
        job, history = (self.job, self.history) if run is None else (run.job, run.history)
        cfg = job.config
        tokens = cfg.train.global_batch * cfg.model_spec().seq_len if cfg.model else 0
        return partial(history.to_proto, job.status(), tokens, job.restarts)


    async def MeasureLinks(
        self, request: coordinator_pb2.MeasureRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.LinkMatrix:
        if not (_finite(request.timeout_s) and request.timeout_s >= 0):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "timeout_s must be >= 0")
        if not (_finite(request.ping_spread_s) and 0 <= request.ping_spread_s
                <= MAX_PING_SPREAD_S):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"ping_spread_s must be from 0 to {MAX_PING_SPREAD_S:g} seconds, "
                                f"got {request.ping_spread_s}")
        agents = self.registry.alive()
        if len(agents) < 2:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"need at least 2 live agents to measure links, have {len(agents)}",
            )
        if any(job.busy_training() for job in self.jobs_now()):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "a training job is running: measuring now would disturb it",
            )
        timeout = request.timeout_s or self.config.measure_timeout_s
        try:
            return await asyncio.wait_for(
                self.measurer.measure(agents, sampled=request.sampled,
                                      pings=Pings(spread_s=request.ping_spread_s)), timeout)
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"measurement did not finish within {timeout:.0f} s; "
                "partial results are in GetStatus",
            )
            raise  # unreachable: abort raises

    # --- lifecycle ---
    async def sweep_forever(self) -> None:
        period = max(0.05, min(self.config.heartbeat_interval_s,
                               self.config.liveness_timeout_s / 4))
        loop = asyncio.get_running_loop()
        while not self.stopping.is_set():
            self.registry.sweep()  # tells the job through on_lost
            self.links.forget(self.registry.evict())
            slept = loop.time()
            await asyncio.sleep(period)
            # woken late: the loop was held, and heartbeats sent meanwhile are still unread
            self.registry.deafened(loop.time() - slept - period)

    async def remeasure_forever(self) -> None:
        """Refresh the link matrix every `measure_every_s` while no job is training."""
        every = self.config.measure_every_s
        while every > 0 and not self.stopping.is_set():
            await asyncio.sleep(every)
            agents = self.registry.alive()
            if len(agents) < 2 or self.measurer.running or any(
                    job.busy_training() for job in self.jobs_now()):
                continue
            try:
                await asyncio.wait_for(self.measurer.measure(agents),
                                       self.config.measure_timeout_s)
            except TimeoutError:
                log.warning("periodic link measurement did not finish within %.0f s",
                            self.config.measure_timeout_s)

    def close_streams(self) -> None:
        self.stopping.set()
        for rec in self.registry.all():
            rec.commands.put_nowait(None)  # type: ignore[arg-type]


async def serve(config: CoordinatorConfig, ready: asyncio.Event | None = None) -> None:
    """Run the coordinator until SIGTERM/SIGINT."""
    from coordinator.daemon.sidecars import start_metrics, start_tensorboard, start_web

    service = CoordinatorService(config)
    metrics = await start_metrics(service)
    web = await start_web(service)
    board = start_tensorboard(service)

    def register(server: grpc.aio.Server) -> list[str]:
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, server)
        return [coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name,
                *relayprobe.register(server)]

    # the one public port: gRPC and the relay; with a relay port of its own (or none) gRPC
    # listens by itself, as before the front (no extra hop)
    # the relay is wired to the front before it listens: a member dialling the relay the
    # moment a restarted coordinator listens is served, not refused as a stranger
    front = Front() if config.relay_shared else None
    shared_relay = service.job.dataplane.share_relay(front) if front is not None else None
    server, port, health = await rpc.start_server(
        config.listen, config.security, register, "coordinator", front=front
    )
    log.info("coordinator listening on %s (port %d, %s)", config.listen, port,
             "TLS" if config.security.tls else "plaintext")
    service.operator.announce()
    if shared_relay is not None:
        shared_relay.port = port  # the port assignments name
        log.info("data-plane relay on the gRPC port %d (one port for both)", port)
    elif (relay_at := config.relay_address()) is not None:
        try:
            relay_port = await service.job.dataplane.start_relay(*relay_at)
            log.info("data-plane relay listening on %s:%d", relay_at[0], relay_port)
        except OSError as exc:  # the operator's port: say so and stop
            await server.stop(grace=0)
            raise rpc.ConfigError(f"--relay-port {config.relay_port}: cannot listen on "
                                  f"{relay_at[0]}:{relay_at[1]}: {exc.strerror}; pick a free "
                                  f"port, leave it out to share the gRPC port, or 0 to run "
                                  f"no relay") from exc
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(service.sweep_forever()),
             asyncio.create_task(service.run_jobs()),
             asyncio.create_task(service.remeasure_forever())]
    if board is not None:
        tasks.append(asyncio.create_task(board.run()))
    if ready is not None:
        ready.set()
    await stop.wait()
    log.info("coordinator shutting down")
    await health.enter_graceful_shutdown()
    for job in service.jobs_now():
        await job.shutdown()
    await service.job.dataplane.close()
    await service.reach.close()
    service.close_streams()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if front is not None:
        await front.aclose()
    await server.stop(grace=2.0)
    if metrics is not None:
        metrics.close()
    if web is not None:
        await web.close()
    if board is not None:
        board.close()
    log.info("coordinator stopped")
