"""The planner prices each relay's uplink shared by the flows that relay carries, routed as
the data plane routes them, and the data plane runs the routes the planner priced (issue 32:
"spreads relayed flows over relays").

World (as tests/coordinator/test_dataplane.py's): a0 reachable from everywhere and serving a
relay, a1-a3 behind NATs; 2 stages x 2 replicas with a0, a1 in one pipeline. Relayed flows:
the pipeline a2 <-> a3 and stage 1's data-parallel pair a1 <-> a3, two flows each.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from coordinator.daemon.config import JobConfig
from coordinator.daemon.registry import Registry
from coordinator.job.checkpoints import CheckpointTracker
from coordinator.job.dataplane import DataPlanes
from coordinator.job.epochplan import EpochPlanner
from coordinator.scheduler.network import Network
from dtfm.core.layout import Layout
from dtfm.net import reach
from protos.dtfm.v1 import common_pb2

IDS = ["a0", "a1", "a2", "a3"]
GRID = [[0, 2], [1, 3]]  # rank order = device order
LAYOUT = Layout(2, 2)


def _world(gbps: float = 1.0) -> tuple[Registry, Network, list[str]]:
    registry = Registry(liveness_timeout_s=60.0)
    for i, agent in enumerate(IDS):
        rec = registry.join(common_pb2.AgentInfo(
            agent_id=agent, host=f"10.0.0.{i}", port=7071, data_port=7072,
            relay_port=7171 if i == 0 else 0, device=common_pb2.DeviceInfo(kind="cpu")))
        rec.reach = common_pb2.ReachStatus(verdict=reach.EVERYWHERE if i == 0
                                           else reach.NOWHERE)
    delay = np.full((4, 4), 25.0)  # the dial-only pairs' relayed links (solo)
    delay[0, :] = delay[:, 0] = 10.0  # to and from the relay agent, direct
    net = Network.measured(delay, np.full((4, 4), gbps))
    relayed = [f"{a}->{b}" for a in IDS[1:] for b in IDS[1:] if a != b]
    return registry, net, relayed


def _planner(planes: DataPlanes, registry: Registry, relayed: list[str]) -> EpochPlanner:
    planner = EpochPlanner(JobConfig(), CheckpointTracker(JobConfig()),
                           planes.router(registry, None))
    planner.job_id, planner.relayed = "j", relayed
    return planner


def test_two_relays_two_flows_each_leave_each_relayed_link_half_its_rate(
        caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        planes = DataPlanes()
        await planes.start_relay("127.0.0.1", 0)
        try:
            registry, net, relayed = _world()
            planner = _planner(planes, registry, relayed)
            routes = planner.relay_routes(net, IDS, GRID, LAYOUT, None)
            # the data plane's own choice: the dp pair at the near agent, the pipeline pair
            # at the idle coordinator, the scalars-only pair at the agent
            assert routes == {("a1", "a2"): "a0", ("a1", "a3"): "a0",
                              ("a2", "a3"): reach.COORDINATOR}
            with caplog.at_level(logging.INFO, logger="coordinator.job.epochplan"):
                priced = planner.relay_priced(net, IDS, GRID, routes)
            for a, b in ((2, 3), (3, 2), (1, 3), (3, 1)):
                assert priced.bandwidth_gbps[a, b] == pytest.approx(0.5), (a, b)  # not 1/4
            assert priced.bandwidth_gbps[0, 1] == 1.0  # direct
            assert ("4 of the grid's flows go through relays: 2 at agent a0's, 2 at the "
                    "coordinator's") in caplog.text
            # the data plane runs what was priced
            records = [registry.get(a) for a in IDS]
            plane = planes.plan("j", 1, records, (net, [0, 1, 2, 3], LAYOUT, None),
                                routes=routes)
            assert plane.routes == routes and plane.plane is not None
            assert {(p.rank_a, p.rank_b): p.relay for p in plane.plane.pair_relays} == {
                (1, 2): "10.0.0.0:7171", (1, 3): "10.0.0.0:7171"}
        finally:
            await planes.close()
    asyncio.run(run())


def test_with_one_relay_every_relayed_flow_shares_its_uplink_as_before() -> None:
    registry, net, relayed = _world()
    planes = DataPlanes()  # the coordinator's relay off: relay agent a0 carries all
    planner = _planner(planes, registry, relayed)
    routes = planner.relay_routes(net, IDS, GRID, LAYOUT, None)
    assert routes is not None and set(routes.values()) == {"a0"}
    priced = planner.relay_priced(net, IDS, GRID, routes)
    np.testing.assert_array_equal(priced.bandwidth_gbps,
                                  planner.relay_priced(net, IDS, GRID).bandwidth_gbps)
    assert priced.bandwidth_gbps[2, 3] == pytest.approx(0.25)
    # without a router (routes not known) the planner prices as before too
    bare = EpochPlanner(JobConfig(), CheckpointTracker(JobConfig()))
    bare.relayed = relayed
    assert bare.relay_routes(net, IDS, GRID, LAYOUT, None) is None
    assert bare.relay_priced(net, IDS, GRID).bandwidth_gbps[2, 3] == pytest.approx(0.25)
    # a member the registry does not know: not known either
    assert _planner(planes, Registry(60.0), relayed).relay_routes(
        net, IDS, GRID, LAYOUT, None) is None


def test_the_data_plane_takes_the_planners_routes_and_chooses_itself_only_without() -> None:
    async def run() -> None:
        planes = DataPlanes()
        await planes.start_relay("127.0.0.1", 0)
        try:
            registry, net, _ = _world()
            records = [registry.get(a) for a in IDS]
            links = (net, [0, 1, 2, 3], LAYOUT, None)

            def at_agents(routes: dict[tuple[str, str], str] | None) -> set[tuple[int, int]]:
                plane = planes.plan("j", 1, records, links, routes=routes).plane
                assert plane is not None
                return {(p.rank_a, p.rank_b) for p in plane.pair_relays}

            own = at_agents(None)
            assert own == {(1, 2), (1, 3)}
            every = {("a1", "a2"): reach.COORDINATOR, ("a3", "a1"): reach.COORDINATOR,
                     ("a2", "a3"): reach.COORDINATOR}
            assert at_agents(every) == set()  # as priced, though its own choice differs
            assert at_agents({("a1", "a2"): reach.COORDINATOR}) == own  # pairs missing
            assert at_agents({**every, ("a2", "a3"): "a9"}) == own  # no such relay
        finally:
            await planes.close()
    asyncio.run(run())


def test_place_prices_the_grid_it_returns_through_the_routes_it_hands_the_data_plane() -> None:
    """`EpochPlanner.place` (rank order: a0, a2 in one pipeline): `found["routes"]` are the data
    plane's choice for the placed grid, and `found["net"]`, the prediction's links, shares
    each relay's rate among that relay's flows."""
    from coordinator.job.prediction import device_figures
    from coordinator.scheduler.compression import Compression
    from coordinator.scheduler.compute import Workload
    from coordinator.scheduler.placement import Placement
    from dtfm.core.presets import get_preset

    async def run() -> None:
        planes = DataPlanes()
        await planes.start_relay("127.0.0.1", 0)
        try:
            registry, net, relayed = _world(gbps=0.001)  # slow: a step's bytes weigh
            planner = _planner(planes, registry, relayed)
            work = Workload(get_preset("gpt-tiny"), 2, 2, 8, 2,
                            compression=Compression.for_job("none", "none"))
            records = [registry.get(a) for a in IDS]
            found = await planner.place(Placement.parse("rank-order"), net, LAYOUT, IDS, work,
                                        device_figures(records, "fp32"), [1e12] * 4)
            # rank order: pipelines a0-a2 and a1-a3, stage 1's replicas a2, a3
            assert found["grid"] == [[0, 1], [2, 3]]
            talking = {("a1", "a3"), ("a2", "a3")}  # pipeline, data-parallel
            routes = found["routes"]
            assert routes is not None and {routes[p] for p in talking} == {
                "a0", reach.COORDINATOR}, routes  # one talking pair at each relay
            for a, b in ((1, 3), (3, 1), (2, 3), (3, 2)):  # two flows per relay
                assert found["net"].bandwidth_gbps[a, b] == pytest.approx(0.001 / 2)
            assert found["net"].bandwidth_gbps[0, 2] == pytest.approx(0.001)  # direct
        finally:
            await planes.close()
    asyncio.run(run())
