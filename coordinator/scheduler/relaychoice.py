"""Which relay each pair of ranks that both only dial meets at (issue 32: relays chosen by
measured links, relayed flows spread over relays).

Two ranks that neither accept connections meet at a relay: the coordinator's, or a relay
agent of the job (a member found reachable from everywhere, `agent start --relay-port`).
Each candidate gives the pair a path: the delay of both hops (A -> relay -> B) and the
narrower hop's bandwidth. A relay's uplink is shared by every flow it carries, so a pair's
cost at a relay already carrying k flows is

    delay(A -> relay) + delay(relay -> B) + bytes / (narrower hop's rate / (k + 1))

and pairs choose greedily, heaviest first, each taking the cheapest relay given the flows
already placed: two equal relays split the flows, a relay far from both ends is avoided.
Greedy rather than optimal: the pairs are few (a grid's neighbours), and a relay's cost only
grows with its flows, so one pass already spreads them. Pure: the caller gives the paths.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Pair = tuple[int, int]  # (rank_a, rank_b), rank_a < rank_b
NOMINAL_BYTES = 64e6  # one talking pair's bytes per step, where no grid says (a link's price)


@dataclass(frozen=True)
class Path:
    """A pair's path through one relay: both hops' delay, the narrower hop's rate."""

    delay_ms: float
    gbps: float


def cost_s(path: Path, nbytes: float, flows: int) -> float:
    """Seconds to move `nbytes` over `path` when the relay already carries `flows` flows;
    inf for a path with no rate or no finite delay (not measured, or unreachable)."""
    if not (path.gbps > 0 and math.isfinite(path.delay_ms) and math.isfinite(path.gbps)):
        return math.inf
    return path.delay_ms / 1e3 + nbytes * 8 * (flows + 1) / (path.gbps * 1e9)


def choose(pairs: Mapping[Pair, float], paths: Mapping[tuple[Pair, str], Path],
           relays: Sequence[str]) -> dict[Pair, str]:
    """Each pair's relay (an entry of `relays`). `pairs` maps a pair to the bytes it moves
    (per step, or any common unit); `paths[(pair, relay)]` is the pair's path through that
    relay (missing: the relay cannot serve the pair). Ties go to the relay carrying fewer
    flows, then to the earlier in `relays`. A pair no relay has a finite path for gets none
    (absent from the result): the caller falls back to its default."""
    flows = dict.fromkeys(relays, 0)
    chosen: dict[Pair, str] = {}
    for pair in sorted(pairs, key=lambda p: (-pairs[p], p)):
        best, best_key = None, (math.inf, 0, 0)
        for i, relay in enumerate(relays):
            path = paths.get((pair, relay))
            if path is None:
                continue
            key = (cost_s(path, pairs[pair], flows[relay]), flows[relay], i)
            if key < best_key:
                best, best_key = relay, key
        if best is not None and math.isfinite(best_key[0]):
            chosen[pair] = best
            flows[best] += 1
    return chosen
