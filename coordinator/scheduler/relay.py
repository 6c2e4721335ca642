"""Relayed links in the cost model: a pair neither end can dial talks through a relay.

Where neither agent of a pair accepts inbound connections, their traffic goes through a
relay, the coordinator's or a relay agent's: the link costs the delay of both hops
(A -> relay -> B) and runs at the narrower hop's bandwidth (`coordinator/links/relayed.py`
prices it so from measured hops, through the cheapest relay for one flow: "solo"). But a
relay's uplink carries every relayed flow it serves at once, so each flow gets only a share
of it: a placement that puts two unreachable agents next to each other in four pipelines
pays for four flows through one uplink, one that puts each next to a reachable neighbour
(which the unreachable one dials directly) pays for none.

That share depends on the placement, which the paper's search cannot see per candidate; so
the search prices relayed links solo (they cost two hops: it already avoids them), and the
grid it finds is then priced with the share its own relayed flows leave each
(`priced_for`): the predicted step and cost say what the relays cost that placement. Which
relay each flow goes through is the data plane's choice (coordinator/job/dataplane.py,
coordinator/scheduler/relaychoice.py: relayed pairs spread over the relays, heaviest
first); given it (`routes`: device pair -> relay), each relay's rate is shared only by the
flows that relay carries (`flows_by_relay`): two relays carrying two flows each leave each
flow 1/2 of its rate, not 1/4. Without routes (no relay choice known) every relayed flow
is taken to share one uplink, which is exact where there is one relay (the common case:
the coordinator's). Pure numpy, like the rest of the scheduler.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np

from coordinator.scheduler.network import Network

Routes = Mapping[tuple[int, int], str]  # (device, device), either order -> the pair's relay


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


def grid_flows(grid: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """The (from, to) device pairs of `grid`'s flows (grid[stage][replica] = device): each
    pipeline link between consecutive stages (activations one way, gradients back: one flow
    per direction) and each data-parallel ring link (every replica of a stage sends to the
    next)."""
    g = np.asarray(grid, dtype=np.int64)
    s, r = g.shape
    flows: list[tuple[int, int]] = []
    if s > 1:
        for a, b in zip(g[:-1].ravel().tolist(), g[1:].ravel().tolist(), strict=True):
            flows += [(a, b), (b, a)]
    if r > 1:
        flows += list(zip(g.ravel().tolist(), np.roll(g, -1, axis=1).ravel().tolist(),
                          strict=True))
    return flows


def relayed_flows(grid: Sequence[Sequence[int]], relayed: np.ndarray) -> int:
    """How many flows of `grid` (`grid_flows`) go through a relay: those whose devices
    cannot dial each other."""
    return sum(1 for a, b in grid_flows(grid) if relayed[a, b])


def route_of(routes: Routes, a: int, b: int) -> str | None:
    """The relay the pair (a, b) meets at, keyed either order; None where not routed."""
    return routes.get((a, b), routes.get((b, a)))


def flows_by_relay(grid: Sequence[Sequence[int]], relayed: np.ndarray,
                   routes: Routes) -> dict[str, int] | None:
    """How many of `grid`'s relayed flows each relay carries, by `routes`; None where a
    relayed flow of the grid has no route (the relay choice is not known for this grid)."""
    counts: Counter[str] = Counter()
    for a, b in grid_flows(grid):
        if not relayed[a, b]:
            continue
        if (via := route_of(routes, a, b)) is None:
            return None
        counts[via] += 1
    return dict(counts)


def shared(net: Network, relayed: np.ndarray, flows: int) -> Network:
    """`net` with every relayed link's (solo) bandwidth divided among `flows` flows."""
    _check(net, relayed)
    if flows <= 1 or not relayed.any():
        return net
    bandwidth = np.array(net.bandwidth_gbps)
    bandwidth[relayed] = bandwidth[relayed] / flows
    return Network(net.delay_ms, bandwidth)


def shared_by_relay(net: Network, relayed: np.ndarray, routes: Routes,
                    per_relay: Mapping[str, int], total: int) -> Network:
    """`net` with each relayed link's (solo) bandwidth divided among the flows of the relay
    its pair meets at (`per_relay`, `flows_by_relay`); a relayed link not routed (no flow
    of the grid: it matters to no price of it) among all `total` flows, as `shared` does."""
    _check(net, relayed)
    bandwidth = np.array(net.bandwidth_gbps)
    for a, b in np.argwhere(relayed).tolist():
        via = route_of(routes, a, b)
        flows = per_relay.get(via, 0) if via is not None else total
        if flows > 1:
            bandwidth[a, b] = bandwidth[a, b] / flows
    return Network(net.delay_ms, bandwidth)


def _check(net: Network, relayed: np.ndarray) -> None:
    if relayed.shape != net.delay_ms.shape:
        raise ValueError(f"a relayed mask of shape {relayed.shape} for a network of "
                         f"{net.size} devices: give one row and column per device")


def priced_for(net: Network, relayed: np.ndarray | None, grid: Sequence[Sequence[int]],
               routes: Routes | None = None) -> Network:
    """`net` as `grid` sees it: each relayed link's rate shared among the flows of its
    relay (`routes`, `shared_by_relay`), or, where routes are not given or miss one of the
    grid's relayed flows, among all the grid's relayed flows (`relayed_flows`: one relay).
    Unchanged without relayed links."""
    if relayed is None or not relayed.any():
        return net
    total = relayed_flows(grid, relayed)
    if total <= 1:  # nothing shared
        return net
    per_relay = flows_by_relay(grid, relayed, routes) if routes is not None else None
    if per_relay is None:
        return shared(net, relayed, total)
    return shared_by_relay(net, relayed, routes or {}, per_relay, total)
