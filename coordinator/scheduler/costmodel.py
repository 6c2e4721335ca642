"""The paper's cost model, vectorized: what a placement of tasklets on devices costs.

Owns (PAPER.md, "Cost model"):
- link cost `alpha/1000 + 8*S/beta` seconds (S in GB, beta in Gbit/s),
- DP-COST: per data-parallel group (a partition of devices) a sharded all-reduce,
  `max_d sum_{d'} 2*(alpha/1000 + 8*c_DP/(D_DP*beta))`, then the max over groups,
- the coarse graph: between two partitions the bottleneck perfect matching (the smallest
  possible largest pair cost), computed exactly; by Hall's theorem in one vectorized numpy
  pass for up to 8 replicas, by threshold search with augmenting paths above,
- PP-COST: an open-loop travelling-salesman path over the coarse graph; exact (Held-Karp,
  vectorized over subsets) up to `EXACT_TSP_MAX` stages, nearest-neighbour starts + 2-opt +
  or-opt above (the result says which),
- the objective `DP-COST + 2*PP-COST`, `plan_cost` of a given grid, and `comm_gb`, the two
  message sizes of a model,
- compressed bytes (`compression.Compression`, optional): a pipeline link charges its
  codec's wire bytes and compression time, a data-parallel group its codec's; under `auto`
  each link and group takes the codec that moves its bytes fastest. Without it (or with both
  settings `none`) every number is the paper's.

Units: sizes in GB of 1e9 bytes (the paper's code mixes 1e9 and 2^30; we use 1e9 throughout),
delays in ms, bandwidths in Gbit/s, costs in seconds.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from coordinator.scheduler.compression import Compression
from coordinator.scheduler.network import Network
from dtfm.core.layout import layer_ranges
from dtfm.core.lora import trained_params
from dtfm.core.spec import DTYPE_BYTES, ModelSpec, TrainConfig
from dtfm.core.words import stages_x_replicas

EXACT_TSP_MAX = 12  # Held-Karp up to this many stages (2^12 x 12 x 12 numpy work per path)
HALL_MAX = 8  # vectorized Hall bottleneck up to this many replicas (2^R subsets)
_CACHE_LIMIT = 400_000


def comm_gb(
    spec: ModelSpec, stages: int, replicas: int, global_batch: int,
    dtype: str = TrainConfig.dtype, lora_rank: int = 0, lora_targets: str = "",
) -> tuple[float, float]:
    """(c_DP, c_PP) in GB (1e9 bytes) for `spec` split evenly into `stages` stages, its
    messages in `dtype` (default: a job's, fp32).

    c_DP: the largest stage's parameters in `dtype` (its gradient message). c_PP: the hidden
    states one stage sends the next for one replica's share of the batch,
    `(global_batch / replicas) * seq_len * d_model * bytes`. Micro-batching does not change
    the bytes, only how they are chunked. With `lora_rank` (LoRA) only the adapters are
    exchanged: c_DP is the largest stage's adapters (`dtfm.core.lora`).
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {dtype!r}")
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if global_batch < 1:
        raise ValueError(f"global batch must be >= 1, got {global_batch}")
    if stages > spec.n_layers:
        raise ValueError(
            f"{spec.name} has {spec.n_layers} layers, so it cannot be split into {stages} "
            f"stages: use --stages {spec.n_layers} or fewer"
        )
    nbytes = DTYPE_BYTES[dtype]
    largest = max(trained_params(spec, b, e, lora_rank, lora_targets)
                  for b, e in layer_ranges(spec.n_layers, stages))
    dp_gb = largest * nbytes / 1e9
    pp_gb = (global_batch / replicas) * spec.seq_len * spec.d_model * nbytes / 1e9
    return dp_gb, pp_gb


# --------------------------------------------------------------------------- matching


def _kuhn_matching(allowed: np.ndarray) -> list[int] | None:
    """A perfect matching row -> column using only allowed edges, or None (augmenting paths)."""
    n = allowed.shape[0]
    adj = [np.flatnonzero(allowed[r]).tolist() for r in range(n)]
    col_owner = [-1] * n

    def augment(r: int, seen: list[bool]) -> bool:
        for c in adj[r]:
            if not seen[c]:
                seen[c] = True
                if col_owner[c] < 0 or augment(col_owner[c], seen):
                    col_owner[c] = r
                    return True
        return False

    for r in sorted(range(n), key=lambda r: len(adj[r])):
        if not augment(r, [False] * n):
            return None
    match = [0] * n
    for c, r in enumerate(col_owner):
        match[r] = c
    return match


def bottleneck_matching(a: np.ndarray) -> tuple[float, list[int]]:
    """(value, match) for one square cost matrix: match[r] = column of row r, and value the
    smallest achievable largest cost a[r, match[r]]."""
    n = a.shape[0]
    if n == 1:
        return float(a[0, 0]), [0]
    lb = max(a.min(axis=1).max(), a.min(axis=0).max())
    values = np.unique(a[a >= lb])
    match = _kuhn_matching(a <= values[0])
    if match is not None:
        return float(values[0]), match
    lo, hi = 1, len(values) - 1  # values[hi] = max entry: always feasible
    best = _kuhn_matching(a <= values[hi])
    assert best is not None
    while lo < hi:
        mid = (lo + hi) // 2
        m = _kuhn_matching(a <= values[mid])
        if m is None:
            lo = mid + 1
        else:
            hi, best = mid, m
    return float(values[hi]), best


class _HallBottleneck:
    """Bottleneck value of a batch of R x R matrices by Hall's theorem, fully vectorized.

    A perfect matching with all costs <= t exists iff every non-empty row set X has at least
    |X| columns reachable with cost <= t. Column c is reachable from X at threshold
    min_{r in X} a[r, c], so X needs t >= the |X|-th smallest of those minima; the bottleneck
    value is the max of that over all X. 2^R subsets, so only for small R.
    """

    def __init__(self, r: int) -> None:
        self.r = r
        sizes = np.array([bin(m).count("1") for m in range(1 << r)])
        # flat position of "the |X|-th smallest" of subset X in a sorted (2^R, R) block
        self.flat = r + np.arange((1 << r) - 1) * r + (sizes[1:] - 1)  # skip the empty set
        self._buf = np.empty((0, 1 << r, r))

    def __call__(self, a: np.ndarray) -> np.ndarray:
        b, r = a.shape[0], self.r
        if self._buf.shape[0] < b:  # reused: a fresh 0.5 MB array per call costs page faults
            self._buf = np.empty((b, 1 << r, r))
        colmin = self._buf[:b]
        colmin[:, 0, :] = np.inf
        for h in range(r):
            lo = 1 << h
            np.minimum(colmin[:, :lo, :], a[:, h, None, :], out=colmin[:, lo : 2 * lo, :])
        colmin.sort(axis=2)
        return colmin.reshape(b, -1)[:, self.flat].max(axis=1)


# --------------------------------------------------------------------------- TSP


class _HeldKarp:
    """Exact open-loop TSP path (any start, any end) over S nodes, vectorized over subsets."""

    def __init__(self, s: int) -> None:
        self.s = s
        full = 1 << s
        pop = np.array([bin(m).count("1") for m in range(full)])
        self.layers: list[tuple[np.ndarray, np.ndarray]] = []
        for k in range(2, s + 1):
            masks = np.flatnonzero(pop == k)
            bits = 1 << np.arange(s)
            inmask = (masks[:, None] & bits[None, :]) != 0
            prev = np.where(inmask, masks[:, None] ^ bits[None, :], 0)
            self.layers.append((masks, prev))

    def solve(self, w: np.ndarray, want_path: bool = False) -> tuple[float, list[int]]:
        s = self.s
        if s == 1:
            return 0.0, [0]
        dp = np.full((1 << s, s), np.inf)
        dp[1 << np.arange(s), np.arange(s)] = 0.0
        wt = w.T  # wt[j, i] = w[i, j]: arrive at j from i
        parents: list[np.ndarray] = []
        for masks, prev in self.layers:
            cand = dp[prev] + wt[None, :, :]  # [mask, j, i]
            if want_path:
                arg = cand.argmin(axis=2)
                parents.append(arg)
                dp[masks] = np.take_along_axis(cand, arg[:, :, None], axis=2)[:, :, 0]
            else:
                dp[masks] = cand.min(axis=2)
        full = (1 << s) - 1
        end = int(dp[full].argmin())
        value = float(dp[full, end])
        if not want_path:
            return value, []
        path = [end]
        mask, j = full, end
        for layer in range(len(self.layers) - 1, -1, -1):
            masks = self.layers[layer][0]
            row = int(np.searchsorted(masks, mask))
            i = int(parents[layer][row, j])
            mask ^= 1 << j
            j = i
            path.append(j)
        path.reverse()
        return value, path


def _path_length(w: np.ndarray, path: Sequence[int]) -> float:
    p = np.asarray(path)
    return float(w[p[:-1], p[1:]].sum()) if len(p) > 1 else 0.0


def _two_opt(w: np.ndarray, path: np.ndarray) -> np.ndarray:
    """Best-improvement 2-opt (segment reversal) on a directed open path, vectorized."""
    s = len(path)
    idx = np.arange(s)
    ii, jj = np.meshgrid(idx, idx, indexing="ij")
    valid = ii < jj
    for _ in range(4 * s):
        fwd = w[path[:-1], path[1:]]
        bwd = w[path[1:], path[:-1]]
        f = np.concatenate([[0.0], np.cumsum(fwd)])
        b = np.concatenate([[0.0], np.cumsum(bwd)])
        delta = (b[jj] - b[ii]) - (f[jj] - f[ii])
        has_prev = ii > 0
        pi = path[np.maximum(ii - 1, 0)]
        delta += np.where(has_prev, w[pi, path[jj]] - w[pi, path[ii]], 0.0)
        has_next = jj < s - 1
        nj = path[np.minimum(jj + 1, s - 1)]
        delta += np.where(has_next, w[path[ii], nj] - w[path[jj], nj], 0.0)
        delta = np.where(valid, delta, 0.0)
        k = int(delta.argmin())
        if delta.flat[k] > -1e-12:
            break
        i, j = divmod(k, s)
        path = path.copy()
        path[i : j + 1] = path[i : j + 1][::-1]
    return path


def _or_opt(w: np.ndarray, path: np.ndarray) -> np.ndarray:
    """Move segments of 1-3 nodes elsewhere (no reversal) while that shortens the path."""
    best = _path_length(w, path)
    improved = True
    while improved:
        improved = False
        s = len(path)
        for length in (1, 2, 3):
            for i in range(s - length + 1):
                seg = path[i : i + length]
                rest = np.concatenate([path[:i], path[i + length :]])
                cands = [np.concatenate([rest[:p], seg, rest[p:]]) for p in range(len(rest) + 1)]
                arr = np.stack(cands)
                lens = w[arr[:, :-1], arr[:, 1:]].sum(axis=1)
                k = int(lens.argmin())
                if lens[k] < best - 1e-12:
                    best, path, improved = float(lens[k]), arr[k], True
                    break
            if improved:
                break
    return path


def tsp_heuristic(w: np.ndarray, starts: int | None = None) -> tuple[float, list[int]]:
    """Open-loop TSP path: nearest neighbour from several starts, then 2-opt and or-opt."""
    s = w.shape[0]
    if s == 1:
        return 0.0, [0]
    masked = w + np.diag(np.full(s, np.inf))
    order = np.argsort(masked.min(axis=1))
    begin = order[: (starts or s)]
    best_val, best_path = np.inf, np.arange(s)
    for st in begin:
        path = [int(st)]
        free = np.ones(s, dtype=bool)
        free[st] = False
        for _ in range(s - 1):
            row = np.where(free, masked[path[-1]], np.inf)
            nxt = int(row.argmin())
            path.append(nxt)
            free[nxt] = False
        p = _two_opt(w, np.array(path))
        val = _path_length(w, p)
        if val < best_val - 1e-12:
            best_val, best_path = val, p
    best_path = _or_opt(w, _two_opt(w, best_path))
    return _path_length(w, best_path), [int(x) for x in best_path]


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Evaluation:
    """The parts of one candidate's cost; `order` and `grid` only when asked for."""

    cost: float
    dp_cost: float
    pp_cost: float
    order: list[int] | None = None
    grid: list[list[int]] | None = None


class CostModel:
    """The objective for one network, one shape (stages x replicas) and one pair of sizes.

    A candidate is a partition of the devices into `stages` groups of `replicas` devices,
    given as labels (device -> group). Pair weights of the coarse graph are cached by the two
    groups' member sets, since the search revisits groups much more often than partitions.
    """

    def __init__(
        self,
        net: Network,
        stages: int,
        replicas: int,
        dp_gb: float,
        pp_gb: float,
        exact_tsp_max: int = EXACT_TSP_MAX,
        *,
        compression: Compression | None = None,
    ) -> None:
        if stages < 1 or replicas < 1:
            raise ValueError(f"stages and replicas must be >= 1, got {stages} x {replicas}")
        if net.size != stages * replicas:
            raise ValueError(
                f"the network has {net.size} devices but {stages_x_replicas(stages, replicas)} "
                f"need {stages * replicas}: pick stages x replicas = {net.size}"
            )
        if not (np.isfinite(dp_gb) and dp_gb >= 0 and np.isfinite(pp_gb) and pp_gb >= 0):
            raise ValueError(f"c_DP and c_PP must be >= 0 GB, got {dp_gb} and {pp_gb}")
        self.net = net
        self.stages, self.replicas, self.n = stages, replicas, net.size
        self.dp_gb, self.pp_gb = float(dp_gb), float(pp_gb)
        self.compression = compression if compression is not None and compression.active \
            else None
        if self.compression is None:
            self.pp_link = net.link_cost(pp_gb)
            alpha = net.delay_ms / 1000.0
            self.dp_link = 2.0 * (alpha + 8.0 * dp_gb / (replicas * net.bandwidth_gbps))
            np.fill_diagonal(self.dp_link, 0.0)
            self._dp_options: list[tuple[np.ndarray, np.ndarray]] = []
        else:
            self.pp_link = self.compression.pp_link_cost(net, pp_gb)
            self._dp_options = self.compression.dp_matrices(net, dp_gb, replicas)
            self.dp_link = self._dp_options[0][1]  # uncompressed, for callers that look
        self.symmetric = bool(np.array_equal(self.pp_link, self.pp_link.T))
        self.tsp_exact = stages <= exact_tsp_max
        self._hk = _HeldKarp(stages) if self.tsp_exact else None
        self._hall = _HallBottleneck(replicas) if 1 < replicas <= HALL_MAX else None
        if self.symmetric:
            ia, ib = np.triu_indices(stages, 1)
        else:
            ia, ib = np.nonzero(~np.eye(stages, dtype=bool))
        self._ia, self._ib = ia, ib
        self._cache: dict[tuple[bytes, bytes], float] = {}

    # -- pieces ---------------------------------------------------------------------------
    def groups(self, labels: np.ndarray) -> np.ndarray:
        """(stages, replicas) array: row g = the devices labelled g, ascending."""
        order = np.argsort(labels, kind="stable")
        return order.reshape(self.stages, self.replicas)

    def dp_costs(self, groups: np.ndarray) -> np.ndarray:
        """DP(C_j) of every group (under its codec, when compressing)."""
        if self.compression is not None:
            return self.compression.dp_group_costs(self._dp_options, groups)[0]
        sub = self.dp_link[groups[:, :, None], groups[:, None, :]]
        return sub.sum(axis=2).max(axis=1)

    def coarse_weights(self, groups: np.ndarray) -> np.ndarray:
        """w[a, b]: bottleneck perfect matching cost from group a's devices to group b's."""
        s = self.stages
        w = np.zeros((s, s))
        if s == 1:
            return w
        keys = [g.tobytes() for g in groups]
        cache = self._cache
        ia, ib = self._ia, self._ib
        vals = np.empty(len(ia))
        todo: list[int] = []
        for t in range(len(ia)):
            v = cache.get((keys[ia[t]], keys[ib[t]]))
            if v is None:
                todo.append(t)
            else:
                vals[t] = v
        if todo:
            ta = ia[todo]
            tb = ib[todo]
            mats = self.pp_link[groups[ta][:, :, None], groups[tb][:, None, :]]
            if self.replicas == 1:
                new = mats[:, 0, 0]
            elif self._hall is not None:
                new = self._hall(mats)
            else:
                new = np.array([bottleneck_matching(m)[0] for m in mats])
            vals[todo] = new
            if len(cache) > _CACHE_LIMIT:
                cache.clear()
            for t, v in zip(todo, new.tolist(), strict=True):
                cache[(keys[ia[t]], keys[ib[t]])] = v
        w[ia, ib] = vals
        if self.symmetric:
            w[ib, ia] = vals
        return w

    def tsp(self, w: np.ndarray, want_path: bool = False) -> tuple[float, list[int]]:
        if self._hk is not None:
            return self._hk.solve(w, want_path)
        return tsp_heuristic(w)

    # -- whole candidates -----------------------------------------------------------------
    def evaluate(self, labels: np.ndarray) -> float:
        """The objective of a partition (labels: device -> group, balanced)."""
        return self.evaluate_ranked(labels)[0]

    def evaluate_ranked(self, labels: np.ndarray) -> tuple[float, float]:
        """(objective, tie-breaker). The objective is made of maxima and so has wide
        plateaus; the tie-breaker (the sum of every group's DP cost plus twice the mean
        coarse edge per stage) tells a local search which way is downhill on them."""
        groups = self.groups(labels)
        dp_all = self.dp_costs(groups) if self.replicas > 1 else np.zeros(1)
        if self.stages > 1:
            w = self.coarse_weights(groups)
            pp = self.tsp(w)[0]
            smooth = 2.0 * float(w.sum()) / self.stages
        else:
            pp, smooth = 0.0, 0.0
        return float(dp_all.max()) + 2.0 * pp, float(dp_all.sum()) + smooth

    def grid(self, labels: np.ndarray) -> list[list[int]]:
        """The plan of a partition: TSP order of the groups, pipelines from the matchings."""
        groups = self.groups(labels)
        if self.stages == 1:
            return [groups[0].tolist()]
        w = self.coarse_weights(groups)
        _, order = self.tsp(w, want_path=True)
        rows = [groups[order[0]].tolist()]
        for a, b in itertools.pairwise(order):
            prev = rows[-1]
            dst = groups[b]
            sub = self.pp_link[np.asarray(prev)[:, None], dst[None, :]]
            allowed = sub <= w[a, b]
            match = _kuhn_matching(allowed)
            if match is None:  # cannot happen: w[a, b] is achievable; be safe anyway
                _, match = bottleneck_matching(sub)
            rows.append([int(dst[match[k]]) for k in range(self.replicas)])
        return rows

    def rank_order_labels(self) -> np.ndarray:
        """Stage-major in the given device order: stage j = devices j*R .. j*R+R-1."""
        return np.repeat(np.arange(self.stages), self.replicas)


def plan_cost(
    net: Network, grid: Sequence[Sequence[int]], dp_gb: float, pp_gb: float,
    compression: Compression | None = None,
) -> tuple[float, float, float]:
    """(cost, dp_cost, pp_cost) of exactly this grid (grid[j][k] = device of stage j, pipeline k).

    pp_cost = sum_j max_k linkcost(grid[j][k] -> grid[j+1][k]) with S = c_PP; dp_cost = max
    over stages of the sharded all-reduce cost of row j; cost = dp_cost + 2 * pp_cost. With
    an active `compression`, each link and group is charged under its codec.
    """
    g = np.asarray(grid, dtype=np.int64)
    if g.ndim != 2 or g.size == 0:
        raise ValueError("a grid must be a non-empty list of equally long rows")
    s, r = g.shape
    if g.size != net.size or sorted(g.ravel().tolist()) != list(range(net.size)):
        raise ValueError(
            f"a {s}x{r} grid must use each of the network's {net.size} devices exactly once"
        )
    if compression is not None and compression.active:
        pp_link = compression.pp_link_cost(net, pp_gb)
        dp = float(compression.dp_group_costs(compression.dp_matrices(net, dp_gb, r), g)[0]
                   .max()) if r > 1 else 0.0
        pp = float(pp_link[g[:-1], g[1:]].max(axis=1).sum()) if s > 1 else 0.0
        return dp + 2.0 * pp, dp, pp
    pp_link = net.link_cost(pp_gb)
    dp_link = 2.0 * (net.delay_ms / 1000.0 + 8.0 * dp_gb / (r * net.bandwidth_gbps))
    np.fill_diagonal(dp_link, 0.0)
    dp = float(dp_link[g[:, :, None], g[:, None, :]].sum(axis=2).max()) if r > 1 else 0.0
    pp = float(pp_link[g[:-1], g[1:]].max(axis=1).sum()) if s > 1 else 0.0
    return dp + 2.0 * pp, dp, pp
