"""Watching a running job for drift: its step lastingly slower than its plan expects.

Owns the verdict "the network or a device changed under this job, and whose": the job feeds
every member's heartbeat (step time and its split: compute, pipeline wait, data-parallel sync)
into a `DriftWatch`, which keeps one point per observed step (the members' median; heartbeats
sample steps that are faster than they are) and compares a sliding window of them with what
the step should take. What it should take is the larger of the step model's prediction and the
step the epoch settled on (the median of its first `window` points): the model is within about
10 % on the emulated world, and a settled job that the model under-predicts must not look
drifted from its first step.

A verdict needs every point of the window slower than that by more than `threshold` (a
fraction), so a blip shorter than the window never fires. Each member's split over the window
against its settled split names the suspects: a member whose compute grew by the threshold (of
its own compute, and of the step) has a slower device; members whose waits (pipeline +
data-parallel) grew by the threshold of a step have links that may have changed, unless the
devices that slowed explain the step's growth.
Once a verdict is acted on (a re-plan decided either way), `accept` takes the drifted figures
as the new normal, so only a further change fires again: a flapping link does not make
flapping plans. Pure logic with no clock, so tests feed it series.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sample:
    """One member's report of one step (seconds)."""

    step_s: float
    compute_s: float
    pp_wait_s: float
    dp_s: float

    @property
    def wait_s(self) -> float:
        return self.pp_wait_s + self.dp_s


@dataclass(frozen=True)
class Drift:
    """A lasting gap between the measured and the expected step, and whom it points at."""

    at_step: int
    expected_s: float  # max(the model's prediction, the settled step)
    settled_s: float  # the step the epoch settled on
    measured_s: float  # the window's median step
    devices: dict[str, tuple[float, float]]  # agent -> compute per step (settled, now)
    links: list[str]  # agents whose waits grew, most first
    pipeline: bool  # the pipeline waits grew more than the data-parallel sync
    window: int

    @property
    def suspects(self) -> list[str]:
        return list(self.devices) + [a for a in self.links if a not in self.devices]

    def describe(self) -> str:
        what = [f"step {self.measured_s:.2f} s over the last {self.window} steps seen, "
                f"expected {self.expected_s:.2f} s (settled at {self.settled_s:.2f} s)"]
        if self.devices:
            what.append("compute slower on " + ", ".join(
                f"{a} ({b:.2f} -> {n:.2f} s)" for a, (b, n) in self.devices.items()))
        if self.links:
            kind = "pipeline waits" if self.pipeline else "data-parallel sync"
            what.append(f"{kind} grew on {', '.join(self.links)}")
        return "; ".join(what)


@dataclass
class _Settled:
    step_s: float
    compute_s: dict[str, float] = field(default_factory=dict)
    wait_s: dict[str, float] = field(default_factory=dict)


class DriftWatch:
    """The sliding window over one epoch's steps, and the verdict (`check`)."""

    def __init__(self, threshold: float, window: int) -> None:
        if threshold <= 0 or window < 2:
            raise ValueError(f"drift threshold must be > 0 and window >= 2 steps, got "
                             f"{threshold} and {window}")
        self.threshold = threshold
        self.window = window
        self.predicted_s = 0.0
        self._points: OrderedDict[int, dict[str, Sample]] = OrderedDict()
        self._settled: _Settled | None = None
        self._hold_until = 0  # no verdict before this step

    def start_epoch(self, predicted_step_s: float) -> None:
        """A new plan trains: forget the old one's steps, settle again."""
        self.predicted_s = predicted_step_s
        self._points.clear()
        self._settled = None
        self._hold_until = 0

    def observe(self, agent: str, step: int, sample: Sample) -> None:
        """One member's heartbeat (steady steps only: the job skips step 1's warm-up)."""
        if sample.step_s <= 0 or (self._points and step < next(iter(self._points))):
            return
        self._points.setdefault(step, {})[agent] = sample
        self._points = OrderedDict(sorted(self._points.items()))
        while len(self._points) > 4 * self.window:
            self._points.popitem(last=False)
        if self._settled is None and len(self._points) > self.window:
            # the first `window` points; the newest may still be filling
            self._settled = self._figures(list(self._points)[:self.window])

    @property
    def settled_s(self) -> float:
        """The step the epoch settled on (0 before it has)."""
        return self._settled.step_s if self._settled else 0.0

    def expected_s(self) -> float:
        return max(self.predicted_s, self.settled_s)

    def recent_s(self) -> float:
        """The median step over the newest window of points (0 before there are enough)."""
        steps = self._window()
        return statistics.median(self._step_of(s) for s in steps) if steps else 0.0

    def check(self) -> Drift | None:
        """The drift, if every point of the window is slower than expected by the threshold."""
        steps = self._window()
        if self._settled is None or not steps or steps[0] < self._hold_until:
            return None
        limit = self.expected_s() * (1.0 + self.threshold)
        if any(self._step_of(s) <= limit for s in steps):
            return None
        now = self._figures(steps)
        settled = self._settled
        # a device is slower when its compute grew by the threshold of its own and of the
        # step: a tiny stage's compute doubling from 0.02 s is noise, not a slower device
        floor = self.threshold * self.expected_s()
        devices = {a: (settled.compute_s[a], c) for a, c in now.compute_s.items()
                   if a in settled.compute_s
                   and c > settled.compute_s[a] * (1.0 + self.threshold)
                   and c - settled.compute_s[a] > floor}
        grew = now.step_s - settled.step_s
        explained = devices and max(n - b for b, n in devices.values()) >= 0.5 * grew
        waits = {a: w - settled.wait_s[a] for a, w in now.wait_s.items()
                 if a in settled.wait_s}
        links = [] if explained else sorted(
            (a for a, g in waits.items() if g > self.threshold * self.expected_s()),
            key=lambda a: -waits[a])
        pp = sum(self._member_median(steps, a, "pp_wait_s") for a in links)
        dp = sum(self._member_median(steps, a, "dp_s") for a in links)
        return Drift(at_step=steps[-1], expected_s=self.expected_s(),
                     settled_s=settled.step_s, measured_s=now.step_s, devices=devices,
                     links=links, pipeline=pp >= dp, window=self.window)

    def accept(self, hold_steps: int = 0) -> None:
        """Take the newest window as the new normal (a verdict was acted on), and give no
        verdict for `hold_steps` steps."""
        steps = self._window()
        if steps:
            self._settled = self._figures(steps)
            self._hold_until = steps[-1] + 1 + hold_steps

    # --- helpers ---
    def _window(self) -> list[int]:
        """The newest `window` points, leaving out the newest while other members may still
        report it (it holds fewer members than the point before)."""
        steps = list(self._points)
        if len(steps) >= 2 and len(self._points[steps[-1]]) < len(self._points[steps[-2]]):
            steps = steps[:-1]
        return steps[-self.window:] if len(steps) >= self.window else []

    def _step_of(self, step: int) -> float:
        return statistics.median(s.step_s for s in self._points[step].values())

    def _member_median(self, steps: list[int], agent: str, what: str) -> float:
        values = [getattr(self._points[s][agent], what) for s in steps
                  if agent in self._points[s]]
        return statistics.median(values) if values else 0.0

    def _figures(self, steps: list[int]) -> _Settled:
        agents = {a for s in steps for a in self._points[s]}
        return _Settled(
            step_s=statistics.median(self._step_of(s) for s in steps),
            compute_s={a: self._member_median(steps, a, "compute_s") for a in agents},
            wait_s={a: self._member_median(steps, a, "pp_wait_s")
                    + self._member_median(steps, a, "dp_s") for a in agents})
