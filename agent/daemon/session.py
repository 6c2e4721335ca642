"""The agent's session with the coordinator: join, heartbeats, and pushed commands.

The agent dials out (so agents behind NAT still work for control) and holds the Join stream;
every command arrives on it. When the coordinator goes away the session retries with
exponential backoff and jitter, and re-joins under the same id when it comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random

import grpc

from agent.daemon.identity import SecretFile
from agent.daemon.relayhost import RelayHost
from agent.daemon.supervisor import Supervisor
from agent.probing import punchprobe
from agent.probing.linkprobe import measure_peer
from agent.probing.tuning import TuningCheck
from dtfm import rpc
from dtfm.core.assignment import resolve_relay
from dtfm.core.events import IntegrityEvent
from dtfm.core.limits import MAX_EVIDENCE, MAX_KIND, clip, finite
from dtfm.core.workerstate import WorkerState
from dtfm.net import reach
from dtfm.net.handoff import DataHandoff
from dtfm.net.relay import Relay
from protos.dtfm.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)

# The heartbeat interval a coordinator may ask for (it stretches it as agents join,
# coordinator/daemon/pace.py): kept within these bounds so that a wrong figure neither floods
# the coordinator nor leaves the agent silent past any liveness timeout.
HEARTBEAT_BOUNDS_S = (0.05, 60.0)
REPORT_S_PER_SAMPLE = 0.05  # a link report's deadline: 10 s and this per sample it carries
FATAL_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT,
               grpc.StatusCode.PERMISSION_DENIED)


class FatalSessionError(RuntimeError):
    """The coordinator refused us for a reason retrying cannot fix."""


class CoordinatorSession:
    def __init__(self, info: common_pb2.AgentInfo, target: str, security: rpc.Security,
                 supervisor: Supervisor, max_backoff_s: float = 10.0,
                 state_dir: str | None = None, tuning: TuningCheck | None = None) -> None:
        self.info = info
        # the host's kernel settings, re-checked after each measurement (None: not checked)
        self.tuning = tuning
        self._secret_file = SecretFile(state_dir)
        self.secret = self._secret_file.load()
        self.target = target
        self.security = security
        self.supervisor = supervisor
        self.relay_host: RelayHost | None = None  # the relay it serves (--relay-port)
        # where its port's data-plane connections wait for the worker (None: --data-port)
        self.data_handoff: DataHandoff | None = None
        self.max_backoff_s = max_backoff_s
        self.connected = False
        self.heartbeat_interval_s = 1.0
        self.state = WorkerState.IDLE  # MEASURING while it measures links
        self._leaving = False  # set by say_goodbye: no heartbeat may follow the goodbye
        self._welcomed_once = False  # a goodbye is owed only to a coordinator that knows us
        self._beating = asyncio.Lock()  # held while a heartbeat is in flight
        self._stub: coordinator_pb2_grpc.CoordinatorStub | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # by (peer id, address): two peers behind different NATs may advertise one address
        self._peer_channels: dict[tuple[str, str], grpc.aio.Channel] = {}
        self._rtt_s: dict[tuple[str, str], float] = {}  # from the last latency pass
        # whether peers can dial us, as the coordinator last said (agent status shows it)
        self.reach = common_pb2.ReachStatus()
        self._stopping = False

    async def run(self) -> None:
        """Join and serve commands until cancelled; raises FatalSessionError on refusal."""
        backoff = 0.25
        while True:
            channel = rpc.open_channel(self.target, self.security)
            self._stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            heartbeat: asyncio.Task[None] | None = None
            try:
                stream = self._stub.Join(coordinator_pb2.JoinRequest(
                    agent=self.info, agent_secret=self.secret))
                async for command in stream:
                    if self._stopping:  # a welcome in flight as the agent began to stop
                        break
                    if command.HasField("welcome"):
                        self._welcomed(command.welcome)
                        self.heartbeat_interval_s = paced_interval(
                            command.welcome.heartbeat_interval_s or 1.0)
                        self.connected = True
                        self._welcomed_once = True
                        backoff = 0.25
                        log.info("joined coordinator %s as %s", self.target, self.info.agent_id)
                        if heartbeat is None:
                            heartbeat = asyncio.create_task(self._heartbeats(stream))
                    else:
                        self._handle(command)
                if self._stopping:  # the agent is shutting down: nothing to rejoin for
                    return
                log.warning("coordinator %s closed the session; rejoining", self.target)
            except grpc.aio.AioRpcError as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    # grpc turns our own cancellation (the agent is stopping) into a CANCELLED
                    # RPC error; swallowing it would rejoin and retry forever
                    raise asyncio.CancelledError from exc
                if self._stopping:
                    return
                if exc.code() in FATAL_CODES:
                    raise FatalSessionError(rpc.describe_rpc_error(exc, self.target)) from exc
                if exc.code() != grpc.StatusCode.CANCELLED or self.connected:
                    log.warning("%s; retrying in %.1f s",
                                rpc.describe_rpc_error(exc, self.target), backoff)
            finally:
                self.connected = False
                if heartbeat is not None:
                    heartbeat.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await heartbeat
                await channel.close()
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(self.max_backoff_s, backoff * 2)

    def _welcomed(self, welcome: coordinator_pb2.Welcome) -> None:
        """Keep the secret the coordinator issued (a restarted one issues a new one)."""
        if welcome.agent_secret and welcome.agent_secret != self.secret:
            self.secret = welcome.agent_secret
            self._secret_file.save(self.secret)

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _handle(self, command: coordinator_pb2.Command) -> None:
        kind = command.WhichOneof("kind")
        if kind == "measure":
            self._spawn(self._measure(command.measure))
        elif kind == "assign":
            a = command.assign
            resolve_relay(a, self.target)
            if self.relay_host is not None:
                self.relay_host.admit(a)
            if self.data_handoff is not None:  # before the worker starts: peers may dial now
                self.data_handoff.hold(a.job_id, a.epoch)
            log.info("assignment: job %s epoch %d rank %d stage %d replica %d",
                     a.job_id, a.epoch, a.rank, a.stage, a.replica)
            self._spawn(self.supervisor.start(a))
        elif kind == "stop":
            if self.data_handoff is not None:
                self.data_handoff.release()
            self._spawn(self.supervisor.stop(command.stop.reason or "coordinator said stop"))
        elif kind == "reach":
            self._reached(command.reach)
        elif kind == "dial":
            self._spawn(self._dial(command.dial))
        elif kind == "checkpoint":
            c = command.checkpoint
            self.supervisor.request_checkpoint(c.job_id, c.epoch, c.step, c.reason)
        else:
            log.warning("ignoring unknown command %r (newer coordinator?)", kind)

    def _reached(self, status: common_pb2.ReachStatus) -> None:
        """Log the coordinator's verdict on dialling us back, once per change of verdict (more
        peers dialling later refine the figures, not the verdict)."""
        before = self.reach
        self.reach = status
        if status.verdict == reach.UNKNOWN or (status.verdict, status.address) == (
                before.verdict, before.address):
            return
        line = reach.agent_line(status)
        if status.verdict == reach.NOWHERE:
            log.warning("%s", line)
        else:
            log.info("%s", line)

    async def _dial(self, cmd: coordinator_pb2.DialCommand) -> None:
        """Dial a newcomer back, as the coordinator asked, and say whether it answered."""
        timeout_s = min(max(cmd.timeout_s, 0.1), 30.0) if cmd.timeout_s > 0 else \
            reach.DIAL_TIMEOUT_S
        error = await reach.dial(cmd.peer.address, cmd.peer.agent_id, self.security, timeout_s)
        if self._stub is None:
            return
        try:
            await self._stub.ReportDial(coordinator_pb2.DialReport(
                agent_id=self.info.agent_id, agent_secret=self.secret, round_id=cmd.round_id,
                peer_id=cmd.peer.agent_id, ok=not error, error=error), timeout=10.0)
        except grpc.aio.AioRpcError as exc:
            log.warning("could not report a dial-back of %s: %s", cmd.peer.agent_id,
                        rpc.describe_rpc_error(exc, self.target))
        except grpc.aio.UsageError:  # the agent is stopping: its channel closed meanwhile
            log.info("the dial-back of %s ended as the agent stopped; not reported",
                     cmd.peer.agent_id)

    async def _measure(self, cmd: coordinator_pb2.MeasureLinksCommand) -> None:
        """Measure the named peers and report: pings to all at once, transfers one by one.

        Concurrent pings do not disturb each other (they are tiny); concurrent transfers would
        share this device's network and CPU, so they run in turn.
        """
        self.state = WorkerState.MEASURING
        try:
            if cmd.kind == coordinator_pb2.MEASURE_KIND_PUNCH:
                samples = [await punchprobe.probe(self.info.agent_id, cmd, self.target)]
            elif cmd.kind == coordinator_pb2.MEASURE_KIND_LATENCY:
                samples = list(await asyncio.gather(
                    *(self._measure_peer(cmd, peer) for peer in cmd.peers)))
            else:
                samples = [await self._measure_peer(cmd, peer) for peer in cmd.peers]
            if self.tuning is not None and cmd.kind in (coordinator_pb2.MEASURE_KIND_BOTH,
                                                        coordinator_pb2.MEASURE_KIND_BANDWIDTH):
                self.tuning.run()  # the buffers against the bandwidth-delay products just seen
            await self.report_links(cmd.round_id, samples)
        except grpc.aio.AioRpcError as exc:
            log.warning("could not report links: %s", rpc.describe_rpc_error(exc, self.target))
        except grpc.aio.UsageError:  # the agent is stopping: its channel closed meanwhile
            log.info("a link measurement ended as the agent stopped; not reported")
        finally:
            self.state = WorkerState.IDLE

    async def report_links(self, round_id: str, samples: list[common_pb2.LinkSample]) -> None:
        """Send one measurement round's samples (raises the RPC's error). The deadline
        grows with them: a latency pass of N agents reports N-1 samples from each at once,
        and the coordinator records them one after another (1,000 agents' reports outlasted
        a fixed 10 s on a loaded core, and every late one was lost: bench/scale.py)."""
        if self._stub is not None:
            await self._stub.ReportLinks(coordinator_pb2.LinkReport(
                agent_id=self.info.agent_id, round_id=round_id, samples=samples,
                agent_secret=self.secret), timeout=10.0 + REPORT_S_PER_SAMPLE * len(samples))

    async def _measure_peer(self, cmd: coordinator_pb2.MeasureLinksCommand,
                            peer: coordinator_pb2.PeerTarget) -> common_pb2.LinkSample:
        if peer.agent_id == reach.COORDINATOR and not peer.address:
            # the relay: the coordinator, at the address this agent joined it by (it may sit
            # behind a NAT, so only the agent knows how it reaches the coordinator)
            peer = coordinator_pb2.PeerTarget(agent_id=peer.agent_id, address=self.target)
        key = (peer.agent_id, peer.address)
        channel = self._peer_channels.get(key)
        if channel is None:
            channel = rpc.open_channel(peer.address, self.security)
            self._peer_channels[key] = channel
        sample = await measure_peer(
            self.info.agent_id, peer, channel,
            ping_count=cmd.ping_count or 5,
            probe_seconds=cmd.probe_seconds or 1.0,
            probe_max_bytes=cmd.probe_max_bytes or 256 * 1024 * 1024,
            latency=cmd.kind != coordinator_pb2.MEASURE_KIND_BANDWIDTH,
            bandwidth=cmd.kind != coordinator_pb2.MEASURE_KIND_LATENCY,
            rtt_hint_s=self._rtt_s.get(key, 0.0),
            ping_spread_s=cmd.ping_spread_s)
        if sample.reachable and sample.delay_ms > 0:
            self._rtt_s[key] = 2 * sample.delay_ms / 1000
        if self.tuning is not None and sample.bandwidth_gbps > 0:
            self.tuning.observe(sample, self._rtt_s.get(key, 0.0))
        if not sample.reachable:  # start afresh next time
            self._rtt_s.pop(key, None)
            if self._peer_channels.get(key) is channel:
                del self._peer_channels[key]
                await channel.close()
        return sample

    def reported_state(self) -> WorkerState:
        """The state the heartbeat carries: the worker's while one runs or has ended, else
        the session's own (idle, or measuring links); a worker being stopped counts as none."""
        p = self.supervisor.progress
        if p.state in (WorkerState.IDLE, WorkerState.STOPPED):
            return self.state
        return p.state

    def progress_report(self) -> coordinator_pb2.ProgressReport:
        p = self.supervisor.progress
        return coordinator_pb2.ProgressReport(
            agent_id=self.info.agent_id, job_id=p.job_id, epoch=p.epoch,
            worker_state=self.reported_state().to_wire(), step=p.step,  # type: ignore[arg-type]
            loss=p.loss, tokens_per_s=p.tokens_per_s, error=clip(p.error),
            total_steps=p.total_steps, step_s=p.step_s, compute_s=p.compute_s,
            pp_wait_s=p.pp_wait_s, dp_s=p.dp_s, error_kind=clip(p.error_kind, MAX_KIND),
            pp_bytes_sent=p.pp_bytes_sent, dp_bytes_sent=p.dp_bytes_sent,
            agent_secret=self.secret,
            mirrored_steps=copier.mirrored if (copier := self.supervisor.checkpoints) else {},
            resumed_step=p.resumed_step if p.resumed_step >= 0 else None,
            checkpoint_step=p.checkpoint_step,
            sync_every=p.sync_every, sync_round=p.sync_round, drift=p.drift,
            breakdown=p.breakdown.to_proto() if p.breakdown.step_s > 0 else None,
            validations=[coordinator_pb2.Validation(step=step, loss=loss)
                         for step, loss in p.validations],
            link_windows=[coordinator_pb2.LinkWindow(step=step, act_out=f[0], act_in=f[1],
                                                     grad_out=f[2], grad_in=f[3])
                          for step, f in p.link_windows],
            integrity=evidence_messages(p.integrity[:MAX_EVIDENCE]),
            integrity_through=p.evidence_through(MAX_EVIDENCE),
            tuning=self.tuning.to_proto() if self.tuning is not None else [],
            relay_forwarded_bytes=relay.forwarded(p.job_id) if (relay := self.relay) else 0,
            relay_refused_bytes=relay.refused_bytes if relay else 0,
        )

    @property
    def relay(self) -> Relay | None:
        """The relay this agent serves (`--relay-port`), if any."""
        return self.relay_host.relay if self.relay_host is not None else None

    async def _heartbeats(self, stream: grpc.aio.UnaryStreamCall) -> None:
        assert self._stub is not None
        while not self._leaving:
            try:
                async with self._beating:
                    if self._leaving:
                        return
                    progress, report = self.supervisor.progress, self.progress_report()
                    ack = await self._stub.ReportProgress(report, timeout=HEARTBEAT_TIMEOUT_S)
                progress.delivered(len(report.integrity))
                if ack.heartbeat_interval_s > 0:  # the coordinator paces us as agents join
                    self.heartbeat_interval_s = paced_interval(ack.heartbeat_interval_s)
                if ack.keep_checkpoints_from and self.supervisor.checkpoints is not None:
                    await self.supervisor.checkpoints.keep_from(report.job_id,
                                                                ack.keep_checkpoints_from)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    log.warning("coordinator forgot us (restarted?); rejoining")
                    stream.cancel()
                    return
                if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                    # Another process joined under our id with our secret (a copied state
                    # directory): the Join that follows is refused and says so.
                    log.error("coordinator refused our heartbeat: %s", exc.details())
                    stream.cancel()
                    return
                log.warning("heartbeat failed: %s", rpc.describe_rpc_error(exc, self.target))
            await asyncio.sleep(self.heartbeat_interval_s)

    async def close_peer_channels(self) -> None:
        for channel in self._peer_channels.values():
            await channel.close()
        self._peer_channels.clear()

    def stop_rejoining(self) -> None:
        """The agent is shutting down: a session the coordinator ends from now on (it may be
        stopping too) is not joined again, and says no "retrying"."""
        self._stopping = True

    async def say_goodbye(self, reason: str = "agent shutting down") -> None:
        """Tell the coordinator we are leaving on purpose, so it marks us left, not lost.

        Heartbeats stop first: one sent after the goodbye would bring us back to life in the
        registry (a heartbeat from a known agent means it is alive). The goodbye goes on a
        channel of its own: the session's ends whenever a command arrives after the stop
        began, and a goodbye that waited on it was skipped. A slow coordinator gets a few
        tries within `GOODBYE_BUDGET_S` (`send_goodbye`), a gone one does not hold us up.
        """
        self._leaving = True
        if not self._welcomed_once:
            return
        # a heartbeat still in flight could reach the coordinator after the goodbye and mark
        # us alive again: let it land first
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(HEARTBEAT_TIMEOUT_S):
                await self._beating.acquire()
                self._beating.release()
        request = coordinator_pb2.LeaveRequest(agent_id=self.info.agent_id,
                                               agent_secret=self.secret, reason=clip(reason))
        channel = rpc.open_channel(self.target, self.security)
        try:
            problem = await send_goodbye(coordinator_pb2_grpc.CoordinatorStub(channel), request)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            problem = "cancelled"
        finally:
            await channel.close()
        if problem:
            log.warning("could not tell coordinator %s that this agent is leaving (%s); it will "
                        "mark the agent lost when its heartbeats stop", self.target, problem)


HEARTBEAT_TIMEOUT_S = 5.0
GOODBYE_BUDGET_S = 5.0
GOODBYE_TRY_S = 2.5
GOODBYE_UNAVAILABLE_TRIES = 2  # a coordinator that is gone answers UNAVAILABLE at once


async def send_goodbye(stub: coordinator_pb2_grpc.CoordinatorStub,
                       request: coordinator_pb2.LeaveRequest,
                       budget_s: float = GOODBYE_BUDGET_S) -> str:
    """Send `request` until the coordinator acknowledges it, refuses it, or `budget_s` runs
    out. Returns "" when it was acknowledged, else why not.

    A goodbye that timed out is sent again while the budget lasts (a loaded coordinator is
    slow, not gone); UNAVAILABLE gets one more try only, so an agent whose coordinator has
    stopped is not held up shutting down."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget_s
    problem, unavailable = "no time left to send it", 0
    while (left := deadline - loop.time()) > 0.05:
        try:
            await stub.Leave(request, timeout=min(GOODBYE_TRY_S, left))
            return ""
        except grpc.aio.AioRpcError as exc:
            problem = f"{exc.code().name}: {exc.details()}"
            unavailable += exc.code() == grpc.StatusCode.UNAVAILABLE
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED and (
                    exc.code() != grpc.StatusCode.UNAVAILABLE
                    or unavailable >= GOODBYE_UNAVAILABLE_TRIES):
                return problem
        await asyncio.sleep(min(0.2, max(0.0, deadline - loop.time())))
    return problem


def evidence_messages(events: list[IntegrityEvent]) -> list[coordinator_pb2.IntegrityEvidence]:
    """The worker's integrity events as a heartbeat carries them, within the wire's limits
    (texts clipped, a non-finite score clamped: `coordinator/daemon/validate.py`)."""
    return [coordinator_pb2.IntegrityEvidence(
        step=e.step, kind=clip(e.kind, MAX_KIND), suspect_rank=e.suspect_rank,
        score=finite(e.score), detail=clip(e.detail), reporter_rank=e.rank) for e in events]


def paced_interval(seconds: float) -> float:
    """The coordinator's heartbeat interval, within `HEARTBEAT_BOUNDS_S` (NaN: 1 s)."""
    low, high = HEARTBEAT_BOUNDS_S
    return 1.0 if math.isnan(seconds) else max(low, min(high, seconds))
