"""Relayed links in the cost model: a pair neither end can dial talks through the relay.

Where neither agent of a pair accepts inbound connections, their traffic goes through the
relay the coordinator hosts: the link costs the delay of both hops (A -> relay -> B) and runs
at the narrower hop's bandwidth (`coordinator/links/relayed.py` prices it so from measured
hops, "solo"). But the relay's uplink carries every relayed flow of the job at once, so each
flow gets only a share of it: a placement that puts two unreachable agents next to each
other in four pipelines pays for four flows through one uplink, one that puts each next to a
reachable neighbour (which the unreachable one dials directly) pays for none.

That share depends on the placement, which the paper's search cannot see per candidate; so
the search prices relayed links solo (they cost two hops: it already avoids them), and the
grid it finds is then priced with the share its own relayed flows leave each
(`priced_for`): the predicted step and cost say what the relay costs that placement. Pure
numpy, like the rest of the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from coordinator.scheduler.network import Network


def mask(ids: Sequence[str], relayed: Sequence[str]) -> np.ndarray:
    """The N x N boolean mask of relayed links (row = from) from "from->to" names
    (LinkMatrix.relayed); names of agents not in `ids` are ignored."""
    index = {a: i for i, a in enumerate(ids)}
    out = np.zeros((len(ids), len(ids)), dtype=bool)
    for name in relayed:
        a, _, b = name.partition("->")
        if a in index and b in index:
            out[index[a], index[b]] = True
    return out


def relayed_flows(grid: Sequence[Sequence[int]], relayed: np.ndarray) -> int:
    """How many flows of `grid` (grid[stage][replica] = device) go through the relay: each
    pipeline link between consecutive stages (activations one way, gradients back: one
    flow per direction) and each data-parallel ring link (every replica of a stage sends
    to the next) whose devices cannot dial each other."""
    g = np.asarray(grid, dtype=np.int64)
    s, r = g.shape
    flows = 0
    if s > 1:
        a, b = g[:-1], g[1:]
        flows += int(relayed[a, b].sum() + relayed[b, a].sum())
    if r > 1:
        flows += int(relayed[g, np.roll(g, -1, axis=1)].sum())
    return flows


def shared(net: Network, relayed: np.ndarray, flows: int) -> Network:
    """`net` with every relayed link's (solo) bandwidth divided among `flows` flows."""
    if relayed.shape != net.delay_ms.shape:
        raise ValueError(f"a relayed mask of shape {relayed.shape} for a network of "
                         f"{net.size} devices: give one row and column per device")
    if flows <= 1 or not relayed.any():
        return net
    bandwidth = np.array(net.bandwidth_gbps)
    bandwidth[relayed] = bandwidth[relayed] / flows
    return Network(net.delay_ms, bandwidth)


def priced_for(net: Network, relayed: np.ndarray | None,
               grid: Sequence[Sequence[int]]) -> Network:
    """`net` as `grid` sees it: its relayed links share the relay's uplink among the
    grid's relayed flows (`relayed_flows`). Unchanged without relayed links."""
    if relayed is None or not relayed.any():
        return net
    return shared(net, relayed, relayed_flows(grid, relayed))
