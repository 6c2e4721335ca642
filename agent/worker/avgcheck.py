"""The receivers' check of an averaged shard (`--verify full` / `robust`, `--dp-mode sharded`).

Owns what a replica can tell about the averages the shards' owners send back to it. In
`sharded` mode owner k sums every replica's copy of shard k, divides by R and sends the
result to every peer; an owner that alters it (a faulty GPU, a hostile volunteer) is not
caught by the weights digest, because every replica applies the same wrong update. The
receiver holds two things to check it with, at no extra bytes and no extra memory:

- its own copy x of shard k (its gradient, still in `p.grad` when the averages arrive: the
  averager writes the means back only after the check, `data_parallel.GradAverager.check`);
  an honest mean contains x with weight 1/R;
- the averages of every other owner (and its own, as an owner), of the same step.

Per step and owner, over all buckets, `AverageChecker` scores

- `cosine`: the average's cosine with the receiver's own copy. An honest mean contains x / R
  and honest copies share the true gradient's direction, so it is positive but for rare
  steps; a sign-flipped average is its negative;
- `norm`: the average's RMS over the median RMS of the other owners' averages (which cancels
  the step's overall gradient scale), over that same ratio's median in this owner's last
  `HISTORY` admitted steps (which cancels what the shard's position holds: one owner's slice
  of each bucket may carry larger gradients than another's, by 13x measured). A step joins
  the reference only near it (`ADMIT_NORM`, `ADMIT_SHAPE`), so an attack that starts under
  the threshold does not become the reference. Only against two other averages or more
  (`MIN_REFERENCE`; at R = 2 the one other average is the receiver's own, too noisy a
  reference: honest ratios up to 13 measured; uneven shares can leave two owners at any R);
- `shape`: the same, for L1 / (sqrt(n) L2): Gaussian noise flattens a heavy-tailed gradient;
- `zero`: all zeros while the receiver's own copy is not; `stale`: its squared norm and sum
  equal, bit for bit, one of the same owner's last `STALE_STEPS` averages.

Zero and stale have no honest look-alike, and no bad *input* can cause them (a zero or
replayed copy among R inputs moves the mean by 1/R, it does not zero or replay it): they
name the owner. The three statistics can be moved by a bad contributor's copy as much as by
a bad owner (a x10 copy makes every honest owner's mean about 10/R times larger), so they
are evidence about the average, not proof against its owner; a receiver skips them in a step
where its own shard's scoring found a bad copy (`judge(..., inputs_suspect=True)`). What
tells a bad owner from a bad input exactly is the replicas' audit of the mean's identity
(`avgaudit.py`), judged at the weights digest. The
thresholds are measured on honest training (bench/avgcheck.py; docs/architecture.md, "The
averaged shard").
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch

from agent.worker.gradscore import Finding, median

# Thresholds (bench/avgcheck.py, gpt-tiny and gpt-mini, R = 2, 3, 4, 2 sequences per replica:
# the noisiest a job trains with). Honest range -> threshold -> attacked averages:
COSINE_MIN = -0.8  # honest >= -0.67 (gpt-mini R = 4); a flip gives -(honest): caught when
#                    the honest cosine is over 0.8, most steps
NORM_HIGH = 16.0  # honest <= 10 (gpt-mini R = 3); x10 gives 10x the honest ratio
NORM_LOW = 0.05  # honest >= 0.075
SHAPE_HIGH = 4.0  # honest <= 3.0; 1 sigma noise 0.7..11
HISTORY = 8  # unflagged steps of each owner's ratios kept as its reference
MIN_HISTORY = 3  # before this many, only cosine, zero and stale are judged
# other averages of the step (the receiver's own among them) a norm or shape is taken
# against: one is too noisy a reference (honest ratios up to 13 at R = 2). Uneven shares
# (`dp_shares`, scheduled placement) can leave a stage two owners at any R, and a receiver
# that owns nothing then has one: seen at 4.1-4.6x shape on an honest owner, 4 x 4 world
MIN_REFERENCE = 2
# A step's ratios join the reference only inside this band around it: an attack that starts
# small enough to pass the thresholds must not become the reference it is judged against
ADMIT_NORM, ADMIT_SHAPE = (0.5, 2.0), 1.5
STALE_STEPS = 8
SELF_EVIDENT = frozenset({"avg_zero", "avg_stale"})


@dataclass(frozen=True)
class AverageScore:
    """One owner's averaged shard, as one receiver saw it over one step."""

    owner: int  # the owner's index in the dp group
    cosine: float
    norm: float  # NaN until the owner has MIN_HISTORY unflagged steps
    shape: float
    zero: bool = False
    stale: bool = False


@dataclass(frozen=True)
class Dots:
    """One bucket's figures of an owner's average a and my copy x: |a|^2, <a, x>, |x|^2
    (NaN where no copy was given)."""

    average_sq: float
    mine: float
    mine_sq: float


@dataclass
class _Sums:
    dot: float = 0.0  # average . my copy
    a_sq: float = 0.0
    x_sq: float = 0.0
    a_sum: float = 0.0
    a_l1: float = 0.0
    n: int = 0


@dataclass
class AverageChecker:
    """Accumulates one step's averaged shards at one receiver; `scores` closes the step."""

    size: int
    me: int
    _sums: dict[int, _Sums] = field(default_factory=dict)
    _ratios: dict[int, deque[tuple[float, float]]] = field(default_factory=dict)
    _prints: dict[int, deque[tuple[float, float]]] = field(default_factory=dict)

    def add(self, owner: int, average: torch.Tensor, mine: torch.Tensor | None) -> Dots:
        """One bucket's averaged shard from `owner`, and my own copy of it (None: none
        given; my own average counts as a reference for the others' whether or not). The
        dots it took, which the averages' audit reads instead of taking them again
        (avgaudit.py)."""
        a = average.detach().reshape(-1).float()
        s = self._sums.setdefault(owner, _Sums())
        sq = float(torch.dot(a, a))
        s.a_sq += sq
        s.a_sum += float(a.sum())
        s.a_l1 += float(torch.linalg.vector_norm(a, 1))
        s.n += a.numel()
        if mine is None:
            return Dots(sq, math.nan, math.nan)
        x = mine.detach().reshape(-1).float()
        dots = Dots(sq, float(torch.dot(a, x)), float(torch.dot(x, x)))
        if owner != self.me:  # my own shard's copy is no evidence about my average
            s.dot += dots.mine
            s.x_sq += dots.mine_sq
        return dots

    def scores(self) -> list[AverageScore]:
        """This step's score of every other owner's average (none: nothing arrived)."""
        sums, self._sums = self._sums, {}
        stats = {k: (math.sqrt(s.a_sq / s.n), s.a_l1 / math.sqrt(s.n * s.a_sq))
                 for k, s in sums.items() if s.n and s.a_sq > 0}
        out = []
        for k, s in sums.items():
            if k == self.me:
                continue
            prints = self._prints.setdefault(k, deque(maxlen=STALE_STEPS))
            fingerprint = (s.a_sq, s.a_sum)
            stale = s.a_sq > 0 and fingerprint in prints
            prints.append(fingerprint)
            zero = s.a_sq == 0 and s.x_sq > 0
            cosine = s.dot / math.sqrt(s.a_sq * s.x_sq) if s.a_sq and s.x_sq else 1.0
            norm = shape = math.nan
            others = [v for j, v in stats.items() if j != k]
            if k in stats and len(others) >= MIN_REFERENCE:
                ratio = (stats[k][0] / median([v[0] for v in others]),
                         stats[k][1] / median([v[1] for v in others]))
                held = self._ratios.setdefault(k, deque(maxlen=HISTORY))
                if len(held) >= MIN_HISTORY:
                    norm = ratio[0] / median([h[0] for h in held])
                    shape = ratio[1] / median([h[1] for h in held])
                if len(held) < MIN_HISTORY or _admit(norm, shape):
                    held.append(ratio)
            out.append(AverageScore(k, cosine, norm, shape, zero=zero, stale=stale))
        return out


def _admit(norm: float, shape: float) -> bool:
    return ADMIT_NORM[0] <= norm <= ADMIT_NORM[1] and shape <= ADMIT_SHAPE


def judge(scores: list[AverageScore], *, inputs_suspect: bool = False,
          statistics: bool = True) -> list[Finding]:
    """The findings of one step's average scores (`replica`: the owner's index).
    `inputs_suspect`: this receiver's own shard scoring found a bad copy this step, which
    skews every honest owner's mean, so only the self-evident checks run; so too without
    `statistics` (local steps: the averages are of pseudo-gradients, not measured)."""
    out: list[Finding] = []
    for s in scores:
        if (found := _exact(s)) is not None:
            out.append(found)
        elif not inputs_suspect and statistics and (found := _statistic(s)) is not None:
            out.append(found)
    return out


Check = tuple[bool, str, float, str]  # failed, kind, score, detail


def _first(owner: int, checks: tuple[Check, ...]) -> Finding | None:
    return next((Finding(owner, kind, score, detail)
                 for failed, kind, score, detail in checks if failed), None)


def _exact(s: AverageScore) -> Finding | None:
    """A zeroed or replayed average, as a finding, else None."""
    return _first(s.owner, (
        (s.zero, "avg_zero", 0.0, "the averaged shard it sent back is all zeros, and my own "
         "copy of it is not"),
        (s.stale, "avg_stale", 1.0, "the averaged shard it sent back repeats, bit for bit, "
         f"one of its last {STALE_STEPS}"),
    ))


def _statistic(s: AverageScore) -> Finding | None:
    """The first of the three statistics `s` fails, as a finding, else None."""
    return _first(s.owner, (
        (s.cosine < COSINE_MIN, "avg_cosine", s.cosine,
         f"the averaged shard's cosine with my own copy is {s.cosine:.3g} (honest: >= "
         f"{COSINE_MIN}; an honest mean holds my copy with weight 1/R)"),
        (not NORM_LOW <= s.norm <= NORM_HIGH and not math.isnan(s.norm), "avg_norm", s.norm,
         f"the averaged shard's RMS against the other owners' is {s.norm:.3g}x what it was "
         f"in its last steps (honest: {NORM_LOW}..{NORM_HIGH})"),
        (s.shape > SHAPE_HIGH, "avg_noise", s.shape,
         f"the averaged shard's L1/L2 shape against the other owners' is {s.shape:.3g}x "
         f"what it was in its last steps (honest: <= {SHAPE_HIGH}; added noise flattens it)"),
    ))
