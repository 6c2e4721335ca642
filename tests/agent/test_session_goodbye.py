"""An agent that stops says goodbye, so the coordinator marks it left, not lost.

Stop 58's CI saw an agent exit 0 on SIGTERM while the coordinator never marked it left. Two
ways the goodbye was lost are pinned here against a real gRPC server:
- a command that reached the session after the stop began ended the session's stream and
  closed its channel, and the goodbye, which waited on that channel, was skipped;
- a heartbeat still in flight could land after the goodbye and mark the agent alive again.
A coordinator that answers the goodbye UNAVAILABLE once gets it again; one that refuses it, or
has stopped, is not asked for ever (the agent's shutdown waits on it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from agent.daemon import session as session_module
from agent.daemon.session import CoordinatorSession, send_goodbye
from protos.dtfm.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.agent.servers import coordinator_server, joined_session

pytestmark = pytest.mark.timeout(60)


class LeavingCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Welcomes, then sends a `reach` command whenever `push` is set; heartbeats take
    `beat_s` to answer; the first `busy` goodbyes are answered UNAVAILABLE. `calls` is the
    order in which calls finished (a goodbye says whether a heartbeat was still pending: in
    the real coordinator that heartbeat, taken after the goodbye, marks the agent alive)."""

    def __init__(self, beat_s: float = 0.0, busy: int = 0) -> None:
        self.push = asyncio.Event()
        self.beat_s, self.busy = beat_s, busy
        self.beat_started = asyncio.Event()
        self.calls: list[str] = []
        self.beating = 0  # heartbeats not yet answered

    async def Join(self, request: coordinator_pb2.JoinRequest,  # noqa: N802 - grpc's name
                   context: grpc.aio.ServicerContext) -> AsyncIterator[coordinator_pb2.Command]:
        yield coordinator_pb2.Command(welcome=coordinator_pb2.Welcome(
            agent_id=request.agent.agent_id, heartbeat_interval_s=0.05))
        await self.push.wait()
        yield coordinator_pb2.Command(reach=coordinator_pb2.Command().reach)
        await asyncio.Event().wait()

    async def ReportProgress(self, request: coordinator_pb2.ProgressReport,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> coordinator_pb2.Ack:
        self.beat_started.set()
        self.beating += 1
        await asyncio.sleep(self.beat_s)
        self.beating -= 1
        self.calls.append("beat")
        return coordinator_pb2.Ack(ok=True, heartbeat_interval_s=0.05)

    async def Leave(self, request: coordinator_pb2.LeaveRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> coordinator_pb2.Ack:
        if self.busy > 0:
            self.busy -= 1
            self.calls.append("busy")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "busy")
        self.calls.append("leave" if not self.beating else "leave while a heartbeat is pending")
        return coordinator_pb2.Ack(ok=True)


Body = Callable[[LeavingCoordinator, CoordinatorSession, "asyncio.Task[None]"], Awaitable[None]]


def run_joined(servicer: LeavingCoordinator, tmp: Path, body: Body) -> None:
    """`body` beside a session joined to `servicer`; then the session and server stop."""
    async def main() -> None:
        server, session, task = await joined_session(servicer, tmp)
        try:
            await body(servicer, session, task)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.stop(grace=None)
    asyncio.run(main())


def test_a_command_after_the_stop_began_does_not_lose_the_goodbye(tmp_path: Path) -> None:
    async def body(servicer: LeavingCoordinator, session: CoordinatorSession,
                   task: asyncio.Task[None]) -> None:
        session.stop_rejoining()
        servicer.push.set()  # the command ends the session's stream and channel
        await asyncio.wait_for(task, 10)
        assert not session.connected
        await session.say_goodbye()
        assert servicer.calls[-1] == "leave", servicer.calls
    run_joined(LeavingCoordinator(), tmp_path, body)


def test_the_goodbye_lands_after_a_heartbeat_in_flight(tmp_path: Path) -> None:
    async def body(servicer: LeavingCoordinator, session: CoordinatorSession,
                   task: asyncio.Task[None]) -> None:
        servicer.beat_started.clear()
        await asyncio.wait_for(servicer.beat_started.wait(), 10)  # one is in flight now
        await session.say_goodbye()
        assert servicer.calls[-2:] == ["beat", "leave"], servicer.calls
        await asyncio.sleep(0.7)  # no heartbeat follows the goodbye
        assert servicer.calls[-1] == "leave", servicer.calls
    run_joined(LeavingCoordinator(beat_s=0.5), tmp_path, body)


def test_a_busy_coordinator_gets_the_goodbye_again(tmp_path: Path) -> None:
    async def body(servicer: LeavingCoordinator, session: CoordinatorSession,
                   task: asyncio.Task[None]) -> None:
        await session.say_goodbye()
        assert [c for c in servicer.calls if c != "beat"] == ["busy", "leave"]
    run_joined(LeavingCoordinator(busy=1), tmp_path, body)


class RefusingCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, slow_s: float = 0.0) -> None:
        self.leaves, self.slow_s = 0, slow_s

    async def Leave(self, request: coordinator_pb2.LeaveRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> coordinator_pb2.Ack:
        self.leaves += 1
        if self.slow_s:  # too slow for the agent's try, every time
            await asyncio.sleep(self.slow_s)
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "agent has not joined")
        return coordinator_pb2.Ack()


async def goodbye_to(servicer: RefusingCoordinator, budget_s: float) -> str:
    """`send_goodbye` to `servicer`, served for it; what it returned."""
    server, port = await coordinator_server(servicer)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return await send_goodbye(coordinator_pb2_grpc.CoordinatorStub(channel),
                                      coordinator_pb2.LeaveRequest(agent_id="vm-test"),
                                      budget_s=budget_s)
    finally:
        await server.stop(grace=None)


def test_a_refused_goodbye_is_not_repeated_and_says_why() -> None:
    servicer = RefusingCoordinator()
    problem = asyncio.run(goodbye_to(servicer, 5.0))
    assert servicer.leaves == 1
    assert "FAILED_PRECONDITION" in problem and "has not joined" in problem


def test_a_slow_coordinator_is_asked_again_within_the_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session_module, "GOODBYE_TRY_S", 0.3)

    servicer = RefusingCoordinator(slow_s=1.0)
    problem = asyncio.run(goodbye_to(servicer, 1.5))
    assert servicer.leaves >= 3 and "DEADLINE_EXCEEDED" in problem, (servicer.leaves, problem)


def test_a_goodbye_to_nobody_ends_within_its_budget() -> None:
    async def main() -> None:
        async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:
            loop = asyncio.get_running_loop()
            began = loop.time()
            problem = await send_goodbye(coordinator_pb2_grpc.CoordinatorStub(channel),
                                         coordinator_pb2.LeaveRequest(agent_id="vm-test"),
                                         budget_s=5.0)
            assert loop.time() - began < 1.0  # refused at once: one more try, then done
            assert "UNAVAILABLE" in problem or "DEADLINE_EXCEEDED" in problem, problem
    asyncio.run(main())
