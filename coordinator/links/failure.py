"""A link that fails between two live agents: what a peer error blames, and planning around it.

An agent cut off from everyone is left out of the plan (`LinkStore.unreachable_agents`), and the
job waits for another or shrinks. A single dead link between two agents that reach the
coordinator and every other agent (a route failure between two networks, a firewall between
two sites) is another matter: leaving one of them out stalls a job that has exactly the agents
it needs, and re-using the old placement fails the same way on every restart. So:

- a recovery that follows peer errors re-measures the links the failed workers use
  (`blamed_links`): a latency sweep of every member pair finds a link that carries nothing
  (its pings time out), and the bandwidth of the blamed links finds one that slowed to a crawl;
- failed links are split (`partition`) into agents to leave out (those whose failed links reach
  more than a few of their peers: they, not the links, are broken) and dead links between
  agents that are otherwise fine;
- a dead link is priced as unusable (`priced`: a delay and a rate no plan can afford), so the
  scheduler never puts traffic on it where any other placement exists, and a grid is checked
  against every connection its workers really open (`connected_pairs`: each rank's whole
  pipeline and data-parallel group, and rank 0's rendezvous store), not only those the cost
  model prices; one that still crosses a dead link is repaired by swaps (`avoid`) or, where no
  swap helps, the job falls back to leaving an end of the link out (`LinkStore`'s `blame`).

Pure functions on ids and grids: no grpc, no torch, no state of the job's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np

from dtfm.core.workerstate import WorkerState
from protos.dtfm.v1 import coordinator_pb2

# What a dead link costs in a plan: 1000 s one way and 1 bit/s. Finite, so the cost model,
# the search and the step model compare plans as usual (an infinity turns differences into
# NaN), and far beyond any real link, so a plan that can avoid it always does.
DEAD_DELAY_MS = 1e6
DEAD_GBPS = 1e-9
T = TypeVar("T")
Link = tuple[str, str]


class _Entry(Protocol):
    reachable: bool


class _Links(Protocol):
    entries: Mapping[tuple[str, str], _Entry]


@dataclass(frozen=True)
class LinkFailures:
    """The failed links among a job's agents, sorted into what to do about them."""

    leave_out: list[str] = field(default_factory=list)  # agents broken, not their links
    dead: set[frozenset[str]] = field(default_factory=set)  # pairs to plan around
    # the directed links reported failed among `dead`: (a, b) is a's report
    reports: frozenset[Link] = frozenset()

    def reported_way(self, a: str, b: str) -> Link:
        """The dead pair a-b as the one directed link to blame it by (`store.blame`): the
        direction its only reporter reported, so a tie is never resolved against the end
        that did not report it; where both ends (or neither) reported it, (b, a) for
        `a` before `b` in the job's order, whose tie blames the later end, as always."""
        ways = [w for w in ((a, b), (b, a)) if w in self.reports]
        return ways[0] if len(ways) == 1 else (b, a)

    def indices(self, ids: Sequence[str]) -> set[frozenset[int]]:
        """The dead pairs as indices into `ids` (those with both ends in it)."""
        index = {a: i for i, a in enumerate(ids)}
        return {frozenset(index[a] for a in pair) for pair in self.dead
                if all(a in index for a in pair)}


def connected_pairs(grid: Sequence[Sequence[T]]) -> set[frozenset[T]]:
    """Every pair of devices whose workers open a connection under `grid` (grid[stage][replica]):
    a replica's whole pipeline (its ranks share one pipeline group, a full mesh in gloo), a
    stage's data-parallel group, and every rank with rank 0 (grid[0][0]), whose host holds
    the rendezvous store."""
    pairs: set[frozenset[T]] = set()
    columns = [list(col) for col in zip(*grid, strict=True)]
    for group in [*map(list, grid), *columns]:
        pairs.update(frozenset(p) for p in itertools.combinations(group, 2))
    first = grid[0][0]
    pairs.update(frozenset((first, d)) for row in grid for d in row if d != first)
    return pairs


def peer_failed(progress: Mapping[str, coordinator_pb2.ProgressReport]) -> list[str]:
    """The members whose newest report is a worker failed on a peer (kind `peer`)."""
    return [agent for agent, report in progress.items()
            if WorkerState.from_wire(report.worker_state) is WorkerState.FAILED
            and report.error_kind == "peer"]


def blamed_links(grid_ids: Sequence[Sequence[str]], failed: Iterable[str]) -> set[Link]:
    """The directed links, both ways, between each failed agent and the agents its worker was
    connected to under `grid_ids`: the links its peer error may stand for."""
    failed = set(failed)
    out: set[Link] = set()
    for pair in connected_pairs(grid_ids) if grid_ids else ():
        a, b = tuple(pair)
        if a in failed or b in failed:
            out.update({(a, b), (b, a)})
    return out


def failed_links(links: _Links, ids: Sequence[str]) -> list[Link]:
    """The directed links between `ids` whose last measurement failed."""
    members = set(ids)
    return [(a, b) for (a, b), e in links.entries.items()
            if not e.reachable and a in members and b in members]


def tolerated(agents: int) -> int:
    """How many peers an agent may fail to reach before it, not its links, is taken for
    broken: a third of them, at least one (a host with a wrong --advertise reaches none)."""
    return max(1, (agents - 1) // 3)


def partition(ids: Sequence[str], failed: Iterable[Link]) -> LinkFailures:
    """Sort failed links into agents to leave out and dead links to plan around.

    The agent that fails to reach the most peers is left out while that is more than
    `tolerated` peers; the failed links that remain lie between agents that reach (nearly)
    everyone else: dead links, each as the pair of its ends, whichever way failed."""
    failed = [link for link in failed if link[0] != link[1]]
    pairs = {frozenset(link) for link in failed}
    out: list[str] = []
    while pairs:
        counts: dict[str, int] = {}
        for pair in pairs:
            for a in pair:
                counts[a] = counts.get(a, 0) + 1
        # a tie goes against the end that reported more of its links failed, never against
        # one that did not report them (issue 43: a faked dead link)
        worst = max(counts, key=lambda a: (counts[a], sum(x == a for x, y in failed
                                                          if frozenset((x, y)) in pairs),
                                           -list(ids).index(a)))
        if counts[worst] <= tolerated(len(ids)):
            break
        out.append(worst)
        pairs = {p for p in pairs if worst not in p}
    return LinkFailures(leave_out=[a for a in ids if a in out], dead=pairs,
                        reports=frozenset(w for w in failed if frozenset(w) in pairs))


def priced(delay_ms: np.ndarray, bandwidth_gbps: np.ndarray, ids: Sequence[str],
           dead: Iterable[frozenset[str]]) -> tuple[np.ndarray, np.ndarray]:
    """Copies of the matrices (rows and columns in `ids` order) with each dead pair, both ways,
    at DEAD_DELAY_MS and DEAD_GBPS: a price no plan that can avoid the link pays."""
    delay, bandwidth = np.array(delay_ms, dtype=float), np.array(bandwidth_gbps, dtype=float)
    index = {a: i for i, a in enumerate(ids)}
    for pair in dead:
        if not all(a in index for a in pair):
            continue
        i, j = (index[a] for a in pair)
        delay[i, j] = delay[j, i] = DEAD_DELAY_MS
        bandwidth[i, j] = bandwidth[j, i] = DEAD_GBPS
    return delay, bandwidth


Linked = Callable[[Sequence[Sequence[int]]], set[frozenset[int]]]


def crossing(grid: Sequence[Sequence[int]], dead: set[frozenset[int]],
             linked: Linked = connected_pairs) -> set[frozenset[int]]:
    """The dead pairs (device indices) that `grid`'s workers would connect over (`linked`:
    which pairs a grid connects)."""
    return linked(grid) & dead if dead else set()


def avoid(grid: Sequence[Sequence[int]], dead: set[frozenset[int]],
          linked: Linked = connected_pairs) -> list[list[int]] | None:
    """`grid` changed by as few swaps of two devices as it takes for no worker to connect over
    a dead pair (each swap the one that leaves fewest crossings); None where swaps find none.
    Swaps keep the devices in the job and every other device where it was. `linked`: which
    pairs count as connected (every connection by default; integrity/dispute.py: a stage's
    replicas only)."""
    current = [list(row) for row in grid]
    cells = [(j, k) for j, row in enumerate(current) for k in range(len(row))]
    for _ in range(len(cells)):
        left = len(crossing(current, dead, linked))
        if not left:
            return current
        best: tuple[int, list[list[int]]] | None = None
        for (a, b), (c, d) in itertools.combinations(cells, 2):
            trial = [list(row) for row in current]
            trial[a][b], trial[c][d] = trial[c][d], trial[a][b]
            n = len(crossing(trial, dead, linked))
            if n < left and (best is None or n < best[0]):
                best = (n, trial)
        if best is None:
            return None
        current = best[1]
    return current if not crossing(current, dead, linked) else None


def describe(dead: Iterable[frozenset[str]]) -> str:
    """'a<->b, c<->d' for status lines and logs."""
    return ", ".join(sorted("<->".join(sorted(pair)) for pair in dead))
