"""Measuring many agents quickly: bandwidth for representatives of latency clusters, the rest
inferred and marked so.

All-pairs bandwidth probing costs N(N-1) probes, minutes for 64 agents. Latency is cheap (every
agent pings every peer at once, a few hundred bytes each), and agents in one place (a city, a
data centre, a campus) see alike delays to everyone else. So a sampled measurement
(`LinkMeasurer.measure(sampled=True)`, `coordinator links --measure --sampled`) pings every
pair, groups the agents into latency clusters, measures bandwidth only for one link per ordered
pair of clusters and one each way inside every cluster of two or more (spread over the
clusters' members, so the probes run in parallel), and gives every other link the bandwidth of
its clusters' sample, recorded as an estimate whose note names the link it was inferred from.

Pure functions over delay figures; the measurer drives them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np

CLUSTER_TOL_MS = 8.0  # one-way delays within this (or CLUSTER_TOL_REL) are "alike"
CLUSTER_TOL_REL = 0.08
PROFILE_AGREE = 0.7  # the share of other agents two members of a cluster must see alike

Delay = Callable[[str, str], "float | None"]  # one-way ms from a to b; None: not known


def _alike(x: float | None, y: float | None) -> bool:  # `representatives`' one pair
    if x is None or y is None:
        return True  # nothing says they differ
    return abs(x - y) <= max(CLUSTER_TOL_MS, CLUSTER_TOL_REL * max(x, y))


def _delays(ids: Sequence[str], delay: Delay) -> np.ndarray:
    """The one-way delays between `ids` as a matrix (NaN: not known; the diagonal NaN)."""
    n = len(ids)
    out = np.full((n, n), np.nan)
    for i, a in enumerate(ids):
        for j, b in enumerate(ids):
            if i != j and (d := delay(a, b)) is not None:
                out[i, j] = d
    return out


def _alike_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """`_alike` elementwise: NaN (not known) is alike anything."""
    with np.errstate(invalid="ignore"):
        close = np.abs(x - y) <= np.maximum(CLUSTER_TOL_MS, CLUSTER_TOL_REL * np.maximum(x, y))
    return close | np.isnan(x) | np.isnan(y)


def _near(d: np.ndarray, a: int, r: int, others: np.ndarray) -> bool:
    """Whether a and r are close compared with everyone else: their one-way delay (the mean of
    both ways) within CLUSTER_TOL_MS or half the median delay from either to the others (a
    measured delay carries a few ms of processing, more on a loaded host); whether they are
    one place is for the delay profiles to say (`latency_clusters`). `others`: the indices of
    every agent but a and r."""
    there, back = d[a, r], d[r, a]
    if math.isnan(there) or math.isnan(back):
        return False
    seen = np.concatenate((d[a, others], d[r, others]))
    seen = seen[~np.isnan(seen)]
    return bool((there + back) / 2 <= max(CLUSTER_TOL_MS,
                                          0.5 * float(np.median(seen)) if seen.size else 0.0))


def _same_profile(d: np.ndarray, a: int, r: int, others: np.ndarray) -> bool:
    """Whether a and r see alike delays to and from the others: at least PROFILE_AGREE of
    them (a few noisy pings on a loaded host must not split a place)."""
    if not others.size:
        return True
    checks = _alike_rows(d[a, others], d[r, others]) & _alike_rows(d[others, a], d[others, r])
    return int(checks.sum()) >= PROFILE_AGREE * others.size


def latency_clusters(ids: Sequence[str], delay: Delay) -> list[list[str]]:
    """Agents grouped by latency, greedily in `ids` order: an agent joins the first cluster
    whose first member is near it (`_near`) and sees alike delays to and from the others
    (`_same_profile`); otherwise it starts a cluster.

    Vectorized over the others (numpy rows): each check is O(N) in C, so 1,000 agents in a
    dozen clusters cluster in well under a second, where the Python loops took minutes."""
    d = _delays(ids, delay)
    everyone = np.arange(len(ids))
    clusters: list[list[int]] = []
    for a in range(len(ids)):
        for cluster in clusters:
            r = cluster[0]
            others = everyone[(everyone != a) & (everyone != r)]
            if _near(d, a, r, others) and _same_profile(d, a, r, others):
                cluster.append(a)
                break
        else:
            clusters.append([a])
    return [[ids[i] for i in c] for c in clusters]


def sampled_links(clusters: Sequence[Sequence[str]]) -> dict[tuple[str, str], tuple[str, str]]:
    """Which directed link stands for which: {(a, b): the measured link (c, d)} for every pair
    of agents in the clusters. The sample of an ordered pair of clusters rotates over their
    members, so no agent sends or receives all of its cluster's probes."""
    of = {a: i for i, c in enumerate(clusters) for a in c}
    sample: dict[tuple[int, int], tuple[str, str]] = {}
    turn = 0
    for i, ci in enumerate(clusters):
        for j, cj in enumerate(clusters):
            if i != j:
                sample[i, j] = (ci[turn % len(ci)], cj[turn % len(cj)])
                turn += 1
            elif len(ci) >= 2:
                sample[i, i] = (ci[0], ci[1])
    out = {}
    for a in of:
        for b in of:
            if a == b:
                continue
            key = (of[a], of[b])
            if key == (of[a], of[a]) and len(clusters[of[a]]) >= 2:
                first, second = clusters[of[a]][:2]
                out[a, b] = (second, first) if (a, b) == (second, first) else (first, second)
            elif key in sample:
                out[a, b] = sample[key]
    return out


def to_measure(stands_for: dict[tuple[str, str], tuple[str, str]]) -> set[tuple[str, str]]:
    """The links whose bandwidth a sampled measurement probes."""
    return set(stands_for.values())


def representatives(links: Iterable[tuple[str, str]], clusters: Sequence[Sequence[str]],
                    delay: Delay) -> dict[tuple[str, str], tuple[str, str]]:
    """Which of `links` stands for which, for a re-measurement of just these links: those
    between the same ordered pair of latency clusters whose delays are alike share one probe
    (the first of them in sorted order, which stands for itself). A city pair that degrades
    moves every link between the two cities alike, so bench/drift.py's 8 degraded links need
    2 probes, not 8: each probe of a degraded link slows the job that is using it."""
    of = {a: i for i, c in enumerate(clusters) for a in c}
    reps: list[tuple[str, str]] = []
    out: dict[tuple[str, str], tuple[str, str]] = {}
    for a, b in sorted(links):
        out[a, b] = next((r for r in reps if (of.get(r[0]), of.get(r[1])) == (of.get(a), of.get(b))
                          and _alike(delay(a, b), delay(*r))), (a, b))
        if out[a, b] == (a, b):
            reps.append((a, b))
    return out
