"""Baselines scored by the same cost model as the search, so comparisons are like for like.

- `rank_order`: a network-blind launcher's placement (as Megatron does it): devices in their
  given order, stage-major, stage j = devices j*R .. j*R+R-1 and pipeline k takes the k-th
  device of each stage. Its cost is `plan_cost` of exactly that grid: no reordering, no
  matching.
- `random_best`: the best of K uniformly random balanced allocations, each scored like a
  search candidate (its groups ordered by the TSP and matched), as the paper does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from coordinator.scheduler.costmodel import CostModel, plan_cost


@dataclass(frozen=True)
class Baseline:
    name: str
    cost: float
    dp_cost: float
    pp_cost: float
    grid: list[list[int]]


def rank_order(model: CostModel) -> Baseline:
    s, r = model.stages, model.replicas
    grid = np.arange(s * r).reshape(s, r).tolist()
    cost, dp, pp = plan_cost(model.net, grid, model.dp_gb, model.pp_gb)
    return Baseline("rank_order", cost, dp, pp, grid)


def random_best(model: CostModel, k: int, rng: np.random.Generator) -> Baseline:
    """Best of `k` random balanced allocations."""
    base = model.rank_order_labels()
    best_labels, best = base, np.inf
    for _ in range(max(1, k)):
        labels = rng.permutation(base)
        c = model.evaluate(labels)
        if c < best:
            best, best_labels = c, labels
    grid = model.grid(best_labels)
    cost, dp, pp = plan_cost(model.net, grid, model.dp_gb, model.pp_gb)
    return Baseline("random", cost, dp, pp, grid)
