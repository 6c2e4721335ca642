"""The search always ends: every loop keeps the budget (candidates and time), and small
instances are enumerated to their exact optimum instead of evolved.

No wall-clock assertions: budgets are in candidates, or time comes from an injected clock.
"""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.scheduler import CostModel, Network, plan_cost, search_plan
from coordinator.scheduler.baselines import rank_order
from coordinator.scheduler.evolutionary import (
    ENUMERATE_MAX,
    _Search,
    balanced_labelings,
    placements,
)
from tests.coordinator.scheduler.reference import (
    balanced_partitions,
    clustered_net,
    grid_cost,
    partition_cost,
    random_net,
)

DP, PP = 0.236, 0.2  # the sizes
SHAPES = [(s, n // s) for n in range(2, 13) for s in range(1, n + 1) if n % s == 0]


class TickingClock:
    """A clock that advances `step` seconds every time it is read."""

    def __init__(self, step: float) -> None:
        self.step, self.now, self.reads = step, 0.0, 0

    def __call__(self) -> float:
        self.now += self.step
        self.reads += 1
        return self.now


@pytest.mark.parametrize(("s", "r"), [(1, 4), (4, 1), (2, 2), (2, 3), (3, 2), (2, 4), (4, 2),
                                      (3, 3)])
def test_labelings_are_every_partition_once(s: int, r: int) -> None:
    labels = list(balanced_labelings(s, r))
    assert len(labels) == placements(s, r) == len(balanced_partitions(s * r, s, r))
    keys = {_Search.key(x) for x in labels}
    assert len(keys) == len(labels)  # distinct up to renaming the groups
    for x in labels:
        assert np.bincount(x, minlength=s).tolist() == [r] * s
        assert _Search.key(x) == x.astype(np.int16).tobytes()  # canonical form


def test_placement_counts() -> None:
    shapes = [(2, 2), (2, 3), (3, 2), (2, 4), (4, 2), (3, 3), (2, 6), (6, 2), (3, 4), (4, 3)]
    assert [placements(s, r) for s, r in shapes] == [3, 10, 15, 35, 105, 280, 462, 10395,
                                                     5775, 15400]
    assert placements(1, 12) == placements(12, 1) == 1


@pytest.mark.parametrize(("s", "r", "symmetric"), [(3, 3, False), (2, 4, True), (4, 2, False),
                                                   (3, 2, True)])
def test_enumeration_finds_the_brute_force_optimum(s: int, r: int, symmetric: bool) -> None:
    rng = np.random.default_rng(7 * s + r)
    delay, bw = random_net(s * r, rng, symmetric=symmetric)
    optimum = min(partition_cost(delay, bw, groups, 0.4, 0.2)
                  for groups in balanced_partitions(s * r, s, r))  # loop-based, independent
    res = search_plan(Network(delay, bw), s, r, 0.4, 0.2, seed=3)
    assert res.exhaustive and res.evaluated == res.candidates == placements(s, r)
    assert res.cost == pytest.approx(optimum, rel=1e-9)
    # the same kind of result as an evolved plan: a grid and its independently computed parts
    assert (res.stages, res.replicas, res.tsp_exact) == (s, r, True)
    assert (res.cost, res.dp_cost, res.pp_cost) == pytest.approx(
        grid_cost(delay, bw, res.grid, 0.4, 0.2), rel=1e-9)
    assert np.isfinite(res.structured_cost) and res.cost <= res.structured_cost
    assert res.history and res.history[-1][1] == pytest.approx(res.cost, rel=1e-9)
    evolved = search_plan(Network(delay, bw), s, r, 0.4, 0.2, seed=3, budget=3000,
                          enumerate_max=0)
    assert not evolved.exhaustive and evolved.cost >= res.cost - 1e-9


@pytest.mark.parametrize(("s", "r"), SHAPES)
def test_every_small_shape_returns_on_clustered_matrices(s: int, r: int) -> None:
    """Every factorization of 2 to 12 devices in 2-4 sites, enumerated or evolved, ends
    within its candidate budget with a valid grid no worse than rank order."""
    n = s * r
    delay, bw = clustered_net(n, min(n, 2 + n % 3), np.random.default_rng(n))
    net = Network(delay, bw)
    model = CostModel(net, s, r, DP, PP)
    budget, costs = 400, []
    for enumerate_max in (ENUMERATE_MAX, 0):
        res = search_plan(net, s, r, DP, PP, seed=1, budget=budget,
                          enumerate_max=enumerate_max)
        assert res.candidates <= budget and res.evaluated <= res.candidates
        assert res.exhaustive == (enumerate_max > 0 and placements(s, r) <= budget)
        assert sorted(d for row in res.grid for d in row) == list(range(n))
        assert res.cost == pytest.approx(plan_cost(net, res.grid, DP, PP)[0], rel=1e-12)
        assert res.cost <= rank_order(model).cost + 1e-9
        costs.append(res.cost)
    if placements(s, r) <= ENUMERATE_MAX:  # the default budget enumerates: nothing is better
        exact = search_plan(net, s, r, DP, PP, seed=1)
        assert exact.exhaustive and exact.candidates == placements(s, r)
        assert exact.cost <= min(costs) + 1e-9


def test_duplicate_children_count_against_the_budget() -> None:
    """On 9 devices in 3 sites nearly every child of the genetic phase duplicates a population
    member; those used to be skipped uncounted, so the budget never ran out."""
    delay, bw = clustered_net(9, 3, np.random.default_rng(0))
    net = Network(delay, bw)
    a = search_plan(net, 3, 3, DP, PP, seed=5, budget=3000, enumerate_max=0)
    assert a.candidates == 3000 and a.evaluated < a.candidates  # duplicates were counted
    b = search_plan(net, 3, 3, DP, PP, seed=5, budget=3000, enumerate_max=0)
    assert (a.grid, a.cost, a.candidates, a.evaluated) == (b.grid, b.cost, b.candidates,
                                                          b.evaluated)
    exact = search_plan(net, 3, 3, DP, PP, seed=5)  # the default: 280 placements, enumerated
    assert exact.exhaustive and exact.candidates == 280 and exact.cost <= a.cost + 1e-9


@pytest.mark.parametrize(("s", "r", "enumerate_max"), [(3, 3, 0), (4, 3, 0), (3, 3, 10_000),
                                                       (2, 6, 10_000), (6, 2, 0)])
def test_a_time_limit_ends_every_phase(s: int, r: int, enumerate_max: int) -> None:
    """With only `seconds` (as a job searches) and a clock that moves one second per read,
    the search reads it at every candidate and stops after about `seconds` of them."""
    delay, bw = clustered_net(s * r, 3, np.random.default_rng(s * r))
    clock = TickingClock(1.0)
    res = search_plan(Network(delay, bw), s, r, DP, PP, seed=0, seconds=120.0,
                      enumerate_max=enumerate_max, clock=clock)
    assert 0 < res.candidates <= 120
    assert clock.reads <= res.candidates + 10  # one read per candidate, a few around them
    assert not res.exhaustive  # 280+ placements cannot fit into 120 ticks
    assert res.cost == pytest.approx(plan_cost(Network(delay, bw), res.grid, DP, PP)[0])


def test_a_time_limit_before_the_first_candidate_still_gives_a_plan() -> None:
    delay, bw = clustered_net(8, 2, np.random.default_rng(1))
    res = search_plan(Network(delay, bw), 4, 2, DP, PP, seconds=1.0, clock=TickingClock(5.0))
    assert res.candidates == 0 and not res.exhaustive
    assert sorted(d for row in res.grid for d in row) == list(range(8))


def test_a_time_limit_enumerates_only_what_it_can_finish() -> None:
    """At one tick per candidate, 280 placements fit into 10,000 ticks but not into 150:
    then the search evolves from the seeds (their costs reused) for the whole limit."""
    delay, bw = clustered_net(9, 3, np.random.default_rng(3))
    net = Network(delay, bw)
    roomy = search_plan(net, 3, 3, DP, PP, seconds=10_000.0, clock=TickingClock(1.0))
    assert roomy.exhaustive and roomy.candidates == roomy.evaluated == 280
    tight = search_plan(net, 3, 3, DP, PP, seconds=150.0, clock=TickingClock(1.0))
    assert not tight.exhaustive and 100 < tight.candidates <= 150
    assert tight.cost >= roomy.cost - 1e-9
