"""R >= 3: a gradient copy's direction and its quiet energy judged over a window of steps.

Why a window: one step of an honest copy can look like an attack, and an attack is there at
every step.

- **Direction.** The one-step check (`gradscore.judge`, `grad_cosine`: a copy's best cosine
  with any other copy below `gradscore.COSINE_MIN`) was set on 20 steps. Over 1000 honest steps
  of gpt-tiny 2 x 3 at 2 sequences per replica (bench/honest.py with `DTFM_VERIFY_TRACE`; the
  smallest batch, the widest honest spread) 1878 of 18000 honest copies had a best cosine below
  0: 6 % of them in the first 200 steps, 16 % in the last 200 (a trained model's gradients at
  a tiny batch are nearly orthogonal). Every one was a record of evidence against an honest
  agent. Judged on the median of a copy's last `WINDOW` (5) steps instead, honest medians went
  down to -0.124 (0.1st percentile -0.064), and 3 of 17928 windows were below
  `WINDOW_COSINE_MIN` (-0.1). A copy sent with its sign flipped points away from every honest
  copy each step, so its window's median is as negative as one step of it, from the attack's
  third step on. Direction never confirms a fault (coordinator/integrity/corroborate.py): a
  copy scaled by -4 is caught by its norm at every step; this only keeps the evidence honest.
- **Quiet energy** (`gradscore.quiet_shares`, noise of about one sigma): one honest step's
  ratio reached 4.8x the median copy's, a 5-step window's median 2.22x at most, while noised
  copies' window medians sat at 1.5-3.2x and above (5th percentiles; docs/architecture.md,
  "Noise in dense buckets"); `gradscore.QUIET_HIGH` judges the window's median.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from agent.worker.gradscore import CopyScore, median
from dtfm.core.verify import COPY_WINDOW

WINDOW = COPY_WINDOW  # steps a copy's direction and quiet energy are judged over (R = 2: 9)
WINDOW_COSINE_MIN = -0.1  # the window median's threshold: honest >= -0.124 in 17928 windows


class ScoreWindow:
    """One owner's copies' best cosines and quiet-energy ratios over the last `window` steps,
    by replica."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._held: dict[int, deque[tuple[float, float]]] = {}

    def smooth(self, scores: list[CopyScore]) -> list[CopyScore]:
        """`scores` with each copy's cosine and quiet ratio replaced by its window's medians
        (1.0 each, no verdict, until the window is full)."""
        out = []
        for s in scores:
            held = self._held.setdefault(s.replica, deque(maxlen=self.window))
            held.append((s.cosine, s.quiet))
            full = len(held) == self.window
            out.append(replace(s, cosine=median([c for c, _ in held]) if full else 1.0,
                               quiet=median([q for _, q in held]) if full else 1.0))
        return out
