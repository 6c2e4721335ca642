"""The agent daemon: its own `dtfm.v1.Agent` service plus the session with the coordinator.

Peers call Ping and Probe here to measure their links to us; people call GetStatus. The
daemon never trains in-process: the supervisor runs the worker as a child.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc

from agent.daemon.config import AgentConfig
from agent.daemon.identity import load_or_create_id
from agent.daemon.relayhost import RelayHost
from agent.daemon.session import CoordinatorSession, FatalSessionError
from agent.daemon.statedir import checkpoint_dir
from agent.daemon.supervisor import Supervisor
from agent.probing.device import detect
from agent.probing.tuning import TuningCheck
from dtfm import rpc
from dtfm.checkpoints.copies import CheckpointCopier, CheckpointStore
from dtfm.checkpoints.push import CheckpointPushes
from dtfm.core.workerstate import WorkerState
from dtfm.net import probe, reach
from dtfm.net.dataplane import NO_RANK, Hello
from dtfm.net.front import DataHandler, Front
from dtfm.net.handoff import DataHandoff
from protos.dtfm.v1 import agent_pb2, agent_pb2_grpc, common_pb2

log = logging.getLogger(__name__)
VERSION = "0.1.0"


class AgentService(agent_pb2_grpc.AgentServicer):
    def __init__(self, info: common_pb2.AgentInfo,
                 checkpoints: CheckpointStore | None = None,
                 pushes: CheckpointPushes | None = None) -> None:
        self.info = info
        self.session: CoordinatorSession | None = None
        self.checkpoints = checkpoints  # this agent's own checkpoint directory, for peers
        self.pushes = pushes  # copies pushed here by holders nobody can dial

    async def Ping(self, request: agent_pb2.PingRequest,
                   context: grpc.aio.ServicerContext) -> agent_pb2.PingReply:
        return agent_pb2.PingReply(nonce=request.nonce, agent_id=self.info.agent_id)

    async def Probe(self, request_iterator: AsyncIterator[agent_pb2.ProbeChunk],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[agent_pb2.ProbeWindow]:
        """Report arrivals per window of time until the caller half-closes (`dtfm.net.probe`)."""
        async for window in probe.windows(request_iterator):
            yield window

    async def GetStatus(self, request: agent_pb2.AgentStatusRequest,
                        context: grpc.aio.ServicerContext) -> agent_pb2.AgentStatusReply:
        s = self.session
        progress = s.supervisor.progress if s else None
        state = progress.state if progress else WorkerState.IDLE
        return agent_pb2.AgentStatusReply(
            info=self.info, coordinator=s.target if s else "",
            connected=bool(s and s.connected),
            worker_state=state.to_wire(),  # type: ignore[arg-type]
            job_id=progress.job_id if progress else "",
            step=progress.step if progress else 0, loss=progress.loss if progress else 0.0,
            reach=s.reach if s else None,
        )

    async def ListCheckpoints(self, request: agent_pb2.ListCheckpointsRequest,
                              context: grpc.aio.ServicerContext) -> agent_pb2.CheckpointList:
        """The complete steps of one stage held here: how a peer finds a copy it lacks."""
        if self.checkpoints is None:
            return agent_pb2.CheckpointList()
        return await self.checkpoints.list(request, context)

    async def FetchCheckpoint(self, request: agent_pb2.FetchCheckpointRequest,
                              context: grpc.aio.ServicerContext
                              ) -> AsyncIterator[agent_pb2.CheckpointChunk]:
        """One file of a complete step, from an offset (dtfm/checkpoints/copies.py validates)."""
        if self.checkpoints is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "this agent serves no checkpoints")
            return
        async for chunk in self.checkpoints.fetch(request, context):
            yield chunk

    async def PushCheckpoint(self, request_iterator: AsyncIterator[agent_pb2.CheckpointPush],
                             context: grpc.aio.ServicerContext
                             ) -> agent_pb2.CheckpointPushReply:
        """A step uploaded by a holder nobody can dial (dtfm/checkpoints/push.py validates)."""
        if self.pushes is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this agent keeps no pushed checkpoint copies")
        assert self.pushes is not None
        return await self.pushes.receive(request_iterator, context)


def registrar(service: AgentService) -> Callable[[grpc.aio.Server], list[str]]:
    """What `rpc.start_server` calls to add `service` and name it (for health, reflection)."""

    def register(server: grpc.aio.Server) -> list[str]:
        agent_pb2_grpc.add_AgentServicer_to_server(service, server)
        return [agent_pb2.DESCRIPTOR.services_by_name["Agent"].full_name]

    return register


async def start_metrics(config: AgentConfig, service: AgentService) -> asyncio.Server | None:
    """The Prometheus endpoint of `--metrics-listen`, or None when it is off."""
    if not config.metrics_listen:
        return None
    from agent.daemon.metrics import agent_registry
    from dtfm.metrics import serve_metrics

    server, _ = await serve_metrics(config.metrics_listen,
                                    agent_registry(service.info, lambda: service.session))
    return server


async def start_relay(config: AgentConfig, info: common_pb2.AgentInfo,
                      session: CoordinatorSession) -> RelayHost | None:
    """Serve the relay of `--relay` (on the gRPC port) or `--relay-port` (its own; None:
    off) and advertise it at Join."""
    if not config.relay_port and not config.relay:
        return None
    shared = not config.relay_port
    host = RelayHost(rpc.split_hostport(config.listen)[0] or "0.0.0.0",
                     info.port if shared else config.relay_port, info.host, shared=shared)
    info.relay_port = await host.start()
    session.relay_host = host
    log.info("agent serves a dtfm relay on port %d for its jobs' pairs nobody can dial "
             "(used while peers can dial this agent)", info.relay_port)
    return host


def data_router(handoff: DataHandoff | None, relay: RelayHost | None) -> DataHandler | None:
    """Where the front sends a dtfm connection: a circuit naming a target rank to the relay
    served on this port, any other to the epoch's worker; None when neither is here."""
    if handoff is None and relay is None:
        return None

    def route(sock: socket.socket, hello: Hello) -> None:
        if hello.target != NO_RANK and relay is not None:
            relay.relay.accept(sock, hello)
        elif hello.target == NO_RANK and handoff is not None:
            handoff.give(sock, hello)
        else:
            log.warning("closed a dtfm connection for %s: this agent serves %s on its port",
                        "a relay circuit" if hello.target != NO_RANK else "its worker",
                        "no relay (--relay)" if hello.target != NO_RANK
                        else "no data plane (--data-port names its own)")
            sock.close()

    return route


async def serve(config: AgentConfig) -> int:
    """Run the agent until SIGTERM/SIGINT (0) or until the coordinator refuses it (2)."""
    agent_id = load_or_create_id(config.state_dir)
    info = common_pb2.AgentInfo(agent_id=agent_id, host=config.advertise_host,
                                device=detect(config.device, config.flops, config.memory),
                                version=VERSION,
                                reachable=reach.OVERRIDES[config.reachable])  # type: ignore[arg-type]
    checkpoints = checkpoint_dir(config.state_dir)
    copier = CheckpointCopier(checkpoints, config.security,
                              mirror_interval_s=config.mirror_interval_s,
                              coordinator=config.coordinator)
    pushes = CheckpointPushes(checkpoints, config.security, copier, config.mirror_interval_s,
                              config.coordinator)
    service = AgentService(info, CheckpointStore(checkpoints), pushes)
    metrics = await start_metrics(config, service)

    # the one public port: gRPC, the data plane unless --data-port, a relay with --relay;
    # when neither shares it gRPC listens by itself, as before the front (no extra hop)
    front = Front() if config.data_shared or (config.relay and not config.relay_port) else None
    handoff = DataHandoff() if config.data_shared else None
    server, port, health = await rpc.start_server(config.listen, config.security,
                                                  registrar(service), f"agent {agent_id}",
                                                  front=front)
    if handoff is not None:
        await handoff.start()
    info.port = port
    info.data_port = config.data_port_for(port)
    log.info("agent %s serving on %s:%d (%s, data port %d), coordinator %s", agent_id,
             info.host, port, info.device.kind, info.data_port, config.coordinator)
    supervisor = Supervisor(Path(config.state_dir) / "work",
                            bind_interface=config.bind_interface,
                            checkpoints=copier, prewarm=config.prewarm, pushes=pushes,
                            data_handoff=handoff.name if handoff is not None else "")
    tuning = TuningCheck()
    tuning.run()  # what a measurement cannot change; the buffers wait for measured links
    session = CoordinatorSession(info, config.coordinator, config.security, supervisor,
                                 config.max_backoff_s, state_dir=config.state_dir,
                                 tuning=tuning)
    service.session = session
    pushes.identity = lambda: (agent_id, session.secret)  # proves pushes to the coordinator
    session.data_handoff = handoff
    relay_host = await start_relay(config, info, session)
    if front is not None:
        front.on_data = data_router(handoff, relay_host if relay_host and relay_host.shared
                                    else None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    session_task = asyncio.create_task(session.run())
    stop_task = asyncio.create_task(stop.wait())
    await asyncio.wait({session_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if session_task.done() and not session_task.cancelled():
        exc = session_task.exception()
        if isinstance(exc, FatalSessionError):
            log.error("%s", exc)
            code = 2
        elif exc is not None:
            raise exc
    log.info("agent %s shutting down", agent_id)
    session.stop_rejoining()
    await health.enter_graceful_shutdown()
    await supervisor.close("agent shutting down")
    await session.say_goodbye()
    await session.close_peer_channels()
    for task in (session_task, stop_task):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, FatalSessionError):
            await task
    if relay_host is not None:
        await relay_host.close()
    if front is not None:
        await front.aclose()
    if handoff is not None:
        await handoff.aclose()
    await server.stop(grace=1.0)
    if metrics is not None:
        metrics.close()
    log.info("agent %s stopped", agent_id)
    return code
