"""The agent's coordinator session ends when its task is cancelled, whatever it was awaiting.

Issue 11's defect was an agent that, given SIGTERM together with its coordinator, logged
"shutting down" and then re-joined and retried for ever: a cancellation that grpc delivers as a
CANCELLED `AioRpcError` was taken for a lost coordinator. This does not reproduce that race
(grpc delivered a plain CancelledError in both orders tried here, with or without the fix);
it pins the contract the fix keeps: a real gRPC server welcomes the agent and holds the stream,
the session task is cancelled while it reads (alone, or with the server's shutdown racing
it), and the session ends at once without joining again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from protos.dtfm.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.agent.servers import joined_session

pytestmark = pytest.mark.timeout(60)


class HoldingCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Welcomes every joiner, then sends nothing more (a coordinator about to die)."""

    def __init__(self) -> None:
        self.joins = 0

    async def Join(self, request: coordinator_pb2.JoinRequest,  # noqa: N802 - grpc's name
                   context: grpc.aio.ServicerContext) -> AsyncIterator[coordinator_pb2.Command]:
        self.joins += 1
        yield coordinator_pb2.Command(welcome=coordinator_pb2.Welcome(
            agent_id=request.agent.agent_id, heartbeat_interval_s=30.0))
        await asyncio.Event().wait()


@pytest.mark.parametrize("server_stops_first", [False, True])
def test_a_cancelled_session_ends_instead_of_rejoining(tmp_path: Path,
                                                       server_stops_first: bool) -> None:
    async def main() -> None:
        servicer = HoldingCoordinator()
        server, _, task = await joined_session(servicer, tmp_path)
        if server_stops_first:  # SIGTERM to both: the coordinator's side goes first
            stopping = asyncio.create_task(server.stop(grace=None))
            await asyncio.sleep(0)
            task.cancel()
            await stopping
        else:
            task.cancel()
        done, _ = await asyncio.wait({task}, timeout=10)
        await server.stop(grace=None)
        assert done, "the cancelled session kept running (re-joining) for 10 s"
        assert task.cancelled(), task.exception()
        assert servicer.joins == 1
    asyncio.run(main())
