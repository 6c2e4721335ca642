"""How much of each gradient bucket each replica of a data-parallel group owns.

In the sharded exchange (`agent.worker.data_parallel`) the owner of a shard receives every
replica's copy of it and sends the average back: its shard's time is one-way delay in from
the farthest replica, one-way delay out to the farthest, and its bytes over its slowest links.
Equal shards (the paper's) make every owner as slow as the group's worst: one replica on
another continent puts two intercontinental delays and its thin links on every shard. Giving
each owner a share that equalises their finishing times cuts that, and a replica that is far
from everyone owns nothing: it then only sends its copies and receives the averages, one
crossing each way, overlapped across buckets.

Water-filling: owner k needs `L_k + f_k * c_k` seconds (`L_k` its delay in plus out, `c_k`
the whole gradient over its slowest link in or out, as buckets overlap the hops); the shares
`f` that finish every owner with a positive share at the same time T, and give none to an
owner whose delays alone exceed T, solve `sum_k max(0, (T - L_k) / c_k) = 1` (checked against
a brute-force search in the tests). The step model (`steptime`) replays the exchange with
these shares, and the coordinator sends them in each `Assignment.dp_shares`: both call
`group_shares`, so the plan's prediction is of what the workers do. Pure numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from coordinator.scheduler.network import Network


def group_links(net: Network, group: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The group's one-way delays (s) and seconds per byte, member x member, 0 on the
    diagonal (a replica does not send to itself)."""
    g = np.asarray(group)
    delay = net.delay_ms[g[:, None], g[None, :]] / 1000.0
    per_byte = 8.0 / (net.bandwidth_gbps[g[:, None], g[None, :]] * 1e9)
    np.fill_diagonal(delay, 0.0)
    np.fill_diagonal(per_byte, 0.0)
    return delay, per_byte


def group_shares(net: Network, group: Sequence[int], wire_bytes: float) -> list[float]:
    """Each member's share (replica order, summing to 1) of a stage's gradients of
    `wire_bytes` bytes on the wire, for the group of devices `group`."""
    r = len(group)
    if r == 1:
        return [1.0]
    delay, per_byte = group_links(net, group)
    latency = delay.max(axis=0) + delay.max(axis=1)  # in from the farthest, out to it
    cost = np.maximum(per_byte.max(axis=0), per_byte.max(axis=1)) * max(wire_bytes, 1.0)
    if not (np.isfinite(cost).all() and (cost > 0).all()):
        return [1.0 / r] * r  # an unmeasured or infinite link: the paper's equal shards
    order = np.argsort(latency, kind="stable")
    for m in range(r, 0, -1):  # the most owners whose delays alone finish before T
        idx = order[:m]
        finish = (1.0 + np.sum(latency[idx] / cost[idx])) / np.sum(1.0 / cost[idx])
        if finish > latency[idx].max() or m == 1:
            break
    shares = np.maximum(0.0, (finish - latency) / cost)
    shares[order[m:]] = 0.0
    return (shares / shares.sum()).tolist()
