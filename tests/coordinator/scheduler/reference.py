"""Slow, loop-based reference evaluators for the scheduler tests (independent of costmodel)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np


def link(delay: np.ndarray, bw: np.ndarray, a: int, b: int, gb: float) -> float:
    return delay[a][b] / 1000.0 + 8.0 * gb / bw[a][b]


def dp_group(delay: np.ndarray, bw: np.ndarray, group: Sequence[int], dp_gb: float) -> float:
    r = len(group)
    worst = 0.0
    for d in group:
        total = 0.0
        for e in group:
            if e != d:
                total += 2.0 * (delay[d][e] / 1000.0 + 8.0 * dp_gb / (r * bw[d][e]))
        worst = max(worst, total)
    return worst


def grid_cost(
    delay: np.ndarray, bw: np.ndarray, grid: Sequence[Sequence[int]], dp_gb: float, pp_gb: float
) -> tuple[float, float, float]:
    dp = max(dp_group(delay, bw, row, dp_gb) for row in grid)
    pp = 0.0
    for j in range(len(grid) - 1):
        pp += max(link(delay, bw, grid[j][k], grid[j + 1][k], pp_gb) for k in range(len(grid[j])))
    return dp + 2 * pp, dp, pp


def bottleneck(cost: np.ndarray) -> float:
    n = cost.shape[0]
    return min(max(cost[i][p[i]] for i in range(n)) for p in itertools.permutations(range(n)))


def partition_cost(
    delay: np.ndarray,
    bw: np.ndarray,
    groups: Sequence[Sequence[int]],
    dp_gb: float,
    pp_gb: float,
) -> float:
    """Objective of a partition: DP max + 2 x best open path of bottleneck matchings."""
    s = len(groups)
    dp = max(dp_group(delay, bw, g, dp_gb) for g in groups)
    w = np.zeros((s, s))
    for a in range(s):
        for b in range(s):
            if a != b:
                m = np.array([[link(delay, bw, x, y, pp_gb) for y in groups[b]] for x in groups[a]])
                w[a][b] = bottleneck(m)
    best = min(
        sum(w[p[i]][p[i + 1]] for i in range(s - 1)) for p in itertools.permutations(range(s))
    )
    return dp + 2 * best


def balanced_partitions(n: int, s: int, r: int) -> list[list[list[int]]]:
    """Every partition of range(n) into s unordered groups of r devices."""
    out: list[list[list[int]]] = []

    def rec(rest: list[int], acc: list[list[int]]) -> None:
        if not rest:
            out.append([list(g) for g in acc])
            return
        first, others = rest[0], rest[1:]
        for combo in itertools.combinations(others, r - 1):
            group = [first, *combo]
            left = [x for x in others if x not in combo]
            rec(left, [*acc, group])

    rec(list(range(n)), [])
    return out


def random_net(
    n: int, rng: np.random.Generator, symmetric: bool = False, levels: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Random delays (ms) and bandwidths (Gbit/s); `levels` > 0 draws from few values (ties)."""
    if levels:
        delay = rng.choice(np.linspace(0, 100, levels), size=(n, n))
        bw = rng.choice(np.linspace(0.3, 10, levels), size=(n, n))
    else:
        delay = rng.uniform(0, 150, size=(n, n))
        bw = rng.uniform(0.3, 10, size=(n, n))
    if symmetric:
        delay = np.triu(delay, 1) + np.triu(delay, 1).T
        bw = np.triu(bw, 1) + np.triu(bw, 1).T
    np.fill_diagonal(delay, 0.0)
    np.fill_diagonal(bw, 1.0)
    return delay, bw


def clustered_net(
    n: int, sites: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Devices in a few sites (dealt at random): fast links inside a site, slow ones between,
    each within 5 % of its kind, so many placements cost nearly the same."""
    site = np.arange(n) % sites
    rng.shuffle(site)
    same = site[:, None] == site[None, :]
    delay = np.where(same, 0.2, 40.0) * rng.uniform(0.95, 1.05, (n, n))
    bw = np.where(same, 10.0, 0.2) * rng.uniform(0.95, 1.05, (n, n))
    np.fill_diagonal(delay, 0.0)
    np.fill_diagonal(bw, 1.0)
    return delay, bw
