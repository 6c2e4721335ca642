"""The agent's session tells its data-plane hand-off each assignment and stop as they arrive
(agent/daemon/session.py, dtfm/net/handoff.py; issue 41): a peer's connection for the epoch this
agent was just assigned waits for the worker, one for any other epoch is closed at once.

A real gRPC coordinator sends the commands on the Join stream; the supervisor's worker is
`/bin/true` (it exits at once: this is about the connections, not the training).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from agent.daemon.session import CoordinatorSession
from agent.daemon.supervisor import Supervisor
from dtfm import rpc
from dtfm.net import dataplane as dp
from dtfm.net.handoff import DataHandoff
from protos.dtfm.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.agent.servers import coordinator_server

pytestmark = pytest.mark.timeout(60)
TOKEN = "test-token-0123456789abcdef"


class Commanding(coordinator_pb2_grpc.CoordinatorServicer):
    """Welcomes the agent, then sends what the test puts in `commands`."""

    def __init__(self) -> None:
        self.commands: asyncio.Queue[coordinator_pb2.Command] = asyncio.Queue()

    async def Join(self, request: coordinator_pb2.JoinRequest,  # noqa: N802 - grpc's name
                   context: grpc.aio.ServicerContext) -> AsyncIterator[coordinator_pb2.Command]:
        yield coordinator_pb2.Command(welcome=coordinator_pb2.Welcome(
            agent_id=request.agent.agent_id, heartbeat_interval_s=30.0))
        while True:
            yield await self.commands.get()

    async def ReportProgress(self, request: coordinator_pb2.ProgressReport,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> coordinator_pb2.Ack:
        return coordinator_pb2.Ack()


def _give(handoff: DataHandoff, epoch: int) -> socket.socket:
    """Give the hand-off a connection whose hello names job-a's `epoch`; our end of it."""
    ours, theirs = socket.socketpair()
    handoff.give(theirs, dp.new_hello(dp.ROLE_DIAL, "job-a", epoch, 1))
    return ours


async def _until(cond: Callable[[], bool], what: str) -> None:
    for _ in range(200):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_session_tells_the_hand_off_its_assignment_and_its_stop(tmp_path: Path) -> None:
    async def main() -> None:
        coordinator = Commanding()
        server, port = await coordinator_server(coordinator)
        handoff = DataHandoff()
        await handoff.start()
        session = CoordinatorSession(
            common_pb2.AgentInfo(agent_id="vm-test", host="127.0.0.1", port=1),
            f"127.0.0.1:{port}", rpc.Security(token=TOKEN),
            Supervisor(tmp_path / "work", python="/bin/true", data_handoff=handoff.name),
            max_backoff_s=0.1, state_dir=str(tmp_path))
        session.data_handoff = handoff
        task = asyncio.create_task(session.run())
        try:
            await _until(lambda: session.connected, "the session to join")
            _give(handoff, 5).close()  # no assignment yet: closed at once
            assert handoff.refused == 1 and len(handoff.parking) == 0
            await coordinator.commands.put(coordinator_pb2.Command(assign=common_pb2.Assignment(
                job_id="job-a", epoch=5, world_size=2, rank=0)))
            await _until(lambda: session.supervisor.progress.epoch == 5, "the assignment")
            waiting = _give(handoff, 5)  # its epoch: waits for the worker
            _give(handoff, 4).close()  # an older one: closed at once
            assert len(handoff.parking) == 1 and handoff.refused == 2
            await coordinator.commands.put(coordinator_pb2.Command(
                stop=coordinator_pb2.StopCommand(job_id="job-a", reason="test")))
            await _until(lambda: len(handoff.parking) == 0, "the stop to end the wait")
            waiting.settimeout(5)
            assert waiting.recv(1) == b""
            assert handoff.dropped == 1
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await session.supervisor.close("test over")
            await handoff.aclose()
            await server.stop(grace=None)
    asyncio.run(main())
