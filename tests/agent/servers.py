"""Real gRPC services on loopback for tests: an agent's (`serving(service)` yields its
address) and a stand-in coordinator's (`coordinator_server(servicer)`), and the real agent
session that talks to one (`session_to(port, tmp)`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from agent.daemon.server import AgentService, registrar
from agent.daemon.session import CoordinatorSession
from agent.daemon.supervisor import Supervisor
from dtfm import rpc
from protos.dtfm.v1 import common_pb2, coordinator_pb2_grpc

TOKEN = "test-token-0123456789abcdef"


@contextlib.asynccontextmanager
async def serving(service: AgentService, security: rpc.Security) -> AsyncIterator[str]:
    """`service` served on 127.0.0.1 (a free port) until the block ends; yields HOST:PORT."""
    server, port, _ = await rpc.start_server("127.0.0.1:0", security, registrar(service),
                                             f"test agent {service.info.agent_id}")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def coordinator_server(
        servicer: coordinator_pb2_grpc.CoordinatorServicer) -> tuple[grpc.aio.Server, int]:
    """`servicer` started as a coordinator on 127.0.0.1 (insecure, a free port): the server
    (the caller stops it) and its port."""
    server = grpc.aio.server()
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def session_to(port: int, tmp: Path) -> CoordinatorSession:
    """The real agent session (no worker pre-warmed, quick re-join backoff) of an agent
    `vm-test` to a stand-in coordinator on 127.0.0.1:`port`, its state in `tmp`."""
    return CoordinatorSession(
        common_pb2.AgentInfo(agent_id="vm-test", host="127.0.0.1", port=1),
        f"127.0.0.1:{port}", rpc.Security(token=TOKEN),
        Supervisor(tmp / "work", prewarm=False), max_backoff_s=0.1, state_dir=str(tmp))


async def joined_session(servicer: coordinator_pb2_grpc.CoordinatorServicer, tmp: Path
                         ) -> tuple[grpc.aio.Server, CoordinatorSession, asyncio.Task[None]]:
    """`servicer` served as a coordinator and the real session (`session_to`) running
    against it until it joined (10 s at most): the server, the session and its task (the
    caller cancels the task and stops the server)."""
    server, port = await coordinator_server(servicer)
    session = session_to(port, tmp)
    task = asyncio.create_task(session.run())
    for _ in range(200):
        if session.connected:
            break
        await asyncio.sleep(0.05)
    assert session.connected, "the session never joined"
    return server, session, task
