"""The heartbeat interval stretches with the number of agents (coordinator/daemon/pace.py).

At a fixed 1 s interval, 1,000 agents cost the coordinator's loop 0.5-0.9 of a core in
heartbeats alone (bench/scale.py). Pinned here: the interval stays as configured until the
agents' heartbeats would pass `--heartbeat-budget` a second, then grows with their number; the
liveness timeout grows by the same seconds (a live agent at the stretched interval is never
lost, a silent one still is); and the real daemon tells agents so, in the welcome and in every
heartbeat's answer, on a real gRPC server.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from coordinator.daemon.pace import MAX_INTERVAL_S, HeartbeatPace, check_budget
from coordinator.daemon.registry import ALIVE, LOST, Registry
from dtfm import rpc
from protos.dtfm.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.agent.test_checkpoint_transfer import SECURITY
from tests.coordinator.served import served, tiny_config
from tests.coordinator.test_registry import Clock

pytestmark = pytest.mark.timeout(60)


def test_the_interval_holds_until_the_budget_then_grows_with_the_agents() -> None:
    pace = HeartbeatPace(interval_s=1.0, liveness_s=15.0, budget=200.0)
    assert pace.interval(1) == pace.interval(200) == 1.0
    assert pace.interval(1000) == pytest.approx(5.0)  # 200 heartbeats a second, not 1,000
    assert pace.interval(10**6) == MAX_INTERVAL_S
    assert pace.liveness(200) == 15.0
    assert pace.liveness(1000) == pytest.approx(19.0)  # the same 14 s of slack past a beat
    fixed = HeartbeatPace(interval_s=2.0, liveness_s=9.0, budget=0.0)
    assert fixed.interval(10**6) == 2.0 and fixed.liveness(10**6) == 9.0
    assert check_budget(0.0) == "" and check_budget(50.0) == ""
    for bad in (-1.0, float("nan"), float("inf")):
        assert "--heartbeat-budget" in check_budget(bad)


def test_a_stretched_interval_stretches_the_liveness_timeout() -> None:
    clock = Clock()
    registry = Registry(5.0, clock=clock, heartbeat_interval_s=1.0, heartbeat_budget=1.0)
    for i in range(4):  # 4 agents at 1 heartbeat a second: every 4 s each, lost after 8 s
        registry.join(common_pb2.AgentInfo(agent_id=f"a{i}", host="127.0.0.1", port=9,
                                           device=common_pb2.DeviceInfo(kind="cpu")))
    assert registry.heartbeat_interval_s == 4.0 and registry.liveness_timeout_s == 8.0
    clock.now += 7.5  # past the configured 5 s, within the stretched 8 s: still alive
    assert registry.sweep() == []
    assert {r.state for r in registry.all()} == {ALIVE}
    clock.now += 1.0
    lost = registry.sweep()
    assert len(lost) == 4 and {r.state for r in lost} == {LOST}
    assert "timeout 8.0 s" in lost[0].why


def test_the_daemon_paces_agents_in_the_welcome_and_each_heartbeats_answer(
        tmp_path: Path) -> None:
    async def main() -> None:
        config = tiny_config(tmp_path, heartbeat_interval_s=0.5, liveness_timeout_s=3.0,
                             heartbeat_budget=2.0)
        async with served(config) as (address, _), \
                rpc.open_channel(address, SECURITY) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            welcomes, calls = [], []
            for i in range(3):
                call = stub.Join(coordinator_pb2.JoinRequest(agent=common_pb2.AgentInfo(
                    agent_id=f"a{i}", host="127.0.0.1", port=9,
                    device=common_pb2.DeviceInfo(kind="cpu"),
                    reachable=common_pb2.REACH_OVERRIDE_YES)))
                welcomes.append((await call.read()).welcome)
                calls.append(call)
            # 1 agent at 2 a second: 0.5 s as configured; 3 of them: 1.5 s, lost after 4 s
            assert welcomes[0].heartbeat_interval_s == 0.5
            assert welcomes[0].liveness_timeout_s == 3.0
            assert welcomes[2].heartbeat_interval_s == 1.5
            assert welcomes[2].liveness_timeout_s == 4.0
            ack = await stub.ReportProgress(coordinator_pb2.ProgressReport(
                agent_id="a0", agent_secret=welcomes[0].agent_secret))
            assert ack.ok and ack.heartbeat_interval_s == 1.5  # the first one learns it
            for call in calls:
                call.cancel()
    asyncio.run(main())
