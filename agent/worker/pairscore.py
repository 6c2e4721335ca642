"""R = 2: whether the two replicas' copies of a gradient shard disagree, judged over a window.

Owns the pair check behind `grad_disagree` (docs/architecture.md, "Integrity: replica
checks"). With R >= 3 `gradscore.judge` compares each copy with the median copy, one step at
a time. With two copies there is no median, and one step of two honest copies is too noisy
to judge: measured on the suite's and the demo's jobs (gpt-tiny and gpt-mini, 4 stages, 4 or
8 sequences per replica; bench/integrity.py --replicas 2 --score-stages 4), one honest
step's copies differed in norm by up to 8x (a batch with a loss spike), had cosines down to
-0.57 (small batches late in training) and a shape up to 2x their mean's (a bucket of
embedding rows one batch never touched; `gradscore` now leaves those out and, at R = 2,
measures shape over each copy's non-zeros: up to 1.58 remained) -- each past what x10, x-4
or 1-sigma noise give on some steps. An honest outlier lasts a few steps; an attack is there
at every step. So each step's pair scores go into a window of the last `PAIR_WINDOW` (9)
steps, and the pair disagrees when the window's median is past a limit. A window of 5 was
too short: a tiny Qwen2 imported and fine-tuned at lr 1e-2, 4 sequences of 32 per replica
(tests/system/test_wan_export.py's job), had one copy 6-19x the other's norm at 4 steps in a
row early in training, and window medians of 5.96 (norm), -0.62 (cosine) and 1.39 (shape)
in 2 of 4 seeds' 300 steps; over 9 steps the worst were 2.79, -0.22 and 1.28:

- norm: the median of log(a's norm ratio / b's): signed, so that honest outliers on either
  side cancel and a copy scaled at every step does not;
- cosine: the median of the two copies' cosine;
- shape: the median of each copy's worst-bucket shape over the two's mean.

The limits below are from the honest distribution of these window medians, with margin.
A disagreement names nobody (either copy may be the wrong one): a `Finding` with replica -1,
kind `grad_disagree`, for the coordinator to settle (coordinator/integrity/dispute.py).
Needs `PAIR_WINDOW` steps of a worker's run before the first verdict.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from agent.worker.gradscore import CopyScore, Finding, median
from dtfm.core.verify import PAIR_WINDOW

# Window medians over 9 steps, honest (gpt-tiny 4 stages x 4 sequences, 200 steps; the
# Qwen2 import above, 2 stages, 4 x 300 steps; bench/integrity.py and DTFM_VERIFY_TRACE)
# -> limit -> attacked (gpt-tiny):
PAIR_NORM = 3.0  # norm ratio, either way: honest <= 1.71 / 2.79; x10 >= 5.83
PAIR_COSINE = -0.5  # honest >= -0.11 / -0.22; x-4 p5 -0.79 (and its norm ratio)
PAIR_SHAPE = 1.35  # honest <= 1.18 / 1.28; 1 sigma noise 1.08..1.46


@dataclass(frozen=True)
class PairScore:
    """A window's medians: norm ratio (a's over b's), cosine, and each copy's shape."""

    norm_ratio: float
    cosine: float
    shape_a: float
    shape_b: float


@dataclass
class PairJudge:
    """One owner's pair check over a run: `judge` each step's two scores."""

    window: int = PAIR_WINDOW
    _steps: deque[tuple[float, float, float, float]] = field(default_factory=deque)
    last: PairScore | None = None  # the latest full window's medians

    def judge(self, scores: list[CopyScore]) -> list[Finding]:
        """This step's finding (at most one, undecided) from the last `window` steps."""
        if len(scores) != 2:
            return []
        a, b = scores
        log_ratio = math.log(max(a.norm_ratio, 1e-12) / max(b.norm_ratio, 1e-12))
        self._steps.append((log_ratio, a.cosine, a.shape, b.shape))
        while len(self._steps) > self.window:
            self._steps.popleft()
        if len(self._steps) < self.window:
            return []
        lr, cos, sa, sb = (median(list(col)) for col in zip(*self._steps, strict=True))
        self.last = PairScore(math.exp(lr), cos, sa, sb)
        ratio, shape, over = math.exp(abs(lr)), max(sa, sb), f"over the last {self.window} steps"
        if ratio > PAIR_NORM:
            why, score = (f"one copy's norm is {ratio:.3g}x the other's (median {over}; "
                          f"limit {PAIR_NORM})", ratio)
        elif cos < PAIR_COSINE:
            why, score = f"the copies' cosine is {cos:.3g} (median {over}; limit " \
                f"{PAIR_COSINE})", cos
        elif shape > PAIR_SHAPE:
            why, score = (f"one copy's L1/L2 shape is {shape:.3g}x their mean's (median "
                          f"{over}; limit {PAIR_SHAPE})", shape)
        else:
            return []
        return [Finding(-1, "grad_disagree", score, f"{why}; with 2 replicas either may be "
                        f"the wrong one")]
