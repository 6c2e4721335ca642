"""The one place that knows how (stage, replica) maps to ranks, like torchtitan's ParallelDims.

Conventions used everywhere in dtfm: a plan is a grid `grid[stage][replica] -> device`, pipeline
`k` runs `grid[0][k] -> grid[1][k] -> ...`, and in a worker world `rank = replica * stages +
stage`. No other module does rank arithmetic; they ask a `Layout`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dtfm.core.words import stages_x_replicas


@dataclass(frozen=True)
class Layout:
    """A job's parallel shape: `stages` pipeline stages times `replicas` data-parallel copies."""

    stages: int
    replicas: int

    def __post_init__(self) -> None:
        if self.stages < 1 or self.replicas < 1:
            raise ValueError(
                f"a layout needs at least 1 stage and 1 replica, got stages={self.stages} "
                f"replicas={self.replicas}"
            )

    @property
    def text(self) -> str:
        """For people: "2 stages x 1 replica"."""
        return stages_x_replicas(self.stages, self.replicas)

    @property
    def world_size(self) -> int:
        return self.stages * self.replicas

    def rank(self, stage: int, replica: int) -> int:
        if not (0 <= stage < self.stages and 0 <= replica < self.replicas):
            raise ValueError(f"(stage={stage}, replica={replica}) is outside {self}")
        return replica * self.stages + stage

    def coords(self, rank: int) -> tuple[int, int]:
        """(stage, replica) of a rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        return rank % self.stages, rank // self.stages

    def stage_of(self, rank: int) -> int:
        return self.coords(rank)[0]

    def replica_of(self, rank: int) -> int:
        return self.coords(rank)[1]

    def dp_ranks(self, stage: int) -> list[int]:
        """Ranks holding `stage`: its data-parallel group, in replica order."""
        return [self.rank(stage, r) for r in range(self.replicas)]

    def pipeline_ranks(self, replica: int) -> list[int]:
        """Ranks of pipeline `replica`, first stage first."""
        return [self.rank(s, replica) for s in range(self.stages)]

    def prev_rank(self, rank: int) -> int | None:
        stage, replica = self.coords(rank)
        return None if stage == 0 else self.rank(stage - 1, replica)

    def next_rank(self, rank: int) -> int | None:
        stage, replica = self.coords(rank)
        return None if stage == self.stages - 1 else self.rank(stage + 1, replica)

    def is_first(self, rank: int) -> bool:
        return self.stage_of(rank) == 0

    def is_last(self, rank: int) -> bool:
        return self.stage_of(rank) == self.stages - 1

    def devices_by_rank(self, grid: Sequence[Sequence[int | str]]) -> list[int | str]:
        """Flatten a plan grid (grid[stage][replica] -> device) into rank order."""
        if len(grid) != self.stages or any(len(row) != self.replicas for row in grid):
            raise ValueError(
                f"grid shape {len(grid)}x{len(grid[0]) if grid else 0} does not match "
                f"{self.text}"
            )
        return [grid[self.stage_of(r)][self.replica_of(r)] for r in range(self.world_size)]


def layer_splits(n_layers: int, stages: int, splits: Sequence[int] | None = None) -> list[int]:
    """Layers per stage: as even as possible (earlier stages take the remainder), or `splits`.

    24 layers on 5 stages gives [5, 5, 5, 5, 4].
    """
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if stages > n_layers:
        raise ValueError(
            f"cannot split {n_layers} layers into {stages} stages: use at most {n_layers} stages"
        )
    if splits is not None and len(splits) > 0:
        splits = list(splits)
        if len(splits) != stages or sum(splits) != n_layers or min(splits) < 1:
            raise ValueError(
                f"layer splits {splits} must have {stages} entries, each >= 1, summing to "
                f"{n_layers}"
            )
        return splits
    base, extra = divmod(n_layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def layer_ranges(
    n_layers: int, stages: int, splits: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """[begin, end) layer range of every stage."""
    ranges, begin = [], 0
    for count in layer_splits(n_layers, stages, splits):
        ranges.append((begin, begin + count))
        begin += count
    return ranges


def pipeline_ops(kind: str, stage: int, stages: int, micro: int) -> list[tuple[str, int]]:
    """The ("F"|"B", micro-batch) sequence one stage runs in one step.

    The worker runs exactly this order and the step-time model simulates it, so both live
    here. GPipe: every forward, then every backward. 1F1B: S - stage - 1 warm-up forwards,
    then one forward and one backward alternately, then the remaining backwards.
    """
    if kind == "gpipe":
        return [("F", i) for i in range(micro)] + [("B", i) for i in range(micro)]
    if kind != "1f1b":
        raise ValueError(f"unknown schedule {kind!r}; use 'gpipe' or '1f1b'")
    return one_f_one_b(min(stages - stage - 1, micro), micro)


def one_f_one_b(warmup: int, micro: int) -> list[tuple[str, int]]:
    """`warmup` forwards, then one forward and one backward alternately, then the remaining
    backwards: a stage holds at most `warmup` + 1 micro-batches' activations."""
    ops = [("F", i) for i in range(warmup)]
    for i in range(micro - warmup):
        ops += [("F", warmup + i), ("B", i)]
    return ops + [("B", i) for i in range(micro - warmup, micro)]


def delayed_warmup(stage: int, stages: int, micro: int) -> int:
    """Warm-up forwards of a stage whose pipeline does not flush between steps: as deep as
    2BW's two weight copies allow (the step before's last backward must come before the
    step after next's first forward: at most `micro`), each stage one less than the one
    before it (so a stage's gradient always comes from a slot its successor already ran),
    none on the last stage. With fewer micro-batches than stages - 1, 1F1B's own."""
    if stage == stages - 1:
        return 0
    return min(micro, max(stages - stage - 1, micro - stage))


def delayed_step_ops(stage: int, stages: int, micro: int, *, carried: bool,
                     flush: bool) -> list[tuple[str, int, int]]:
    """The ("F"|"B", step offset, micro-batch) sequence one stage runs in one step of a
    pipeline that does not flush between steps (`--pipeline-delay 1`, PipeDream-2BW).

    The steps between two flushes run as one pipeline over all their micro-batches: a step's
    warm-up forwards (`delayed_warmup`: deeper than 1F1B's where the micro-batches allow, so
    more of them are in flight while the links' delays pass) interleave with the previous
    step's cool-down backwards (offset -1) instead of waiting for them, and only a `flush`
    step runs its own cool-down (the previous step's last backward thus comes after this
    step's first forwards: 2BW trains each step on the weights from two steps before,
    `agent/worker/delayed.py`). `delayed_run_ops` is the same sequence over whole runs,
    which the step model replays.
    """
    warmup = delayed_warmup(stage, stages, micro)
    if carried:
        ops = [op for j in range(warmup)
               for op in (("F", 0, j), ("B", -1, micro - warmup + j))]
    else:
        ops = [("F", 0, j) for j in range(warmup)]
    for i in range(micro - warmup):
        ops += [("F", 0, warmup + i), ("B", 0, i)]
    if flush:
        ops += [("B", 0, i) for i in range(micro - warmup, micro)]
    return ops


def delayed_run_ops(stage: int, stages: int, micro: int, steps: int) -> list[tuple[str, int]]:
    """`steps` steps of `delayed_step_ops`, the last flushing, with micro-batch indices
    counted across them (step t's micro-batch i is t * micro + i): `one_f_one_b` over
    steps x micro micro-batches with `delayed_warmup`'s warm-up."""
    return [(op, (t + off) * micro + i) for t in range(steps)
            for op, off, i in delayed_step_ops(stage, stages, micro, carried=t > 0,
                                               flush=t == steps - 1)]
