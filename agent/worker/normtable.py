"""The pipelines' squared gradient norms, compared across a stage's replicas at the digest.

Why: the global gradient norm that clips a step is summed from the squared norms every stage
of one pipeline sends the others (`World.pipeline_exchange`). After a synchronous step all
replicas of a stage hold the same averaged gradient, to the bit, so every pipeline's stage s
sends the same squared norm. A pipeline whose stage s sent another one (a rank that got
another average from an equivocating owner, a drifted one, or one that lies about its norm)
clips every stage of that pipeline with another coefficient, and their weights then differ
from their replicas': the weights digest of an honest stage t found that rank of pipeline j
odd, and named it, for what its pipeline's stage s sent (seen in the test of an owner that
sent one receiver another average: the receiver's pipeline partner was excluded).

So every replica keeps, for each synchronous step since the last digest, the squared norms
its pipeline exchanged, in stage order, and they travel with the weights digest
(`World.dp_gather`, point to point: a replica can lie about its own row only). Where the odd
replica's pipeline held, at another stage, a value that a strict majority of the stage's
replicas' pipelines did not, its weights differ for that value (`differing`): the worker
names that pipeline's rank of stage s instead (`norm_differs`). The exchange cannot tell a
lie about a norm from an honest norm of a gradient some owner altered, so the coordinator
confirms it only once that rank's own stage's records of the same digest explain nothing
(coordinator/integrity/explained.py: a dispute of an average it got, or a rollback that
takes the step back). Values travel as
float64, the bits each rank computed, so honest pipelines' rows agree exactly. With local
steps (`--sync-every`) replicas differ between sync points and nothing is kept.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

MAX_STEPS = 16  # steps kept for the next digest (DIGEST_EVERY is 10)


@dataclass
class NormTable:
    """One replica's pipeline's squared norms over the synchronous steps since a digest."""

    stages: int
    _rows: deque[list[float]] = field(default_factory=lambda: deque(maxlen=MAX_STEPS))

    def add(self, step: int, squares: Sequence[float]) -> None:
        """The squared norms its pipeline exchanged at `step`, in stage order."""
        if len(squares) != self.stages:
            raise ValueError(f"{len(squares)} squared norms for a pipeline of {self.stages} "
                             f"stages")
        self._rows.append([float(step), *map(float, squares)])

    def take(self) -> list[float]:
        """The kept rows, flat, for `World.dp_gather` (the same length on every replica of
        a stage: they step together); spent."""
        flat = [v for row in self._rows for v in row]
        self._rows.clear()
        return flat


def differing(rows: Sequence[Sequence[float]], stages: int, replica: int
              ) -> list[tuple[int, int]]:
    """(step, stage) where pipeline `replica`'s squared norm differs from the one that a
    strict majority of `rows` (every replica's `NormTable.take`, in dp-group order) hold at
    that step and stage; none where no majority exists, or the rows do not line up."""
    width = 1 + stages
    n = len(rows[replica]) if 0 <= replica < len(rows) else 0
    if not n or n % width or any(len(r) != n for r in rows):
        return []
    out = []
    for at in range(0, n, width):
        if any(r[at] != rows[replica][at] for r in rows):
            continue  # not the same step: not comparable
        for s in range(stages):
            counts = Counter(r[at + 1 + s] for r in rows)
            value, count = counts.most_common(1)[0]
            if 2 * count > len(rows) and rows[replica][at + 1 + s] != value:
                out.append((int(rows[replica][at]), s))
    return out
