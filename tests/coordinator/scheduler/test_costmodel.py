"""The cost model against a slow loop-based reference, and the paper's reference numbers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from coordinator.scheduler import CostModel, Network, comm_gb, plan_cost, scenarios
from coordinator.scheduler.costmodel import (
    _HallBottleneck,
    _HeldKarp,
    bottleneck_matching,
    tsp_heuristic,
)
from dtfm.core.presets import get_preset
from tests.coordinator.scheduler.reference import (
    bottleneck,
    grid_cost,
    partition_cost,
    random_net,
)

DP, PP = scenarios.PAPER_DP_GB, scenarios.PAPER_PP_GB


@pytest.mark.parametrize("r", [2, 3, 4, 5, 6])
def test_hall_bottleneck_equals_brute_force(r: int) -> None:
    rng = np.random.default_rng(r)
    mats = np.concatenate([rng.uniform(size=(20, r, r)), rng.integers(0, 3, size=(20, r, r))])
    got = _HallBottleneck(r)(mats.astype(float))
    for m, g in zip(mats, got, strict=True):
        ref = bottleneck(m)
        assert g == pytest.approx(ref)
        value, match = bottleneck_matching(m.astype(float))
        assert value == pytest.approx(ref)
        assert sorted(match) == list(range(r))
        assert max(m[i, match[i]] for i in range(r)) == pytest.approx(ref)


@pytest.mark.parametrize("s", [1, 2, 3, 5, 7])
def test_held_karp_equals_brute_force_and_heuristic_is_no_better(s: int) -> None:
    rng = np.random.default_rng(s)
    for _ in range(5):
        w = rng.uniform(size=(s, s))
        ref = min(
            sum(w[p[i], p[i + 1]] for i in range(s - 1)) for p in itertools.permutations(range(s))
        )
        value, path = _HeldKarp(s).solve(w, want_path=True)
        assert value == pytest.approx(ref)
        assert sorted(path) == list(range(s))
        assert sum(w[path[i], path[i + 1]] for i in range(s - 1)) == pytest.approx(ref)
        hv, hp = tsp_heuristic(w)
        assert sorted(hp) == list(range(s))
        assert hv >= ref - 1e-9


@pytest.mark.parametrize(
    ("s", "r", "symmetric"), [(3, 3, False), (4, 2, False), (2, 4, True), (3, 4, False)]
)
def test_evaluate_and_grid_match_reference(s: int, r: int, symmetric: bool) -> None:
    rng = np.random.default_rng(s * 10 + r)
    delay, bw = random_net(s * r, rng, symmetric=symmetric, levels=4 if symmetric else 0)
    net = Network(delay, bw)
    model = CostModel(net, s, r, 0.3, 0.2)
    for _ in range(4):
        labels = rng.permutation(np.repeat(np.arange(s), r))
        groups = [np.flatnonzero(labels == g).tolist() for g in range(s)]
        ref = partition_cost(delay, bw, groups, 0.3, 0.2)
        assert model.evaluate(labels) == pytest.approx(ref, rel=1e-9)
        grid = model.grid(labels)
        assert sorted(sorted(row) for row in grid) == sorted(groups)
        # the grid realizes the partition's optimum: its own cost equals the objective
        assert grid_cost(delay, bw, grid, 0.3, 0.2)[0] == pytest.approx(ref, rel=1e-9)
        assert plan_cost(net, grid, 0.3, 0.2) == pytest.approx(
            grid_cost(delay, bw, grid, 0.3, 0.2), rel=1e-12
        )


def test_plan_cost_of_any_grid_matches_reference() -> None:
    rng = np.random.default_rng(7)
    delay, bw = random_net(12, rng)
    net = Network(delay, bw)
    for s, r in ((3, 4), (4, 3), (12, 1), (1, 12)):
        grid = rng.permutation(12).reshape(s, r).tolist()
        assert plan_cost(net, grid, 0.5, 0.1) == pytest.approx(
            grid_cost(delay, bw, grid, 0.5, 0.1), rel=1e-12
        )
    with pytest.raises(ValueError, match="exactly once"):
        plan_cost(net, [[0, 1, 2], [3, 4, 4]], 0.5, 0.1)


RANK_ORDER = {"dc-ondemand": 16.97, "multi-dc": 17.64, "regional": 39.96, "world": 75.26}
STRUCTURED = {"dc-ondemand": 3.44, "multi-dc": 16.08, "regional": 34.79, "world": 49.20}


@pytest.mark.parametrize("name", sorted(RANK_ORDER))
def test_paper_rank_order_and_structured_costs(name: str) -> None:
    net = scenarios.get_scenario(name)
    rank = np.arange(64).reshape(8, 8).tolist()
    assert plan_cost(net, rank, DP, PP)[0] == pytest.approx(RANK_ORDER[name], abs=0.01)
    # each pipeline inside one block of 8 consecutive devices, each group one per block
    structured = np.arange(64).reshape(8, 8).T.tolist()
    assert plan_cost(net, structured, DP, PP)[0] == pytest.approx(STRUCTURED[name], abs=0.01)


def test_world_parts_match_paper() -> None:
    structured = np.arange(64).reshape(8, 8).T.tolist()
    cost, dp, pp = plan_cost(scenarios.world(), structured, DP, PP)
    assert dp == pytest.approx(22.76, abs=0.01)
    assert 2 * pp == pytest.approx(26.45, abs=0.01)


def test_scenarios_shape_and_symmetry() -> None:
    for name in scenarios.SCENARIOS:
        net = scenarios.get_scenario(name)
        assert net.size == 64
        assert np.array_equal(net.delay_ms, net.delay_ms.T)
        assert np.array_equal(net.bandwidth_gbps, net.bandwidth_gbps.T)
    big = scenarios.world(32)
    assert big.size == 256
    assert big.bandwidth_gbps[0, 31] == 2.0 and big.delay_ms[0, 32] == 67.0


def test_comm_gb_from_preset() -> None:
    spec = get_preset("gpt-1.3b")
    dp, pp = comm_gb(spec, 8, 8, global_batch=512, dtype="fp16")
    first = spec.stage_params(0, 3)
    last = spec.stage_params(21, 24)
    assert dp == pytest.approx(max(first, last) * 2 / 1e9)
    assert pp == pytest.approx(64 * 2048 * 2048 * 2 / 1e9)
    dp32, _ = comm_gb(spec, 8, 8, global_batch=512, dtype="fp32")
    assert dp32 == pytest.approx(2 * dp)
    with pytest.raises(ValueError, match="at most|or fewer"):
        comm_gb(spec, 25, 1, global_batch=8)


@pytest.mark.parametrize(
    ("delay", "bw", "match"),
    [
        ([[0, 1, 2], [1, 0, 1]], [[0, 1, 1], [1, 0, 1]], "square"),
        ([[0, 1], [1, 0]], [[0, 1, 1], [1, 0, 1], [1, 1, 0]], "bandwidth_gbps is 3x3"),
        ([[0, 1], [1, 0]], [[0, 0], [1, 0]], "positive"),
        ([[0, 1], [1, 0]], [[0, -2], [1, 0]], "positive"),
        ([[0, 1], [1, 0]], [[0, float("nan")], [1, 0]], "positive"),
        ([[0, -1], [1, 0]], [[0, 1], [1, 0]], "delay"),
    ],
)
def test_network_rejects_bad_matrices(delay: list, bw: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Network(np.array(delay, dtype=float), np.array(bw, dtype=float))


def test_cost_model_rejects_wrong_shape() -> None:
    with pytest.raises(ValueError, match="stages x"):
        CostModel(scenarios.world(), 8, 7, DP, PP)
