"""The search: the paper's hybrid genetic algorithm, seeded with structured candidates.

Owns `search_plan`, the function the coordinator and `coordinator plan` call. The algorithm
(PAPER.md, "Search"), after Kang & Moon's multiway partitioning GA:

- genome: a balanced partition of the devices into `stages` groups of `replicas` (labels),
- population (100 for up to 128 devices): structured candidates derived from the matrix
  (`structured`), the rank-order placement, the rest random balanced partitions,
- each step: two random parents; the second parent's labels are renamed to agree with the
  first's as far as possible (Kang & Moon's normalization), 5 random positions of the first
  are copied into the second and balance is repaired by moving devices from over-full to
  under-full groups; a random multi-group mutation now and then (a cyclic rotation of one
  device across several groups, or swapping several devices between two groups: moves that
  change more than one group at once, which the DP max needs); a local search of cyclic
  single-node move chains with locking, keeping the best closed chain by cumulative gain; the
  full evaluation; the child replaces the worse parent if it is better (and new),
- gains: the paper's heuristic (candidate = the node with the fastest intra-partition link;
  gain to Q = its mean link cost to Q minus that fastest intra link) or a plain Kernighan-Lin
  gain (the node's mean link cost inside its group minus its mean cost to Q),
- 25% of the budget goes to this GA; the other 75% to an iterated local search on the best
  candidate: swap descent on the true objective (nearby pairs first, a lexicographic
  tie-breaker to cross the plateaus that maxima create), a kick (two random swaps or a
  multi-group mutation), descent again, keep if better, and a restart from a population
  member or a random partition after `RESTART_AFTER` fruitless kicks. Measured on noisy
  matrices, this split beats giving the GA most of the budget (docs/scheduler.md).

Small instances are not evolved but enumerated (`placements`, `balanced_labelings`): the
cost model sees a placement only as a partition of the devices into unordered groups of equal
size (the coarse graph's TSP orders the groups, the matchings pair their members), so there
are `N! / (R!^S S!)` distinct ones: 280 for 3 x 3, 462 for 2 x 6, 10,395 for 6 x 2. When that
is no more than the candidate budget (and `enumerate_max`), the structured seeds and then every
partition are evaluated once, and the answer is the exact optimum (`PlanResult.exhaustive`).
Under a time limit the rest of the enumeration must also fit in the time left at the pace the
seeds took; otherwise the search evolves as usual (a cut-short enumeration sees one corner).

The budget counts candidates: every child the search builds, evaluated or not (a child that
duplicates a population member is not evaluated, but it paid for its crossover and local
search, so it counts). Every loop checks both the candidate budget and the wall-clock limit
(`seconds`, read from `clock`, which a test may inject), so the search always ends.
Deterministic for a given seed and candidate budget: all randomness comes from one
`numpy.random.Generator`. Under a wall-clock limit the answer depends on the machine's speed.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from coordinator.scheduler.compression import Compression
from coordinator.scheduler.costmodel import CostModel, plan_cost
from coordinator.scheduler.network import Network
from coordinator.scheduler.structured import structured_candidates

log = logging.getLogger(__name__)

GAINS = ("paper", "kl")
CROSSOVER_POINTS = 5
RESTART_AFTER = 8  # kicks without improvement before the local search restarts elsewhere
POLISH_SHARE = 0.75  # share of the budget (candidates and seconds) for the iterated local search
ENUMERATE_MAX = 10_000  # enumerate every placement when there are at most this many
Progress = Callable[[int, float, float], None]  # (candidates, elapsed seconds, best cost)
Clock = Callable[[], float]  # seconds, monotonic


def placements(stages: int, replicas: int) -> int:
    """Distinct placements the cost model can tell apart: partitions of `stages * replicas`
    devices into `stages` unordered groups of `replicas`, `N! / (R!^S S!)`."""
    n = stages * replicas
    return math.factorial(n) // (math.factorial(replicas) ** stages * math.factorial(stages))


def balanced_labelings(stages: int, replicas: int) -> Iterator[np.ndarray]:
    """Every partition counted by `placements`, once, as labels (device -> group) in canonical
    form: groups numbered in order of their first device (what `_Search.key` gives)."""
    n = stages * replicas
    labels = np.zeros(n, dtype=np.int64)
    room = [replicas] * stages

    def fill(i: int, opened: int) -> Iterator[np.ndarray]:
        if i == n:
            yield labels.copy()
            return
        for g in range(min(opened + 1, stages)):  # an open group, or the next new one
            if room[g]:
                labels[i] = g
                room[g] -= 1
                yield from fill(i + 1, max(opened, g + 1))
                room[g] += 1

    yield from fill(0, 0)


def default_budget(devices: int) -> int:
    """Candidates evaluated when neither a budget nor seconds are given (~10 s or less)."""
    if devices <= 128:
        return 10000
    if devices <= 512:
        return 400
    return 120


@dataclass
class PlanResult:
    """A plan and what it costs: grid[j][k] = device of stage j in pipeline k."""

    grid: list[list[int]]
    cost: float
    dp_cost: float
    pp_cost: float
    seconds: float
    tsp_exact: bool
    evaluated: int  # candidates whose cost was computed
    stages: int
    replicas: int
    gain: str = "paper"
    candidates: int = 0  # what the budget counts: evaluated, plus duplicates built and skipped
    exhaustive: bool = False  # every placement was evaluated: `cost` is the exact optimum
    structured_cost: float = float("inf")  # best structured seed, before the search
    history: list[tuple[int, float]] = field(default_factory=list)  # (candidates, best cost)


class _Budget(Exception):
    """Raised inside the search when the candidate or time budget is spent."""


class _Search:
    def __init__(
        self,
        model: CostModel,
        rng: np.random.Generator,
        budget: int | None,
        seconds: float | None,
        gain: str,
        progress: Progress | None,
        clock: Clock = time.perf_counter,
    ) -> None:
        self.m = model
        self.rng = rng
        self.clock = clock
        self.start = clock()
        self.budget = budget
        self.deadline = None if seconds is None else self.start + seconds
        self.ga_budget = None if budget is None else max(1, int(budget * (1.0 - POLISH_SHARE)))
        self.ga_deadline = (
            None if seconds is None else self.start + seconds * (1.0 - POLISH_SHARE)
        )
        self.gain = gain
        self.progress = progress
        self.candidates = 0  # what the budget counts
        self.evaluated = 0
        self.exhaustive = False
        self.best_cost = np.inf
        self.best_labels: np.ndarray = model.rank_order_labels()
        self.history: list[tuple[int, float]] = []
        self._next_report = self.start + 1.0
        link = (model.pp_link + model.pp_link.T) / 2.0
        self.link = link
        n = model.n
        every = np.stack(np.triu_indices(n, 1), axis=1)
        near_k = max(8, 2 * model.replicas)
        if 2 * near_k >= n - 1:  # small: every pair is near
            self.near_pairs, self.all_pairs = every, None
        else:
            ranked = np.argsort(link + np.diag(np.full(n, np.inf)), axis=1, kind="stable")
            a = np.repeat(np.arange(n), near_k)
            b = ranked[:, :near_k].ravel()
            pairs = np.unique(np.stack([np.minimum(a, b), np.maximum(a, b)], axis=1), axis=0)
            self.near_pairs, self.all_pairs = pairs, every
        self.s, self.r, self.n = model.stages, model.replicas, model.n
        self.pop: list[np.ndarray] = []
        self.structured = np.inf
        self._seeds: list[np.ndarray] | None = None
        self.seed_costs: dict[bytes, float] = {}  # by key, when enumeration evaluated them

    # -- bookkeeping ------------------------------------------------------------------------
    def charge(self, ga: bool = False) -> None:
        """Count one candidate against the budget, or raise `_Budget` when it is spent (with
        `ga`, the genetic phase's share of candidates and seconds). Every loop of the search
        passes through here, evaluating or not, so each one ends with the budget."""
        lim = self.ga_budget if ga else self.budget
        deadline = self.ga_deadline if ga else self.deadline
        now = self.clock()
        if (lim is not None and self.candidates >= lim) or (
                deadline is not None and now >= deadline):
            raise _Budget
        self.candidates += 1
        if self.progress is not None and now >= self._next_report:
            self._next_report = now + 1.0
            self.progress(self.candidates, now - self.start, self.best_cost)

    def evaluate(self, labels: np.ndarray, ga: bool = False) -> float:
        return self.evaluate_ranked(labels, ga)[0]

    def evaluate_ranked(self, labels: np.ndarray, ga: bool = False) -> tuple[float, float]:
        self.charge(ga)
        self.evaluated += 1
        c, tie = self.m.evaluate_ranked(labels)
        if c < self.best_cost - 1e-12:
            self.best_cost, self.best_labels = c, labels.copy()
            self.history.append((self.candidates, c))
        return c, tie

    # -- operators --------------------------------------------------------------------------
    def random_labels(self) -> np.ndarray:
        return self.rng.permutation(self.m.rank_order_labels())

    def align(self, ref: np.ndarray, other: np.ndarray) -> np.ndarray:
        """Rename `other`'s groups to agree with `ref`'s as much as possible (greedy)."""
        s = self.s
        overlap = np.zeros((s, s), dtype=np.int64)
        np.add.at(overlap, (other, ref), 1)
        rename = np.full(s, -1)
        used = np.zeros(s, dtype=bool)
        for flat in np.argsort(-overlap, axis=None, kind="stable"):
            a, b = divmod(int(flat), s)
            if rename[a] < 0 and not used[b]:
                rename[a], used[b] = b, True
        return rename[other]

    def crossover(self, p1: np.ndarray, p2: np.ndarray) -> np.ndarray:
        child = self.align(p1, p2).copy()
        pos = self.rng.choice(self.n, size=min(CROSSOVER_POINTS, self.n), replace=False)
        child[pos] = p1[pos]
        return self.repair(child)

    def repair(self, labels: np.ndarray) -> np.ndarray:
        counts = np.bincount(labels, minlength=self.s)
        over = [g for g in range(self.s) if counts[g] > self.r]
        if not over:
            return labels
        under = [g for g in range(self.s) for _ in range(self.r - counts[g]) if counts[g] < self.r]
        self.rng.shuffle(under)
        movers: list[int] = []
        for g in over:
            members = np.flatnonzero(labels == g)
            movers.extend(self.rng.choice(members, size=counts[g] - self.r, replace=False))
        labels[np.asarray(movers)] = np.asarray(under)
        return labels

    def mutate(self, labels: np.ndarray) -> np.ndarray:
        labels = labels.copy()
        rng, s = self.rng, self.s
        if s < 2:
            return labels
        if rng.random() < 0.5:
            k = int(rng.integers(2, s + 1))
            groups = rng.choice(s, size=k, replace=False)
            devs = [int(rng.choice(np.flatnonzero(labels == g))) for g in groups]
            labels[devs] = np.roll(groups, 1)
        else:
            a, b = rng.choice(s, size=2, replace=False)
            t = int(rng.integers(1, max(1, self.r // 2) + 1))
            da = rng.choice(np.flatnonzero(labels == a), size=t, replace=False)
            db = rng.choice(np.flatnonzero(labels == b), size=t, replace=False)
            labels[da], labels[db] = b, a
        return labels

    def _pick(self, labels: np.ndarray, group: int, locked: np.ndarray) -> tuple[int, np.ndarray]:
        """(node, gain to every group) for moving one unlocked node out of `group`."""
        members = np.flatnonzero(labels == group)
        free = members[~locked[members]]
        if len(free) == 0:
            return -1, np.full(self.s, -np.inf)
        link = self.link
        onehot = np.zeros((self.n, self.s))
        onehot[np.arange(self.n), labels] = 1.0
        counts = onehot.sum(axis=0)
        if self.gain == "paper":
            intra = link[free[:, None], members[None, :]]
            intra = np.where(free[:, None] == members[None, :], np.inf, intra)
            fastest = intra.min(axis=1) if len(members) > 1 else np.zeros(len(free))
            i = int(fastest.argmin())
            v = int(free[i])
            mean_to = (link[v] @ onehot) / np.maximum(counts, 1)
            return v, mean_to - fastest[i]
        sums = link[free] @ onehot  # [node, group]
        own = sums[:, group] / max(len(members) - 1, 1)
        mean_to = sums / np.maximum(counts, 1)[None, :]
        gains = own[:, None] - mean_to
        gains[:, group] = -np.inf
        i = int(gains.max(axis=1).argmax())
        return int(free[i]), gains[i]

    def local_search(self, labels: np.ndarray) -> np.ndarray:
        """One cyclic move chain S0 -> S1 -> ... -> S0 with locking; keep the best closed one."""
        s = self.s
        if s < 2:
            return labels
        work = labels.copy()
        locked = np.zeros(self.n, dtype=bool)
        start = int(self.rng.integers(s))
        cur, visited = start, {start}
        moves: list[tuple[int, int]] = []  # (node, new group)
        cum, best_total, best_chain = 0.0, 1e-12, None
        for step in range(s):
            v, gains = self._pick(work, cur, locked)
            if v < 0:
                break
            if step > 0 and cum + gains[start] > best_total:
                best_total = cum + gains[start]
                best_chain = moves + [(v, start)]
            options = np.array(gains, dtype=float)
            options[list(visited)] = -np.inf
            nxt = int(options.argmax())
            if not np.isfinite(options[nxt]):
                break
            work[v], locked[v] = nxt, True
            cum += float(options[nxt])
            moves.append((v, nxt))
            visited.add(nxt)
            cur = nxt
        if best_chain is None:
            return labels
        out = labels.copy()
        for v, g in best_chain:
            out[v] = g
        return out

    # -- phases -----------------------------------------------------------------------------
    def _swap_pass(
        self, labels: np.ndarray, rank: tuple[float, float], pairs: np.ndarray
    ) -> tuple[np.ndarray, tuple[float, float], bool]:
        """One first-improvement pass over the given device pairs, in random order."""
        improved = False
        for a, b in pairs[self.rng.permutation(len(pairs))].tolist():
            if labels[a] == labels[b]:
                continue
            cand = labels.copy()
            cand[a], cand[b] = labels[b], labels[a]
            c = self.evaluate_ranked(cand)
            if _better(c, rank):
                labels, rank, improved = cand, c, True
        return labels, rank, improved

    def descend(
        self, labels: np.ndarray, rank: tuple[float, float]
    ) -> tuple[np.ndarray, tuple[float, float]]:
        """Swap descent on (objective, tie-breaker) in lexicographic order, so plateaus are
        crossed. Swaps of nearby devices first (they keep a structured candidate's blocks and
        fix which device of a block serves which group); when those are exhausted, one pass
        over all pairs, and back to the near ones if it found anything."""
        while True:
            improved = True
            while improved:
                labels, rank, improved = self._swap_pass(labels, rank, self.near_pairs)
            if self.all_pairs is None:
                return labels, rank
            labels, rank, improved = self._swap_pass(labels, rank, self.all_pairs)
            if not improved:
                return labels, rank

    def kick(self, labels: np.ndarray) -> np.ndarray:
        """A small random perturbation: a multi-group mutation, or two random swaps."""
        if self.rng.random() < 0.3:
            return self.mutate(labels)
        out = labels.copy()
        for _ in range(2):
            a, b = self.rng.choice(self.n, size=2, replace=False)
            out[a], out[b] = out[b], out[a]
        return out

    def polish(self) -> None:
        """Iterated local search: swap descent, then kick (two random swaps or a multi-group
        mutation) and descend again, keeping the result when it is better. After
        `RESTART_AFTER` kicks without progress it restarts from a member of the final GA
        population (or a random partition). Runs until the budget ends; the best candidate
        ever evaluated is the answer."""
        if self.s < 2 or self.r < 2:
            return  # one group, or groups of one: every partition is the same
        start = self.best_labels.copy()
        labels, rank = self.descend(start, self.m.evaluate_ranked(start))
        stall = 0
        while True:
            if stall >= RESTART_AFTER:
                if self.pop and self.rng.random() < 0.5:
                    start = self.pop[int(self.rng.integers(len(self.pop)))].copy()
                else:
                    start = self.random_labels()
                labels, rank = self.descend(start, self.evaluate_ranked(start))
                stall = 0
            kicked = self.kick(labels)
            kicked, c = self.descend(kicked, self.evaluate_ranked(kicked))
            stall += 1
            if _better(c, rank):
                labels, rank = kicked, c
                stall = 0

    def seeds(self) -> list[np.ndarray]:
        """The structured candidates and the rank-order placement, in that order (built once:
        they draw from the generator)."""
        if self._seeds is None:
            orders = 3 if self.n <= 128 else 1
            self._seeds = structured_candidates(self.m.pp_link, self.s, self.r, self.rng, orders)
            self._seeds.append(self.m.rank_order_labels())
        return self._seeds

    def enumerate_all(self, count: int) -> bool:
        """Evaluate the seeds, then every other of the `count` placements once: the exact
        optimum (the budget may still end it: then the best seen, as from any search).

        Under a time limit, returns False after the seeds when, at the pace they were
        evaluated, the rest would not fit in the time left: an enumeration cut short has seen
        one corner of the space, where the genetic phase (which reuses the seeds' costs)
        spreads its candidates."""
        known = self.seed_costs
        t0, n0 = self.clock(), self.candidates
        for labels in self.seeds():
            key = self.key(labels)
            if key not in known:
                known[key] = self.evaluate(labels)
        self.structured = self.best_cost
        if self.deadline is not None:
            now = self.clock()
            pace = (now - t0) / max(1, self.candidates - n0)
            if now + pace * (count - len(known)) > self.deadline:
                return False
        for labels in balanced_labelings(self.s, self.r):
            if self.key(labels) not in known:
                self.evaluate(labels)
        self.exhaustive = True
        return True

    def run(self, population: int) -> None:
        seeds = self.seeds()
        pop: list[np.ndarray] = self.pop
        costs: list[float] = []
        seen: set[bytes] = set()

        def add(labels: np.ndarray, cost: float) -> None:
            pop.append(labels)
            costs.append(cost)
            seen.add(self.key(labels))

        for labels in seeds:
            key = self.key(labels)
            if key in seen:
                continue
            cost = self.seed_costs.get(key)  # evaluated already by `enumerate_all`
            add(labels, self.evaluate(labels) if cost is None else cost)  # may use the budget
            self.structured = self.best_cost
            if len(pop) >= population:
                break
        tries = 0
        while len(pop) < population and tries < 20 * population:
            tries += 1
            labels = self.random_labels()
            if self.key(labels) not in seen:
                add(labels, self.evaluate(labels, ga=True))
            else:
                self.charge(ga=True)  # a duplicate drawn: it counts, or this could spin
        if len(pop) < 2 or self.s < 2 or self.r < 2:
            return
        stale = 0
        while True:
            i, j = self.rng.choice(len(pop), size=2, replace=False)
            child = self.crossover(pop[i], pop[j])
            if self.rng.random() < 0.3:
                child = self.mutate(child)
            child = self.local_search(child)
            key = self.key(child)
            if key in seen:
                self.charge(ga=True)  # not evaluated, but it paid the local search
                stale += 1
                if stale > 50 * population:
                    return  # the population has converged: leave the rest to the polish
                continue
            stale = 0
            c = self.evaluate(child, ga=True)
            worse = i if costs[i] >= costs[j] else j
            if c < costs[worse]:
                seen.discard(self.key(pop[worse]))
                pop[worse], costs[worse] = child, c
                seen.add(key)

    @staticmethod
    def key(labels: np.ndarray) -> bytes:
        """Canonical form: groups renamed in order of first appearance."""
        _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
        rank = np.argsort(np.argsort(first))
        return rank[inverse].astype(np.int16).tobytes()


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    if a[0] < b[0] - 1e-12:
        return True
    return a[0] <= b[0] + 1e-12 and a[1] < b[1] - 1e-12


def search_plan(
    net: Network,
    stages: int,
    replicas: int,
    dp_gb: float,
    pp_gb: float,
    seed: int = 0,
    budget: int | None = None,
    seconds: float | None = None,
    *,
    gain: str = "paper",
    population: int | None = None,
    rng: np.random.Generator | None = None,
    progress: Progress | None = None,
    compression: Compression | None = None,
    enumerate_max: int = ENUMERATE_MAX,
    clock: Clock = time.perf_counter,
) -> PlanResult:
    """Search for the cheapest plan of `stages` x `replicas` tasklets on `net`.

    `budget` counts candidates (evaluated, or built and skipped as duplicates), `seconds` is a
    wall-clock limit read from `clock`; with neither, the budget is `default_budget(N)`. When
    the instance has no more `placements` than the budget and `enumerate_max` (0: never), every
    one is evaluated instead of evolving. `rng` overrides `seed`. The returned cost is
    `plan_cost` of the returned grid. `compression`: count each link's compressed bytes (None:
    the paper's).
    """
    if gain not in GAINS:
        raise ValueError(f"gain must be one of {GAINS}, got {gain!r}")
    if budget is not None and budget < 1:
        raise ValueError(f"budget must be >= 1 candidate, got {budget}")
    if seconds is not None and seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    t0 = clock()
    model = CostModel(net, stages, replicas, dp_gb, pp_gb, compression=compression)
    if budget is None and seconds is None:
        budget = default_budget(net.size)
    if population is None:
        population = 100 if net.size <= 128 else 24
    search = _Search(model, rng or np.random.default_rng(seed), budget, seconds, gain, progress,
                     clock)
    search.structured = np.inf
    count = placements(stages, replicas)
    enumerated = False
    if count <= min(enumerate_max, budget if budget is not None else enumerate_max):
        try:
            enumerated = search.enumerate_all(count)
        except _Budget:
            enumerated = True  # the budget ended it: the best seen is the answer
    if not enumerated:
        for phase in (lambda: search.run(population), search.polish):
            try:  # each ends when its share of the budget is spent
                phase()
            except _Budget:
                pass
    grid = model.grid(search.best_labels)
    cost, dp, pp = plan_cost(net, grid, dp_gb, pp_gb, compression)
    elapsed = clock() - t0
    how = f"all {count} placements" if search.exhaustive else f"{search.candidates} candidates"
    log.info(
        "plan %dx%d: cost %.4f (dp %.4f + 2 x pp %.4f) after %s in %.2fs",
        stages, replicas, cost, dp, pp, how, elapsed,
    )
    return PlanResult(
        grid=grid,
        cost=cost,
        dp_cost=dp,
        pp_cost=pp,
        seconds=elapsed,
        tsp_exact=model.tsp_exact,
        evaluated=search.evaluated,
        stages=stages,
        replicas=replicas,
        gain=gain,
        candidates=search.candidates,
        exhaustive=search.exhaustive,
        structured_cost=float(search.structured),
        history=search.history,
    )
