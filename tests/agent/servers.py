"""Real gRPC services on loopback for tests: an agent's (`serving(service)` yields its
address) and a stand-in coordinator's (`coordinator_server(servicer)`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from agent.daemon.server import AgentService, registrar
from dtfm import rpc
from protos.dtfm.v1 import coordinator_pb2_grpc


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
