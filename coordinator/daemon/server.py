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
from coordinator.daemon.jobcalls import JobCalls
from coordinator.daemon.jobs import ENDED, Archive, JobQueue, Submitted
from coordinator.daemon.jobstore import JobStore
from coordinator.daemon.pushgate import PushGate
from coordinator.daemon.registry import LEFT, AgentRecord, IdentityError, Registry
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
        self.job = Job(config.job, self.registry, self.measurer, self.links, store=self.store,
                       reach=self.reach)  # plans only once members' reach verdicts are in
        self.measurer.punching = self.job.dataplane  # stranded pairs punch through its relay
        # lies about the network are evidence, recorded only (docs/architecture.md, Integrity)
        self.reach.evidence = self.measurer.evidence = self._network_evidence
        self.history = History()
        self.integrity = IntegrityReports()  # what agents' replica checks found (issue 43)
        self.corroboration = Corroboration()  # ... and when two of them confirm a fault
        self._gate = PushGate(self.registry, self.job)
        self.copies = CoordinatorCopies(config.state_dir, config.checkpoint_store_bytes,
                                        self._gate.admit)
        self.queue = JobQueue(self.store)  # submitted jobs (coordinator/daemon/jobs.py)
        self.archive = Archive()  # ... and what is kept of ended ones
        self.driving: asyncio.Future[None] | None = None  # the task driving `job`
        self.stopping = asyncio.Event()
        self._export_source: coordinator_pb2.ExportSource | None = None

    def _network_evidence(self, agent_id: str, kind: str, detail: str) -> None:
        """A report about the network that the coordinator's checks contradict: evidence
        against its reporter, never enough to exclude on its own."""
        self.job.integrity.ledger.record(agent_id, kind, 0, detail)

    def _changed(self) -> None:
        job = getattr(self, "job", None)
        if job is not None:
            job.poke()

    def _lost(self, lost: list[AgentRecord]) -> None:
        """The registry lost agents (silent, or unreachable as the job found): tell the job."""
        job = getattr(self, "job", None)
        if job is not None:
            job.on_lost(lost)

    # --- agents ---
    async def Join(
        self, request: coordinator_pb2.JoinRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.Command]:
        problem = validate_agent_info(request.agent) or secret_problem(request.agent_secret)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if self.stopping.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "coordinator is shutting down")
        if refused := self.job.integrity.refusal(request.agent.agent_id):
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
        self.job.on_join(rec)
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
        self.job.on_progress(rec, request)
        floor = 0
        if request.job_id and request.job_id == self.job.job_id:
            self.history.record(rec.agent_id, request)
            if request.epoch == self.job.epoch:
                floor = self.job.checkpoint_floor()
                layout = self.job.planner.layout  # stages the coordinator holds count too
                if request.integrity and layout is not None:  # evidence, kept and logged
                    self.corroboration.feed(self.integrity.record(
                        rec.agent_id, request, self.job.members, layout.stages),
                        self.job.integrity.ledger)
                if self.job.state == coordinator_pb2.JOB_STATE_RUNNING and layout is not None:
                    floor = self.copies.floor(self.job.job_id, layout.stages, floor)
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
            if rec is not None and (refused := self.job.integrity.refusal(rec.agent_id)):
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
    def use_job(self, submitted: Submitted) -> None:
        """Make `submitted` the job this coordinator drives (the one before it has ended)."""
        job = Job(submitted.config, self.registry, self.measurer, self.links,
                  store=self.store, reach=self.reach, job_id=submitted.job_id)
        job.dataplane.share_relay_of(self.job.dataplane)
        excluded = self.job.integrity.ledger.to_json()["exclusions"]
        if excluded and not job.epoch:  # a new job: who a confirmed fault excluded stays out
            job.integrity.restore({"exclusions": excluded})
        self._gate.job = self.job = job
        self.measurer.punching = job.dataplane  # stranded pairs punch through its relay
        self.history, self._export_source = History(), None
        log.info("job %s: starting (%s), submitted with %s", job.job_id, job.config.model,
                 " ".join(submitted.args))

    async def run_job(self) -> None:
        """Drive the job (and its export) until it ends or is cancelled; the coordinator's
        checkpoint copies of the job go when it ends (kept while it is unfinished: a
        restarted coordinator continues it)."""
        if self.job.job_id:
            await self.copies.keep_only(self.job.job_id)
        self.driving = asyncio.ensure_future(self._run_and_export())
        try:
            await self.driving
        except asyncio.CancelledError:
            if self.job.state != coordinator_pb2.JOB_STATE_CANCELLED:
                raise  # the coordinator stops
        if self.job.job_id and self.job.state in ENDED:
            await self.copies.remove(self.job.job_id, "the job ended")

    async def _run_and_export(self) -> None:
        """Drive the job; after its last step, write --export-dir when given."""
        await self.job.run()
        job = self.job.config
        if not (job.export_dir and self.job.state == coordinator_pb2.JOB_STATE_DONE):
            return
        from coordinator.job.export import export_from_status
        from dtfm.core.hfexport import ExportError

        status = coordinator_pb2.ClusterStatus(
            agents=[a.to_proto() for a in self.registry.status_rows(MAX_AGENTS)[0]],
            job=self.job_status())
        try:
            step, out = await export_from_status(status, self.config.security,
                                                 job.export_dir, merged=job.export_merged,
                                                 say=log.info)
        except ExportError as exc:
            log.error("export to %s failed: %s (run `coordinator export` to try again)",
                      job.export_dir, exc)
            return
        log.info("exported step %d of job %s to %s", step, self.job.job_id, out)

    async def GetStatus(
        self, request: coordinator_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ClusterStatus:
        status, omitted = self.status_answer()
        if request.job_id and request.job_id != status.job.job_id:
            if (ended := self.archive.statuses.get(request.job_id)) is None:
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
        return coordinator_pb2.ClusterStatus(
            agents=[*(integrity_status(a.to_proto(), self.job.integrity.ledger) for a in rows),
                    *excluded_rows(self.job.integrity.ledger, set(ids))],
            job=self.job_status(),
            plan=self.job.plan or common_pb2.Plan(),
            links=self.links.matrix(ids) if self.links.entries else common_pb2.LinkMatrix(),
            now_unix_s=time.time(),
        ), omitted

    def job_status(self) -> coordinator_pb2.JobStatus:
        """The job's status with what an export writes beside the weights (token ids,
        tokenizer, a LoRA job's settings: `coordinator.job.export.job_export_source`, read
        once)."""
        status = self.job.status()
        status.coordinator_checkpoints.extend(self.copies.held(status.job_id))
        if line := self.unreachable_line(status.state):
            status.message = f"{status.message}; {line}" if status.message else line
        if self.job.config.model:
            if self._export_source is None:
                from coordinator.job.export import job_export_source

                self._export_source = job_export_source(self.job.config.train)
            status.export_source.CopyFrom(self._export_source)
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

    def history_of_job(self) -> Callable[..., coordinator_pb2.JobHistory]:
        """The running job's history answer as it stands, kept when the job ends."""
        job = self.job.config
        tokens = job.train.global_batch * job.model_spec().seq_len if job.model else 0
        return partial(self.history.to_proto, self.job.status(), tokens, self.job.restarts)


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
        if self.job.busy_training():
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
            if len(agents) < 2 or self.job.busy_training() or self.measurer.running:
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
    front = Front() if config.relay_shared else None
    server, port, health = await rpc.start_server(
        config.listen, config.security, register, "coordinator", front=front
    )
    log.info("coordinator listening on %s (port %d, %s)", config.listen, port,
             "TLS" if config.security.tls else "plaintext")
    if config.relay_shared:
        assert front is not None
        relay = service.job.dataplane.share_relay(port, front)
        front.on_data = relay.accept
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
    await service.job.shutdown()
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
