"""The agent reports as often as the coordinator asks, within bounds.

The coordinator stretches the heartbeat interval as agents join (coordinator/daemon/pace.py)
and says so in each heartbeat's answer; an agent that kept its welcome's interval would go on
costing what the stretch saves. A real gRPC server answers the real session's heartbeats:
first with a longer interval (the heartbeats that follow come that far apart), then with
figures no coordinator should send (they are held within `HEARTBEAT_BOUNDS_S`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from agent.daemon.session import HEARTBEAT_BOUNDS_S, paced_interval
from protos.dtfm.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.agent.servers import coordinator_server, session_to

pytestmark = pytest.mark.timeout(60)


class PacingCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Welcomes at 0.05 s, then answers each heartbeat with the next interval of `answers`."""

    def __init__(self, answers: list[float]) -> None:
        self.answers = answers
        self.beats: list[float] = []

    async def Join(self, request: coordinator_pb2.JoinRequest,  # noqa: N802 - grpc's name
                   context: grpc.aio.ServicerContext) -> AsyncIterator[coordinator_pb2.Command]:
        yield coordinator_pb2.Command(welcome=coordinator_pb2.Welcome(
            agent_id=request.agent.agent_id, heartbeat_interval_s=0.05))
        await asyncio.Event().wait()

    async def ReportProgress(self, request: coordinator_pb2.ProgressReport,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> coordinator_pb2.Ack:
        self.beats.append(time.monotonic())
        interval = self.answers[min(len(self.beats), len(self.answers)) - 1]
        return coordinator_pb2.Ack(ok=True, heartbeat_interval_s=interval)


def test_the_session_beats_at_the_interval_each_answer_gives(tmp_path: Path) -> None:
    async def main() -> None:
        servicer = PacingCoordinator([0.05, 0.4, 0.4, 1e9, float("nan"), 0.0])
        server, port = await coordinator_server(servicer)
        session = session_to(port, tmp_path)
        task = asyncio.create_task(session.run())
        try:
            for _ in range(200):
                if len(servicer.beats) >= 4:
                    break
                await asyncio.sleep(0.05)
            beats = servicer.beats
            assert len(beats) >= 4, "the session sent fewer than 4 heartbeats in 10 s"
            # answers 2 and 3 asked for 0.4 s: the beats after them came no sooner
            assert beats[2] - beats[1] >= 0.4 and beats[3] - beats[2] >= 0.4
            for _ in range(100):  # the 4th answer (1e9 s) reaches the session after the beat
                if session.heartbeat_interval_s != 0.4:
                    break
                await asyncio.sleep(0.02)
            assert session.heartbeat_interval_s == HEARTBEAT_BOUNDS_S[1]  # 1e9 s, held
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.stop(grace=None)
    asyncio.run(main())


def test_figures_no_coordinator_should_send_are_held_within_bounds() -> None:
    low, high = HEARTBEAT_BOUNDS_S
    assert paced_interval(0.0) == low and paced_interval(-5.0) == low
    assert paced_interval(1e9) == high and paced_interval(float("inf")) == high
    assert paced_interval(float("nan")) == 1.0
    assert paced_interval(2.5) == 2.5
