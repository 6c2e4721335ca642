"""Time the coordinator could not hear anyone is nobody's silence.

A coordinator whose event loop is held (a long status answer at 1,000 agents took 7 s on a
loaded core) leaves the heartbeats sent meanwhile unread in its sockets; the liveness sweep
that ran first after the stall took all 1,000 simulated agents for silent and marked them
lost, and the job recovered from a fault that never was (bench/scale.py). Pinned: on the
registry's clock, and on the real daemon's own sweeper over a real gRPC server, whose loop is
held past the timeout.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from coordinator.daemon.registry import ALIVE, LOST, Registry
from dtfm import rpc
from protos.dtfm.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.agent.test_checkpoint_transfer import SECURITY
from tests.coordinator.served import served, tiny_config
from tests.coordinator.test_registry import Clock

pytestmark = pytest.mark.timeout(60)
INFO = {"host": "127.0.0.1", "port": 9, "device": common_pb2.DeviceInfo(kind="cpu")}


def test_deaf_seconds_do_not_count_as_silence_but_later_silence_does() -> None:
    clock = Clock()
    registry = Registry(5.0, clock=clock)
    for name in ("a", "b"):
        registry.join(common_pb2.AgentInfo(agent_id=name, **INFO))
    clock.now += 7.0
    registry.deafened(4.0)  # 4 of those 7 s the coordinator could not hear them
    assert registry.sweep() == []
    registry.heartbeat(coordinator_pb2.ProgressReport(agent_id="b"))  # b's queued beat
    clock.now += 2.5  # a: 5.5 s silent while heard, b: 2.5 s
    lost = registry.sweep()
    assert [r.agent_id for r in lost] == ["a"] and lost[0].state == LOST
    assert "no heartbeat for 5.5 s" in lost[0].why and "not counting 4.0 s" in lost[0].why
    registry.deafened(-3.0)  # a clock that stepped back is no deafness
    assert registry.get("b").state == ALIVE  # type: ignore[union-attr]


def test_the_daemons_sweeper_counts_a_held_loop_as_nobodys_silence(tmp_path: Path) -> None:
    # One silent agent: lost 1 s after its last word while the coordinator hears; the loop
    # held 3 s right after it joined must not make that happen at once, only 1 s of heard
    # silence later.
    async def main() -> None:
        config = tiny_config(tmp_path, heartbeat_interval_s=0.1, liveness_timeout_s=1.0,
                             heartbeat_budget=0.0)
        async with served(config) as (address, svc), \
                rpc.open_channel(address, SECURITY) as channel:
            sweeper = asyncio.create_task(svc.sweep_forever())
            try:
                call = coordinator_pb2_grpc.CoordinatorStub(channel).Join(
                    coordinator_pb2.JoinRequest(agent=common_pb2.AgentInfo(
                        agent_id="a0", reachable=common_pb2.REACH_OVERRIDE_YES, **INFO)))
                await call.read()
                rec = svc.registry.get("a0")
                assert rec is not None
                await asyncio.sleep(0.2)
                time.sleep(3.0)  # the loop is held three times the timeout (a long answer)
                await asyncio.sleep(0.3)  # the sweeps that follow the stall
                assert rec.state == ALIVE, rec.why
                for _ in range(40):
                    if rec.state == LOST:
                        break
                    await asyncio.sleep(0.1)
                assert rec.state == LOST and "not counting" in rec.why, rec.why
                call.cancel()
            finally:
                sweeper.cancel()
    asyncio.run(main())
