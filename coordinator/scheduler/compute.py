"""Uneven devices: the layer split and the placement that account for compute and memory.

Owns turning per-device speeds (FLOP/s) and memory into a plan's layer split, and refining a
placement found by the paper's communication-only search (`evolutionary`) so that devices of
one speed share a stage. Every candidate is scored by the one step model
(`steptime.simulate_step`: the runtime's schedule, per micro-batch, with each tasklet's own
compute = its stage's FLOPs (`flops.stage_flops`, a frozen base's cheaper backward counted
under LoRA) over its device's FLOP/s) and the memory model (`memory`); a split
that leaves a device short of memory loses to any that fits.

- `best_split`: contiguous layer ranges for a fixed grid. Small instances are enumerated;
  larger ones start from the even split, a split proportional to each stage's slowest device
  and the exact min-max split of a DP over contiguous ranges, then climb by moving one layer
  between two stages while the simulated step improves.
- `place_for_compute`: the grid itself. Candidates are the paper's grid and the grid with
  each pipeline's devices reordered by speed (so a stage's data-parallel group is of one
  speed), then a first-improvement swap search, swaps inside a pipeline first.
- `plan_split`: what a job and `coordinator plan` call. When the devices are alike (within
  `SPEED_TOLERANCE`) and the even split fits, the paper's grid and the even split are kept
  as they are, so the paper's setting gives the paper's plan.

Pure numpy, like the rest of the scheduler: no torch, grpc or protobuf.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from coordinator.scheduler.compression import Compression
from coordinator.scheduler.flops import stage_flops
from coordinator.scheduler.memory import MemoryShape, shortfalls, stage_bytes, stages_bytes
from coordinator.scheduler.network import Network
from coordinator.scheduler.steptime import StepShape, StepTime, simulate_step, step_shape
from dtfm.core.layout import layer_ranges, layer_splits
from dtfm.core.spec import ModelSpec

SPEED_TOLERANCE = 0.2  # devices within 20 % of each other's FLOP/s count as alike
EXHAUSTIVE_SPLITS = 400  # enumerate every split when there are at most this many


@dataclass(frozen=True)
class Workload:
    """One step of a job, as far as the step and memory models need it."""

    spec: ModelSpec
    stages: int
    replicas: int
    global_batch: int
    micro_batches: int
    schedule: str = "gpipe"
    dtype: str = "fp32"  # training (autocast) dtype: memory and which FLOP/s figure counts
    act_dtype: str = "fp32"  # activations on the wire
    dp_mode: str = "sharded"  # how the worker averages gradients
    compression: Compression | None = None  # compressed messages (None: as they are)
    moments_dtype: str = "fp32"  # what AdamW stores its moments in (memory only)
    sync_every: int = 1  # local steps: the data-parallel exchange every this many steps
    outer_delay: int = 0  # 1: that exchange overlaps the next round (--outer-delay)
    pipeline_delay: int = 0  # 1: no flush between steps but at sync points (--pipeline-delay)
    lora_rank: int = 0  # LoRA: only the adapters are exchanged and hold optimizer state
    lora_targets: str = ""
    # replica checks (--verify) priced into the step (coordinator/job/machine.py passes the
    # job's level)
    verify: str = "off"

    @property
    def micro_size(self) -> int:
        return self.global_batch // (self.replicas * self.micro_batches)

    def step_shape(self, splits: Sequence[int] | None) -> StepShape:
        return step_shape(self.spec, self.stages, self.replicas, self.global_batch,
                          self.micro_batches, self.schedule, self.act_dtype, splits,
                          self.dp_mode, self.compression, self.sync_every,
                          self.lora_rank, self.lora_targets, self.verify, self.outer_delay,
                          self.pipeline_delay)

    def memory(self) -> MemoryShape:
        return MemoryShape(self.spec, self.stages, self.replicas, self.micro_size,
                           self.micro_batches, self.schedule, self.dtype, self.moments_dtype,
                           self.sync_every, self.lora_rank, self.lora_targets,
                           self.outer_delay, self.pipeline_delay)


def tasklet_seconds(work: Workload, grid: Sequence[Sequence[int]], flops: Sequence[float],
                    splits: Sequence[int] | None) -> np.ndarray:
    """compute_s[stage][replica]: one micro-batch's forward + backward on that device."""
    tokens = work.micro_size * work.spec.seq_len
    per_stage = [stage_flops(work.spec, b, e, tokens, work.lora_rank, work.lora_targets)
                 for b, e in layer_ranges(work.spec.n_layers, work.stages, splits)]
    speed = np.asarray(flops, dtype=float)[np.asarray(grid, dtype=np.int64)]
    return np.asarray(per_stage)[:, None] / speed


@dataclass(frozen=True)
class Scored:
    """A (grid, split) and what the models say about it."""

    grid: list[list[int]]
    splits: list[int]
    step: StepTime
    missing_bytes: int  # memory short over every device (0: it fits)

    @property
    def key(self) -> tuple[int, float]:
        return self.missing_bytes, self.step.step_s


@dataclass(frozen=True)
class Devices:
    """What the models know about each device: FLOP/s (> 0), memory (0: unknown) and which
    memory pool it draws from ("": its own; see `memory.pool_shortfalls`)."""

    flops: np.ndarray
    memory: np.ndarray
    pools: tuple[str, ...] = ()  # empty: every device has its own

    @classmethod
    def of(cls, flops: Sequence[float], memory: Sequence[int] | None = None,
           pools: Sequence[str] | None = None) -> Devices:
        f = np.asarray(flops, dtype=float)
        known = f[f > 0]
        f = np.where(f > 0, f, np.median(known) if known.size else 1.0)  # unknown: typical
        m = np.zeros(f.size, dtype=np.int64) if memory is None else np.asarray(memory, np.int64)
        if m.shape != f.shape:
            raise ValueError(f"{m.size} memory sizes for {f.size} devices")
        if pools is not None and len(pools) != f.size:
            raise ValueError(f"{len(pools)} memory pools for {f.size} devices")
        return cls(f, m, tuple(pools or ()))

    def alike(self) -> bool:
        return bool(self.flops.max() <= self.flops.min() * (1.0 + SPEED_TOLERANCE))


def score(net: Network, grid: Sequence[Sequence[int]], work: Workload, dev: Devices,
          splits: Sequence[int]) -> Scored:
    need = stages_bytes(work.memory(), splits)
    g = np.asarray(grid, dtype=np.int64)
    missing = sum(s.missing for s in shortfalls(g.tolist(), need, dev.memory.tolist(),
                                                dev.pools or None))
    step = simulate_step(net, grid, work.step_shape(splits),
                         tasklet_seconds(work, grid, dev.flops, splits))
    return Scored([list(map(int, r)) for r in g], list(splits), step, missing)


# --- the split for a fixed grid ---

def all_splits(n_layers: int, stages: int) -> list[list[int]]:
    """Every way to cut `n_layers` into `stages` contiguous non-empty ranges."""
    return [[b - a for a, b in zip((0, *cuts), (*cuts, n_layers), strict=True)]
            for cuts in itertools.combinations(range(1, n_layers), stages - 1)]


def _proportional(n_layers: int, speeds: Sequence[float]) -> list[int]:
    """Layers proportional to `speeds` (largest remainder), at least one each."""
    s = len(speeds)
    share = np.asarray(speeds) / np.sum(speeds) * (n_layers - s)
    counts = np.floor(share).astype(int) + 1
    for j in np.argsort(-(share - np.floor(share)), kind="stable")[: n_layers - counts.sum()]:
        counts[j] += 1
    return counts.tolist()


def _minmax(work: Workload, speeds: Sequence[float], fits: np.ndarray) -> list[int] | None:
    """The split minimising the slowest stage's compute (then their sum), by a DP over
    contiguous ranges; ranges that do not fit memory (`fits[j, b, e]` False) are excluded."""
    n, s, spec = work.spec.n_layers, work.stages, work.spec
    best: dict[tuple[int, int], tuple[float, float, list[int]]] = {(0, 0): (0.0, 0.0, [])}
    for j in range(s):
        for e in range(j + 1, n - (s - j - 1) + 1):
            options = []
            for b in range(j, e):
                prev = best.get((j, b))
                if prev is None or not fits[j, b, e]:
                    continue
                c = stage_flops(spec, b, e, 1.0, work.lora_rank, work.lora_targets) / speeds[j]
                options.append((max(prev[0], c), prev[1] + c, [*prev[2], e - b]))
            if options:
                best[(j + 1, e)] = min(options)
    found = best.get((s, n))
    return found[2] if found else None


def _fits_table(work: Workload, dev: Devices, grid: np.ndarray) -> np.ndarray:
    """fits[j, b, e]: every device of stage j can hold layers [b, e)."""
    n, shape = work.spec.n_layers, work.memory()
    fits = np.ones((work.stages, n + 1, n + 1), dtype=bool)
    for j in range(work.stages):
        avail = dev.memory[grid[j]]
        cap = avail[avail > 0].min() if (avail > 0).any() else None
        if cap is None:
            continue
        for b in range(n):
            for e in range(b + 1, n + 1):
                fits[j, b, e] = stage_bytes(shape, j, b, e) <= cap
    return fits


def _moves(splits: list[int], thorough: bool) -> list[list[int]]:
    """Splits one layer away: from stage a to stage b (all pairs, or neighbours only)."""
    s, out = len(splits), []
    for a in range(s):
        for b in range(s):
            if a == b or splits[a] == 1 or (not thorough and abs(a - b) != 1):
                continue
            moved = list(splits)
            moved[a] -= 1
            moved[b] += 1
            out.append(moved)
    return out


def _climb(net: Network, grid: Sequence[Sequence[int]], work: Workload, dev: Devices,
           start: Scored, thorough: bool) -> Scored:
    best, seen = start, {tuple(start.splits)}
    improved = True
    while improved:
        improved = False
        for splits in _moves(best.splits, thorough):
            if tuple(splits) in seen:
                continue
            seen.add(tuple(splits))
            cand = score(net, grid, work, dev, splits)
            if cand.key < best.key:
                best, improved = cand, True
    return best


def best_split(net: Network, grid: Sequence[Sequence[int]], work: Workload, dev: Devices, *,
               start: Sequence[int] | None = None, thorough: bool = True,
               exhaustive: int = EXHAUSTIVE_SPLITS) -> Scored:
    """The layer split of `grid` with the shortest simulated step among those that fit.

    `thorough=False` with a `start`: only climb from it, by one layer between neighbours
    (what the grid search uses to compare many grids quickly)."""
    n, s = work.spec.n_layers, work.stages
    if math.comb(n - 1, s - 1) <= exhaustive:
        return min((score(net, grid, work, dev, sp) for sp in all_splits(n, s)),
                   key=lambda c: c.key)
    if start is not None and not thorough:
        return _climb(net, grid, work, dev, score(net, grid, work, dev, list(start)), False)
    g = np.asarray(grid, dtype=np.int64)
    speeds = dev.flops[g].min(axis=1)
    starts = [list(start)] if start is not None else []
    starts += [layer_splits(n, s), _proportional(n, speeds)]
    dp = _minmax(work, speeds, _fits_table(work, dev, g))
    if dp is not None:
        starts.append(dp)
    unique = list(dict.fromkeys(tuple(x) for x in starts))
    return min((_climb(net, grid, work, dev, score(net, grid, work, dev, list(x)), thorough)
                for x in unique), key=lambda c: c.key)


# --- the grid ---

def _by_speed(grid: np.ndarray, flops: np.ndarray, descending: bool) -> np.ndarray:
    """Each pipeline (column) reordered so that row j holds its j-th fastest device."""
    out = grid.copy()
    for k in range(grid.shape[1]):
        col = grid[:, k]
        order = np.argsort(-flops[col] if descending else flops[col], kind="stable")
        out[:, k] = col[order]
    return out


def _swaps(grid: np.ndarray, dev: Devices) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Position pairs worth swapping: devices of different speed, or a device of a memory
    pool that holds two or more of the grid's tasklets and one outside it (so a heavy stage
    can leave a crowded machine); inside a pipeline first."""
    s, r = grid.shape
    flops = dev.flops
    crowded: set[str] = set()
    if dev.pools:
        held = [dev.pools[d] for d in grid.reshape(-1) if dev.pools[d]]
        crowded = {p for p in held if held.count(p) > 1}

    def worth(a: int, b: int) -> bool:
        if abs(flops[a] - flops[b]) > SPEED_TOLERANCE / 2 * flops[a]:
            return True
        pa, pb = (dev.pools[a], dev.pools[b]) if dev.pools else ("", "")
        return pa != pb and bool({pa, pb} & crowded)

    cells = [(j, k) for j in range(s) for k in range(r)]
    pairs = [(p, q) for p, q in itertools.combinations(cells, 2) if worth(grid[p], grid[q])]
    return sorted(pairs, key=lambda pq: pq[0][1] != pq[1][1])


@dataclass(frozen=True)
class Placed:
    """The plan `plan_split` chose, with how many (grid, split) candidates it scored."""

    best: Scored
    evaluated: int
    reason: str


def place_for_compute(net: Network, grid: Sequence[Sequence[int]], work: Workload,
                      dev: Devices, *, budget: int = 150,
                      seconds: float | None = None) -> Placed:
    """Refine `grid` (from the communication-only search) for compute and memory."""
    t0, g0 = time.perf_counter(), np.asarray(grid, dtype=np.int64)
    cands = [g0, _by_speed(g0, dev.flops, True), _by_speed(g0, dev.flops, False)]
    best = min((best_split(net, c, work, dev, thorough=False) for c in cands),
               key=lambda c: c.key)
    evaluated, improved = len(cands), True
    while improved and evaluated < budget:
        improved = False
        cur = np.asarray(best.grid)
        for p, q in _swaps(cur, dev):
            if evaluated >= budget or (seconds is not None and time.perf_counter() - t0 > seconds):
                break
            cand = cur.copy()
            cand[p], cand[q] = cur[q], cur[p]
            scored = best_split(net, cand, work, dev, start=best.splits, thorough=False)
            evaluated += 1
            if scored.key < best.key:
                best, improved = scored, True
                break
    final = best_split(net, best.grid, work, dev, start=best.splits)
    return Placed(min(best, final, key=lambda c: c.key), evaluated, "compute-aware")


def even_is_enough(grid: Sequence[Sequence[int]], work: Workload, dev: Devices) -> bool:
    """The devices are alike and every one holds its stage of the even split."""
    need = stages_bytes(work.memory(), None)
    return dev.alike() and not shortfalls(grid, need, dev.memory.tolist(), dev.pools or None)


def plan_split(net: Network, grid: Sequence[Sequence[int]], work: Workload, dev: Devices, *,
               move: bool = True, budget: int = 150, seconds: float | None = None) -> Placed:
    """The grid and layer split a job runs: the paper's when devices are alike and fit.

    `move=False` keeps the grid (a pinned, rank-order or random placement) and only splits."""
    even = score(net, grid, work, dev, layer_splits(work.spec.n_layers, work.stages))
    if even_is_enough(grid, work, dev):
        return Placed(even, 1, "even: the devices are alike")
    if not move:
        found = best_split(net, grid, work, dev, start=even.splits)
        return Placed(min(even, found, key=lambda c: c.key), 1, "split for a fixed placement")
    placed = place_for_compute(net, grid, work, dev, budget=budget, seconds=seconds)
    return placed if placed.best.key < even.key else Placed(even, placed.evaluated, "even")
