"""R >= 3: a gradient copy's direction judged over a window of steps, not one step.

Why: the one-step check (`gradscore.judge`, `grad_cosine`: a copy's best cosine with any other
copy below `gradscore.COSINE_MIN`) was set on 20 steps. Over 1000 honest steps of gpt-tiny
2 x 3 at 2 sequences per replica (bench/honest.py with `DTFM_VERIFY_TRACE`; the smallest batch,
the widest honest spread) 1878 of 18000 honest copies had a best cosine below 0: 6 % of them
in the first 200 steps, 16 % in the last 200 (a trained model's gradients at a tiny batch are
nearly orthogonal). Every one was a record of evidence against an honest agent, about two a
step, which buried anything real in `coordinator status`. Judged on the median of a copy's
last `DIRECTION_WINDOW` (5) steps instead, honest medians went down to -0.124 (0.1st percentile
-0.064), and 3 of 17928 windows were below `WINDOW_COSINE_MIN` (-0.1). An attack is there at
every step: a copy sent with its sign flipped points away from every honest copy each step,
so its window's median is as negative as one step of it, from the attack's third step on.
Direction never confirmed a fault (coordinator/integrity/corroborate.py): a copy scaled by -4
is caught by its norm at every step; this only keeps the evidence honest.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from agent.worker.gradscore import CopyScore, median

DIRECTION_WINDOW = 5  # steps a copy's direction is judged over (R = 2's pair check: 9)
WINDOW_COSINE_MIN = -0.1  # the window median's threshold: honest >= -0.124 in 17928 windows


class DirectionWindow:
    """One owner's copies' best cosines over the last `window` steps, by replica."""

    def __init__(self, window: int = DIRECTION_WINDOW) -> None:
        self.window = window
        self._cosines: dict[int, deque[float]] = {}

    def smooth(self, scores: list[CopyScore]) -> list[CopyScore]:
        """`scores` with each copy's cosine replaced by its window's median (1.0, no verdict,
        until the window is full)."""
        out = []
        for s in scores:
            held = self._cosines.setdefault(s.replica, deque(maxlen=self.window))
            held.append(s.cosine)
            out.append(replace(s, cosine=median(list(held)) if len(held) == self.window
                               else 1.0))
        return out
