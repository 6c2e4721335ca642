"""What crossed this rank's pipeline links, as this end saw it: the figures the coordinator
checks both ends of every link against (coordinator/integrity/linkwitness.py).

Owns the tally of one step's messages (`LinkTally`: the sum of squares and the count of what
this rank sent and received, activations forward and their gradients back) and the window
medians the step events carry (`LinkWindows`). A sender's figure is taken of the tensor it
puts on the wire before any codec, a receiver's of the tensor it decoded: a codec's rounding
moves the two far less than `linkwitness.AGREE_TOL`. The sums stay on the device until the
step ends (one read a step, not one synchronisation per message).

Windows end at steps that are multiples of `LINK_WINDOW`, counted from step 0 of the job, so
every rank of an epoch reports the same windows, a resumed run too; a window is reported when
at least `MIN_STEPS` of its steps were trained here (a run resumed mid-window has fewer).
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from dtfm.core.limits import finite
from dtfm.core.verify import LINK_WINDOW

FIGURES = ("act_out", "act_in", "grad_out", "grad_in")  # linkwitness.FIGURES, in this order
MIN_STEPS = 3
LARGEST = 1e300  # a non-finite figure (overflow, NaN) as sent: the wire takes finite ones


class LinkTally:
    """One step's sums of squares and counts, by figure."""

    def __init__(self) -> None:
        self._ss: dict[str, torch.Tensor] = {}
        self._n: dict[str, int] = {}
        self.spent_s = 0.0  # seconds in `add` (the checks' cost: replicacheck.py reads it)

    def add(self, figure: str, t: torch.Tensor) -> None:
        t0 = time.perf_counter()
        ss = t.detach().float().square().sum()
        self._ss[figure] = self._ss[figure] + ss if figure in self._ss else ss
        self._n[figure] = self._n.get(figure, 0) + t.numel()
        self.spent_s += time.perf_counter() - t0

    def merge(self, other: LinkTally) -> None:
        """Fold in `other`'s messages (a step tallied apart, `Pipeline.delayed_step`)."""
        for f, ss in other._ss.items():
            self._ss[f] = self._ss[f] + ss if f in self._ss else ss
            self._n[f] = self._n.get(f, 0) + other._n[f]
        self.spent_s += other.spent_s

    def take(self) -> list[float]:
        """The step's root mean square per figure (NaN: nothing on that link), and reset."""
        out = [finite(math.sqrt(float(self._ss[f]) / self._n[f]), LARGEST)
               if self._n.get(f) else math.nan for f in FIGURES]
        self._ss, self._n = {}, {}
        return out


class LinkWindows:
    """Per-step figures gathered into windows of `LINK_WINDOW` steps."""

    def __init__(self) -> None:
        self._steps: list[list[float]] = []

    def add(self, step: int, figures: list[float], last: int) -> list[float]:
        """Fold in `step`'s figures; the window's medians when `step` ends one (every
        `LINK_WINDOW`th step, and `last`, the job's last), else []."""
        self._steps.append(figures)
        if step % LINK_WINDOW and step != last:
            return []
        steps, self._steps = self._steps, []
        if len(steps) < MIN_STEPS:
            return []
        out = []
        for i in range(len(FIGURES)):
            values = [s[i] for s in steps if not math.isnan(s[i])]
            out.append(statistics.median(values) if values else math.nan)
        return out
