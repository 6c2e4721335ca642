"""An agent's real gRPC service on loopback for tests: `serving(service)` yields its address."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from agent.server import AgentService, registrar
from dtfm import rpc


@contextlib.asynccontextmanager
async def serving(service: AgentService, security: rpc.Security) -> AsyncIterator[str]:
    """`service` served on 127.0.0.1 (a free port) until the block ends; yields HOST:PORT."""
    server, port, _ = await rpc.start_server("127.0.0.1:0", security, registrar(service),
                                             f"test agent {service.info.agent_id}")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)
