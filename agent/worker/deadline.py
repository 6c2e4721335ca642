"""How long the worker's next collective or pipeline receive may block before it gives up.

Owns one decision: the timeout of each `Work.wait` (`errors.wait_all`). It must be short
enough that a frozen peer (a SIGSTOPped or swapped-out worker whose sockets stay open, so no
connection error ever arrives) is noticed in seconds, and long enough that a big model on a
slow device, a checkpoint save or ordinary jitter never trips it. One fixed value cannot be
both: 300 s took five minutes to notice a frozen peer of a 30 ms step, and a 1.3B-parameter
stage on a CPU can need longer than that for its first step. So:

- **Start-up** (joining is bounded by the ceiling: gloo's rendezvous, or on the dtfm
  transport each peer's first connection, `transport.peer.Peer.joining`; then resuming, the
  first steps): before `Policy.warm_steps` steps are measured, a budget that scales with the
  model: a floor
  (`startup_base_s`), plus a multiple of the time this device would need to run one
  replica's whole step alone (6 FLOPs per parameter and token over the FLOP/s measured
  here), plus an allowance per GB of the largest stage's checkpointed state (weights and
  AdamW moments: loading, verifying and saving them scales with their size).
- **Steady**: `step_multiple` x the slowest of the last `window` measured steps. A step is
  the time between two step ends on this rank, so it already includes every wait for the
  slowest peer. The very first step (allocations, lazy connections) is not counted.
- **After a checkpoint**: a replica writing a checkpoint makes its peers wait in their next
  step, and the interval after a save includes the saves of the peers. Such intervals are
  kept apart (they would inflate the steady value for a whole window); the waits that follow
  a checkpoint get `step_multiple` x the slowest of them, or, before one was measured, the
  steady value plus an allowance for the save (`step_multiple` x this rank's measured save,
  or `per_gb_s` x the largest stage's state, whichever is larger).

Every value is clamped between `floor_s` (ordinary jitter: a GC pause, a busy core, a
retransmission) and the ceiling, `DTFM_TIMEOUT_S`: the operator's bound on any wait, which is
also the process groups' own timeout (gloo's collectives cannot outlive it in any case). When
the operator sets no ceiling it is 300 s, or the model's start-up budget when that is larger,
so a big model on a slow device is not failed by a default meant for small ones.

Each value comes with the reason it was chosen (`Wait.why`); a `PeerError` quotes it, so a
timeout says "12 s = 8 x the slowest of the last 20 steps (1.5 s)", not just a number.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch

from dtfm.core.spec import ModelSpec

log = logging.getLogger(__name__)

DEFAULT_CEILING_S = 300.0  # without DTFM_TIMEOUT_S (raised to the start-up budget if larger)
# at a sync point of local steps, a replica up to this many times slower over the round is
# waited for, not taken for frozen (its pace over the round is not this rank's to see)
SLOWER_REPLICA = 3.0
FLOPS_PER_PARAM_TOKEN = 6.0  # forward + backward of a dense matmul, per weight and token
STATE_BYTES_PER_PARAM = 12  # fp32 weights + AdamW's two moments: what a checkpoint holds
GB = 1e9


@dataclass(frozen=True)
class Policy:
    """The knobs of the decision (see the module docstring for what each is for)."""

    ceiling_s: float = DEFAULT_CEILING_S
    floor_s: float = 10.0
    step_multiple: float = 8.0
    warm_steps: int = 3  # measured steps (after the first) before the steady value applies
    window: int = 20  # recent steps the steady value looks at
    startup_base_s: float = 60.0
    startup_compute_multiple: float = 4.0
    per_gb_s: float = 30.0  # seconds per GB of stage state (load, verify, save, copy)

    def __post_init__(self) -> None:
        if not (0 < self.floor_s <= self.ceiling_s and math.isfinite(self.ceiling_s)):
            raise ValueError(f"timeout floor {self.floor_s} s and ceiling {self.ceiling_s} s "
                             f"must satisfy 0 < floor <= ceiling (DTFM_TIMEOUT_S sets the "
                             f"ceiling: give it at least {self.floor_s:g})")
        if self.step_multiple < 1 or self.warm_steps < 1 or self.window < 1:
            raise ValueError("step_multiple must be >= 1, warm_steps and window >= 1")

    def clamp(self, seconds: float, why: str) -> Wait:
        """`seconds` between the floor and the ceiling, the reason saying which bound won."""
        if seconds < self.floor_s:
            return Wait(self.floor_s, f"{self.floor_s:g} s, the floor ({why} = "
                                      f"{_s(seconds)} is less)")
        if seconds > self.ceiling_s:
            return Wait(self.ceiling_s, f"{self.ceiling_s:g} s, the ceiling DTFM_TIMEOUT_S "
                                        f"({why} = {_s(seconds)} is more)")
        return Wait(seconds, f"{_s(seconds)} = {why}")


@dataclass(frozen=True)
class Wait:
    """How long one wait may block, and why that long."""

    seconds: float
    why: str


@dataclass(frozen=True)
class Startup:
    """The model's start-up budget before clamping, in its parts (seconds)."""

    base_s: float
    compute_s: float  # one replica's whole step on this device, alone
    compute_multiple: float
    state_gb: float  # the largest stage's checkpointed state
    per_gb_s: float
    flops: float

    @property
    def seconds(self) -> float:
        return (self.base_s + self.compute_multiple * self.compute_s
                + self.per_gb_s * self.state_gb)

    def why(self) -> str:
        return (f"the start-up budget {self.base_s:g} s + {self.compute_multiple:g} x "
                f"{_s(self.compute_s)} (one replica's step alone on this device at "
                f"{self.flops / 1e9:.3g} GFLOP/s) + {self.per_gb_s:g} s/GB x "
                f"{self.state_gb:.3g} GB of stage state")


def startup(policy: Policy, *, params: int, largest_stage_params: int, tokens: int,
            flops: float) -> Startup:
    """The start-up budget of a model of `params` parameters whose largest stage holds
    `largest_stage_params`, training `tokens` tokens per replica and step, on a device of
    `flops` FLOP/s."""
    if not flops > 0:
        raise ValueError(f"device speed must be > 0 FLOP/s, got {flops}")
    return Startup(
        base_s=policy.startup_base_s,
        compute_s=FLOPS_PER_PARAM_TOKEN * params * tokens / flops,
        compute_multiple=policy.startup_compute_multiple,
        state_gb=largest_stage_params * STATE_BYTES_PER_PARAM / GB,
        per_gb_s=policy.per_gb_s,
        flops=flops,
    )


def ceiling(operator_s: float | None, budget: Startup) -> float:
    """The ceiling: the operator's DTFM_TIMEOUT_S, else 300 s or the start-up budget if larger."""
    if operator_s is not None:
        return operator_s
    return max(DEFAULT_CEILING_S, math.ceil(budget.seconds))


class Deadline:
    """Tracks this rank's step times and answers how long the next wait may block.

    The worker calls `start()` when its training loop begins, `step_finished()` after every
    optimizer step and `checkpoint(saved_s)` after every step at which a checkpoint was due
    (on every rank, also on those that do not write one: their peers may be writing).
    """

    def __init__(self, policy: Policy, budget: Startup | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy, self.budget, self._clock = policy, budget, clock
        self._steps: deque[float] = deque(maxlen=policy.window)
        self._after_save: deque[float] = deque(maxlen=policy.window)
        self._mark: float | None = None
        self._first_done = False
        self._saved: float | None = None  # this rank's last save (0: another replica wrote)
        self._pending_save = False  # a checkpoint was due since the last step ended
        self._round = 0  # > 0: this step ends a round of this many local steps (sync_point)
        self._pinned = "the ceiling DTFM_TIMEOUT_S (too low to adapt under it)"
        self._current: Wait | None = None  # until the next report: every wait asks for it

    @classmethod
    def fixed(cls, seconds: float) -> Deadline:
        """Always `seconds` (tests, and code that runs outside a worker)."""
        deadline = cls(Policy(ceiling_s=seconds, floor_s=seconds))
        deadline._pinned = "fixed"
        return deadline

    @property
    def ceiling(self) -> timedelta:
        return timedelta(seconds=self.policy.ceiling_s)

    # ---- what the worker reports ----
    def start(self) -> None:
        self._mark = self._clock()
        self._current = None

    def step_finished(self) -> None:
        now = self._clock()
        if self._mark is not None:
            interval = now - self._mark
            if not self._first_done:
                self._first_done = True  # one-off costs: not a measure of the step
            elif self._pending_save:
                self._after_save.append(interval)
            else:
                self._steps.append(interval)
        self._mark, self._pending_save, self._round = now, False, 0
        self._current = None

    def checkpoint(self, saved_s: float | None) -> None:
        """A checkpoint was due after the step that just finished; `saved_s` is how long this
        rank took to write its own, None when another replica writes it."""
        self._pending_save = True
        self._saved = saved_s or 0.0
        self._current = None

    def sync_point(self, every: int = 1) -> None:
        """A round of `every` local steps ends here (`--sync-every`, agent/worker/outer.py):
        the replicas now exchange a stage's worth of bytes that the round's other steps never
        send, so the waits from here to the next step end get the allowance a step after a
        checkpoint gets, and this step is measured with those, apart from the steady ones.

        And the replicas ran the round apart: a replica on slower links or a slower device
        reaches the sync point later by the round's accumulated difference, not a step's
        (bench/sync.py, H = 64: a replica 20+ s behind read as frozen under 8 x a 2.9 s step).
        So the wait also allows a peer up to SLOWER_REPLICA times this rank's pace over the
        round."""
        self._pending_save = True
        self._round = max(every, 1)
        self._current = None

    # ---- the decision ----
    @property
    def measured(self) -> bool:
        return len(self._steps) + len(self._after_save) >= self.policy.warm_steps

    def current(self) -> Wait:
        """How long the next wait may block, and why: decided once per report, since every
        pipeline receive and collective of a step asks and the reason is formatted text."""
        if self._current is None:
            self._current = self._decide()
        return self._current

    def _decide(self) -> Wait:
        p = self.policy
        if p.floor_s >= p.ceiling_s:
            return Wait(p.ceiling_s, f"{p.ceiling_s:g} s, {self._pinned}")
        if not self.measured:
            if self.budget is None:
                return Wait(p.ceiling_s, f"{p.ceiling_s:g} s, the ceiling DTFM_TIMEOUT_S "
                                         f"(no step measured yet)")
            return p.clamp(self.budget.seconds, self.budget.why())
        if not self._steps:  # a checkpoint after every step: each step followed one
            return self._after_checkpoint(0.0)
        slowest = max(self._steps)
        steady = p.clamp(p.step_multiple * slowest, f"{p.step_multiple:g} x the slowest of "
                         f"the last {len(self._steps)} steps ({_s(slowest)})")
        if not self._pending_save:
            return steady
        waits = [steady, self._after_checkpoint(slowest)]
        if self._round > 1:
            behind = (SLOWER_REPLICA - 1) * self._round * slowest
            waits.append(p.clamp(p.step_multiple * slowest + behind,
                                 f"{p.step_multiple:g} x the slowest recent step "
                                 f"({_s(slowest)}) + a replica {SLOWER_REPLICA:g}x slower over "
                                 f"this round of {self._round} steps ({_s(behind)})"))
        return max(waits, key=lambda w: w.seconds)

    def _after_checkpoint(self, slowest: float) -> Wait:
        p = self.policy
        if self._after_save:
            worst = max(self._after_save)
            return p.clamp(p.step_multiple * worst, f"{p.step_multiple:g} x the slowest of "
                           f"the last {len(self._after_save)} steps that followed a "
                           f"checkpoint ({_s(worst)})")
        own = p.step_multiple * (self._saved or 0.0)
        state_gb = self.budget.state_gb if self.budget else 0.0
        by_size = p.per_gb_s * state_gb
        if own >= by_size:
            allowance = f"{p.step_multiple:g} x this rank's checkpoint save ({_s(self._saved)})"
        else:
            allowance = f"{p.per_gb_s:g} s/GB x {state_gb:.3g} GB of stage state to save"
        return p.clamp(p.step_multiple * slowest + max(own, by_size),
                       f"{p.step_multiple:g} x the slowest recent step ({_s(slowest)}) + "
                       f"{allowance}")


def for_stages(spec: ModelSpec, ranges: list[tuple[int, int]], tokens: int, flops: float,
               operator_s: float | None, floor_s: float = Policy.floor_s) -> Deadline:
    """The deadline of a worker of `spec` cut into stages `ranges`, training `tokens` tokens
    per replica and step on a device of `flops` FLOP/s, under the operator's ceiling
    `operator_s` (DTFM_TIMEOUT_S; None: not set), waiting at least `floor_s` (the dtfm
    transport's: a pair elsewhere in the pipeline may be moving to its relay)."""
    largest = max(spec.stage_params(b, e) for b, e in ranges)
    budget = startup(Policy(), params=spec.param_count(), largest_stage_params=largest,
                     tokens=tokens, flops=flops)
    top = ceiling(operator_s, budget)
    policy = Policy(ceiling_s=top, floor_s=min(max(Policy.floor_s, floor_s), top))
    if budget.seconds > top:
        log.warning("the start-up budget (%s = %.0f s) exceeds DTFM_TIMEOUT_S = %g s: a first "
                    "step slower than that fails; raise DTFM_TIMEOUT_S (agent local --timeout)",
                    budget.why(), budget.seconds, top)
    return Deadline(policy, budget)


def operator_ceiling(raw: str | None) -> float | None:
    """DTFM_TIMEOUT_S as seconds, None when unset or empty."""
    if raw is None or not raw.strip():
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"DTFM_TIMEOUT_S={raw!r}: give the longest any collective or pipeline "
                         f"receive may block, in seconds > 0 (agent local --timeout)")
    return value


def measure_flops(device: torch.device, seconds: float = 0.05, n: int = 256) -> float:
    """Sustained fp32 matmul FLOP/s of `device` with this process's torch threads, briefly.

    Only sizes the start-up budget: a device that is busy right now reads slow, which makes
    the budget more generous, never less.
    """
    a = torch.randn(n, n, device=device)
    b = a @ a  # warm-up: thread pool, allocator
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        b = a @ a
        done += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    del b
    return 2.0 * n**3 * done / (time.perf_counter() - t0)


def _s(seconds: float | None) -> str:
    """Seconds to 3 significant digits, whole seconds from 100 on: "0.0312 s", "1.5 s",
    "5787 s"."""
    value = seconds or 0.0
    return f"{value:.0f} s" if value >= 100 else f"{value:.3g} s"
