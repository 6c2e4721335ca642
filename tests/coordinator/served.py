"""The daemon's own `CoordinatorService`, served on a real gRPC server on loopback (the test
token required), for tests that drive it with real calls in-process."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from coordinator.daemon.config import CoordinatorConfig, JobConfig
from coordinator.daemon.server import CoordinatorService
from dtfm import rpc
from protos.dtfm.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.agent.test_checkpoint_transfer import SECURITY


@contextlib.asynccontextmanager
async def served(config: CoordinatorConfig) -> AsyncIterator[tuple[str, CoordinatorService]]:
    """A service of `config` served until the block ends; yields (HOST:PORT, the service)."""
    svc = CoordinatorService(config)

    def register(server: grpc.aio.Server) -> list[str]:
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(svc, server)
        return [coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name]

    server, port, _ = await rpc.start_server("127.0.0.1:0", config.security, register, "test")
    try:
        yield f"127.0.0.1:{port}", svc
    finally:
        await server.stop(0)


def tiny_config(state: Path, agents: int = 8, **fields: Any) -> CoordinatorConfig:
    """The test token, a state directory, a gpt-tiny job of `agents` (not started), and
    `fields` of `CoordinatorConfig`."""
    return CoordinatorConfig(security=SECURITY, state_dir=str(state),
                             job=JobConfig(model="gpt-tiny", agents=agents), **fields)


async def stop_driving(svc: CoordinatorService) -> None:
    """Cancel the drivers of the service's running jobs (started by `start_what_fits`, in a
    test that runs no scheduler) and wait for them to end."""
    drivers = [run.driving for run in svc.runs.values() if run.driving is not None]
    assert len(drivers) == len(svc.runs)  # every one was launched
    for driving in drivers:
        driving.cancel()
    await asyncio.gather(*drivers, return_exceptions=True)
