"""Relayed links in the scheduler (issue 32): the relay's cost is priced, and placement avoids it.

Scenario: the paper's world, one agent per city (8 agents, 4 stages x 2 replicas), three of
them behind NATs, the coordinator (the relay) in Virginia with a 100 Mbit/s uplink. Network-
blind rank order puts the three hidden agents in one pipeline, two relayed pipeline links
(four flows through the relay); the scheduler's placement has none, and the predicted cost
and step of each grid count what its relayed flows cost.
"""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.scheduler import plan_cost, relay, search_plan
from coordinator.scheduler.network import Network
from coordinator.scheduler.placement import rank_order_grid
from coordinator.scheduler.scenarios import PAPER_DP_GB, PAPER_PP_GB, behind_nat, world
from coordinator.scheduler.steptime import StepShape, placed_step_s

HIDDEN = (2, 4, 6)  # Ohio, Seoul, Frankfurt: rank order's first pipeline is 0, 2, 4, 6
RELAY_AT = 1  # Virginia
SHAPE = StepShape(micro_batches=4, act_bytes=PAPER_PP_GB * 1e9 / 8,
                  grad_bytes=[PAPER_DP_GB * 1e9] * 4)


def _scenario() -> tuple[Network, Network, np.ndarray]:
    direct = world(per_city=1)
    net, relayed = behind_nat(direct, HIDDEN, RELAY_AT, relay_gbps=0.1)
    return direct, net, relayed


def test_relayed_links_cost_both_hops_and_the_narrower_rate() -> None:
    direct, net, relayed = _scenario()
    assert relayed.sum() == 6  # every ordered pair of the three hidden agents
    assert net.delay_ms[2, 4] == pytest.approx(direct.delay_ms[2, 1] + direct.delay_ms[1, 4])
    assert net.bandwidth_gbps[2, 4] == pytest.approx(0.1)
    assert net.delay_ms[2, 3] == direct.delay_ms[2, 3]  # one hidden end: the direct link
    shared = relay.shared(net, relayed, 4)
    assert shared.bandwidth_gbps[2, 4] == pytest.approx(0.025)
    assert shared.bandwidth_gbps[2, 3] == net.bandwidth_gbps[2, 3]


def test_relayed_flows_count_pipeline_links_both_ways_and_ring_links() -> None:
    _, _, relayed = _scenario()
    blind = rank_order_grid(4, 2)
    assert [row[0] for row in blind] == [0, 2, 4, 6]
    assert relay.relayed_flows(blind, relayed) == 4  # 2->4, 4->6 and back
    row = [[2, 4], [0, 1], [3, 5], [6, 7]]  # a data-parallel pair of hidden agents
    assert relay.relayed_flows(row, relayed) == 2  # each sends to the other


def test_the_scheduler_keeps_unreachable_agents_off_relayed_links_rank_order_uses() -> None:
    direct, net, relayed = _scenario()
    blind = rank_order_grid(4, 2)
    found = search_plan(net, stages=4, replicas=2, dp_gb=PAPER_DP_GB, pp_gb=PAPER_PP_GB,
                        seed=0).grid
    assert relay.relayed_flows(found, relayed) == 0, found
    blind_net = relay.priced_for(net, relayed, blind)
    found_net = relay.priced_for(net, relayed, found)
    assert found_net is net  # no relayed flow: nothing shared
    blind_cost = plan_cost(blind_net, blind, PAPER_DP_GB, PAPER_PP_GB)[0]
    assert plan_cost(found_net, found, PAPER_DP_GB, PAPER_PP_GB)[0] < blind_cost
    # the step model sees the relay: the blind grid's predicted step is longer than the same
    # grid's with direct links, and longer still with the uplink shared by its four flows
    solo = placed_step_s(net, blind, SHAPE)
    assert placed_step_s(blind_net, blind, SHAPE) > solo > placed_step_s(direct, blind, SHAPE)
    assert placed_step_s(found_net, found, SHAPE) < placed_step_s(blind_net, blind, SHAPE)


def test_a_bad_mask_or_relay_is_refused_with_what_to_give() -> None:
    direct, net, _ = _scenario()
    with pytest.raises(ValueError, match="one row and column per device"):
        relay.shared(net, np.zeros((3, 3), dtype=bool), 2)
    with pytest.raises(ValueError, match="devices must be in 0..7"):
        behind_nat(direct, (9,), RELAY_AT)
    assert relay.mask(["a", "b", "c"], ["a->c", "c->a", "x->a"]).tolist() == [
        [False, False, True], [False, False, False], [True, False, False]]


def test_the_job_s_planner_prices_its_grid_s_relayed_flows_by_agent_id() -> None:
    """The epoch's relayed links come by agent id (LinkMatrix.relayed); the planner re-prices
    the grid it found with the flows that grid sends through the relay."""
    from coordinator.daemon.config import JobConfig
    from coordinator.job.checkpoints import CheckpointTracker
    from coordinator.job.epochplan import EpochPlanner

    _, net, relayed = _scenario()
    ids = [f"agent-{i}" for i in range(net.size)]
    planner = EpochPlanner(JobConfig(), CheckpointTracker(JobConfig()))
    blind = rank_order_grid(4, 2)
    assert planner.relay_priced(net, ids, blind) is net  # no relayed links known: as is
    planner.relayed = [f"{ids[a]}->{ids[b]}" for a, b in np.argwhere(relayed)]
    priced = planner.relay_priced(net, ids, blind)
    assert priced.bandwidth_gbps[2, 4] == pytest.approx(net.bandwidth_gbps[2, 4] / 4)
    assert priced.bandwidth_gbps[0, 2] == net.bandwidth_gbps[0, 2]


def _all_relayed(n: int) -> tuple[Network, np.ndarray]:
    """n devices that can dial none of each other: every link relayed, 1 Gbit/s solo."""
    relayed = ~np.eye(n, dtype=bool)
    return Network.measured(np.full((n, n), 20.0), np.ones((n, n))), relayed


def test_each_relay_s_rate_is_shared_only_by_the_flows_it_carries() -> None:
    """Two relays, the grid's four relayed flows spread 2 + 2 (as the data plane spreads
    them, coordinator/scheduler/relaychoice.py): each relayed link gets 1/2 of its rate,
    not the 1/4 that taking every flow through one uplink gave."""
    _, net, relayed = _scenario()
    blind = rank_order_grid(4, 2)  # pipeline 0-2-4-6: relayed 2<->4 and 4<->6
    routes = {(2, 4): "coordinator", (6, 4): "agent-r"}  # either order of a pair
    assert relay.flows_by_relay(blind, relayed, routes) == {"coordinator": 2, "agent-r": 2}
    priced = relay.priced_for(net, relayed, blind, routes)
    for a, b in ((2, 4), (4, 2), (4, 6), (6, 4)):
        assert priced.bandwidth_gbps[a, b] == pytest.approx(net.bandwidth_gbps[a, b] / 2)
    assert priced.bandwidth_gbps[0, 2] == net.bandwidth_gbps[0, 2]  # direct: as measured
    # a relayed link no flow of the grid uses (2<->6) keeps the one-uplink share
    assert priced.bandwidth_gbps[2, 6] == pytest.approx(net.bandwidth_gbps[2, 6] / 4)
    assert relay.priced_for(net, relayed, blind).bandwidth_gbps[2, 4] == pytest.approx(
        net.bandwidth_gbps[2, 4] / 4)  # no routes: as before, one uplink for all four


def test_one_relay_prices_as_one_shared_uplink_and_a_missing_route_falls_back_to_it() -> None:
    _, net, relayed = _scenario()
    blind = rank_order_grid(4, 2)
    one = relay.priced_for(net, relayed, blind, {(2, 4): "coordinator", (4, 6): "coordinator"})
    np.testing.assert_array_equal(one.bandwidth_gbps,
                                  relay.shared(net, relayed, 4).bandwidth_gbps)
    assert relay.flows_by_relay(blind, relayed, {(2, 4): "r"}) is None  # 4<->6 not routed
    partial = relay.priced_for(net, relayed, blind, {(2, 4): "r"})
    np.testing.assert_array_equal(partial.bandwidth_gbps, one.bandwidth_gbps)


def test_a_flow_whose_relay_carries_three_flows_gets_a_third() -> None:
    """2 stages x 3 replicas of six agents nobody can dial: stage 0's ring (three flows) at
    relay a, the pipeline links (six flows, both ways) at b, stage 1's ring at c."""
    net, relayed = _all_relayed(6)
    grid = [[0, 1, 2], [3, 4, 5]]
    routes = {(0, 1): "a", (1, 2): "a", (2, 0): "a", (0, 3): "b", (1, 4): "b", (2, 5): "b",
              (3, 4): "c", (4, 5): "c", (3, 5): "c"}
    assert relay.relayed_flows(grid, relayed) == 12
    assert relay.flows_by_relay(grid, relayed, routes) == {"a": 3, "b": 6, "c": 3}
    priced = relay.priced_for(net, relayed, grid, routes)
    assert priced.bandwidth_gbps[0, 1] == pytest.approx(1 / 3)  # a ring flow: a carries 3
    assert priced.bandwidth_gbps[5, 3] == pytest.approx(1 / 3)
    assert priced.bandwidth_gbps[3, 0] == pytest.approx(1 / 6)  # a pipeline flow at b
    assert relay.priced_for(net, relayed, grid).bandwidth_gbps[0, 1] == pytest.approx(1 / 12)
