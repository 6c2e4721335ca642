"""Structured candidates derived from the link matrix, to seed the search.

PAPER.md's finding: in every paper scenario the published cost is reached by "each pipeline
inside one block of nearby devices, each data-parallel group one device from every block",
and other block shapes (groups of 2 devices from 4 blocks, 4 from 2) come close. Such answers
are far apart in swap distance from random starts, so the search is seeded with them. This
module owns finding them from the matrix alone (no scenario knowledge): an average-linkage
clustering of the symmetrized link cost gives a device order in which nearby devices are
consecutive; cutting that order into blocks and dealing each block's devices to groups gives
one candidate per factorization `replicas = C * m`, `stages = Q * P`.
"""

from __future__ import annotations

import numpy as np


def cluster_order(cost: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
    """Leaf order of an average-linkage clustering of a (symmetrized) cost matrix.

    With `rng`, each merge puts its two halves in random order: another order consistent with
    the same hierarchy (a different pairing of blocks into super-blocks).
    """
    n = cost.shape[0]
    d = (cost + cost.T) / 2.0
    d = d.astype(np.float64, copy=True)
    np.fill_diagonal(d, np.inf)
    members: list[list[int]] = [[i] for i in range(n)]
    size = np.ones(n)
    for _ in range(n - 1):
        k = int(d.argmin())
        i, j = divmod(k, n)
        if i > j:
            i, j = j, i
        merged = (size[i] * d[i] + size[j] * d[j]) / (size[i] + size[j])
        d[i, :] = merged
        d[:, i] = merged
        d[i, i] = np.inf
        d[j, :] = np.inf
        d[:, j] = np.inf
        a, b = members[i], members[j]
        if rng is not None and rng.random() < 0.5:
            a, b = b, a
        members[i] = a + b
        members[j] = []
        size[i] += size[j]
    for m in members:
        if m:
            return np.asarray(m, dtype=np.int64)
    return np.arange(n)


def factorizations(stages: int, replicas: int) -> list[tuple[int, int, int, int]]:
    """All (Q, C, P, m) with C * m = replicas and Q * P = stages."""
    out = []
    for m in range(1, replicas + 1):
        if replicas % m:
            continue
        for p in range(1, stages + 1):
            if stages % p:
                continue
            out.append((stages // p, replicas // m, p, m))
    return out


def deal(
    order: np.ndarray, stages: int, replicas: int, shape: tuple[int, int, int, int]
) -> np.ndarray:
    """Labels (device -> group) from a device order and a block shape (Q, C, P, m).

    The order is cut into Q super-blocks of C blocks of P*m consecutive devices; group
    (q, p) takes m devices from each block of super-block q. With m = 1 and P = stages, each
    block of `stages` devices becomes one pipeline and each group takes one device per block.
    """
    q, c, p, m = shape
    arr = order.reshape(q, c, p, m)
    label = (np.arange(q)[:, None, None, None] * p + np.arange(p)[None, None, :, None])
    label = np.broadcast_to(label, arr.shape)
    labels = np.empty(stages * replicas, dtype=np.int64)
    labels[arr.ravel()] = label.ravel()
    return labels


def structured_candidates(
    cost: np.ndarray, stages: int, replicas: int, rng: np.random.Generator, orders: int = 3
) -> list[np.ndarray]:
    """Labels for every block shape on the clustering order and `orders - 1` random variants."""
    seqs = [cluster_order(cost)] + [cluster_order(cost, rng) for _ in range(max(0, orders - 1))]
    out = []
    for seq in seqs:
        for shape in factorizations(stages, replicas):
            out.append(deal(seq, stages, replicas, shape))
    return out
