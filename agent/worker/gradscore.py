"""Scoring every replica's copy of a gradient shard at its owner, and robust averages of them.

Owns the numbers behind `--verify full` (docs/architecture.md, "Integrity: replica checks"):
in `sharded` mode a shard's owner holds each replica's copy of its shard before it averages
them (`data_parallel.GradAverager.inspect`). Honest replicas see different data, so honest
copies differ; what they share is a scale, a direction and a shape. Over a step's buckets the
owner accumulates each copy's squared norm, the copies' pairwise dot products, and per bucket
each copy's norm and shape against the median copy's (one bad copy cannot move a median when
R >= 3). Per step, each copy gets

- `norm_ratio`: per bucket, its norm over the median of the copies' norms; the median of that
  over the buckets (an honest copy is large in a few buckets, a scaled one in all);
- `cosine`: its best cosine with any other copy, over the whole shard. With at most one bad
  copy among R >= 3 an honest copy always has an honest partner, whose cosine is positive;
  a sign-flipped copy has none. (The issue's cosine against the coordinate-wise median was
  measured too: honest copies went down to 0.24 and x-4 copies up to 0.32, overlapping.)
- `shape`: per bucket, its L1 / (sqrt(m) L2) over the median copy's, worst bucket; m is n,
  or with R = 2 the copy's non-zero count (embedding rows of tokens a batch did not hold are
  zeros, and two honest copies hold different rows: a sparsity, not a shape, that no third
  copy outvotes). Gradients are heavy-tailed (a low ratio); Gaussian noise of their own sigma
  flattens them (higher);
- `stale`: its squared norm and sum bit-identical to what the same replica sent at one of
  the last `STALE_STEPS` steps (honest gradients of fresh data never repeat; a replayed copy
  does, exactly);
  `zero`: all zeros (no honest gradient of a touched shard is);
- `quiet` (R >= 3): per bucket, the share of its energy in the bucket's quiet coordinates
  (the `QUIET_SHARE` of coordinates whose median magnitude over the copies is smallest) over
  the median copy's share; the median of that over the buckets. Honest gradients, and the
  sampling noise between honest copies, are loud and quiet in the same coordinates (a
  parameter's gradient scale is the model's, not the batch's); added noise is as loud
  everywhere, so half or more of its energy lands where honest copies are quiet. It catches
  noise of one sigma in dense buckets, where `shape` moves by 1.1-1.3x only (bench/integrity.py
  --scores, gpt-tiny 4 x 4 at 8 sequences per replica: noise flagged at 8 % of owner-steps by
  shape). One step is noisy (honest up to 4.8x); the worker judges its window median
  (`scorewindow.py`, `QUIET_HIGH`).

`judge` turns scores into `Finding`s with the thresholds below, measured on honest training
(bench/integrity.py --scores; the numbers are in docs/architecture.md). With R = 2 nobody can
be named from a disagreement of the two copies (either may be the bad one), and one step is
too noisy to judge: `pairscore.PairJudge` judges a window of steps (`grad_disagree`, replica
-1, for the coordinator to settle); a zero or stale copy names its sender at any R, since no
honest replica sends one. A bucket where one copy is all zeros (embedding rows of tokens its
batch did not hold) has no shape to compare and is left out of the shape score.

Robust aggregation (`--verify robust`): `centered_clip` (Karimireddy et al., 2021) from the
coordinate-wise median, clipping each copy's distance to the median distance.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch

# Thresholds, from honest training at the smallest batch a replica trains on (gpt-tiny, 2
# sequences per replica, R = 3: the widest honest spread measured; bench/integrity.py
# --scores; the table is in docs/architecture.md). Honest range -> threshold -> attacks:
NORM_HIGH = 3.0  # norm ratio: honest 0.48..1.75; x10 gives >= 3.8
NORM_LOW = 0.05  # honest >= 0.245 beside a x10 copy (gpt-mini); all zeros: `grad_zero`
COSINE_MIN = 0.0  # best cosine with another copy: honest >= 0.137; x-4 gives <= -0.087
SHAPE_HIGH = 2.5  # L1/L2 shape ratio, worst bucket: honest <= 2.16; 1 sigma noise 1.4..4.3
QUIET_SHARE = 0.25  # the quietest quarter of a bucket's coordinates (0.5, 0.75, 0.9 separated
# less: docs/architecture.md, "Noise in dense buckets")
QUIET_SAMPLE = 4096  # coordinates the quiet cut is read off
QUIET_HIGH = 2.0  # quiet-energy ratio, a 5-step window's median: honest <= 2.22, 1 sigma
# noise >= 1.12 (p5 1.49..3.21) over gpt-tiny / gpt-mini, R = 3..5, 2..8 sequences a replica
STALE_STEPS = 8  # a copy equal to one of the same replica's last 8 is stale


@dataclass(frozen=True)
class CopyScore:
    """One replica's copy of the owner's shard, scored over one step."""

    replica: int  # its index in the dp group
    norm_ratio: float
    cosine: float
    stale: bool = False
    zero: bool = False
    shape: float = 1.0  # its L1 / (sqrt(n) L2) over the median copy's (noise raises it)
    quiet: float = 1.0  # its energy share in quiet coordinates over the median copy's


@dataclass(frozen=True)
class Finding:
    """A copy that failed a check: `replica` is its index in the dp group (-1: undecided)."""

    replica: int
    kind: str  # grad_norm, grad_cosine, grad_noise, grad_zero, grad_stale, grad_disagree
    score: float
    detail: str


def median(values: list[float]) -> float:
    """The median of `values` (even count: the middle two's mean)."""
    v, n = sorted(values), len(values)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def coordinate_median(copies: list[torch.Tensor]) -> torch.Tensor:
    """The coordinate-wise median of equally shaped copies (even R: the middle two's mean)."""
    x = torch.stack([c.float() for c in copies])
    r = x.shape[0]
    if r <= 2:
        return x.mean(0)
    s = x.sort(0).values
    return s[r // 2] if r % 2 else (s[r // 2 - 1] + s[r // 2]) / 2


def centered_clip(copies: list[torch.Tensor], iters: int = 3) -> torch.Tensor:
    """CenteredClip from the coordinate-wise median: each step moves the centre by the mean
    of the copies' offsets, each offset clipped to the median offset's length, so one copy
    of any size moves the result by at most tau / R a step."""
    v = coordinate_median(copies)
    for _ in range(iters):
        offsets = [c.float() - v for c in copies]
        lengths = torch.stack([o.norm() for o in offsets])
        tau = float(lengths.median())
        if tau == 0.0:
            break
        v = v + sum(o * min(1.0, tau / max(float(n), 1e-30))
                    for o, n in zip(offsets, lengths, strict=True)) / len(copies)
    return v.to(copies[0].dtype)


def quiet_shares(magnitudes: torch.Tensor, sq: list[float]) -> list[float]:
    """Each copy's share of its squared norm in the `QUIET_SHARE` of coordinates where the
    copies are quietest (R >= 3; `magnitudes`: the copies' absolute values stacked, R x n,
    squared in place: a bucket's temporaries are most of the scoring's time; `sq`: their
    squared norms). A coordinate's loudness is the copies' magnitudes' mean
    without the largest and the smallest (the median at R = 3 and 4, at an elementwise
    cost: one bad copy cannot move it); the cut is read off an evenly strided sample of at
    most `QUIET_SAMPLE` coordinates (a sort of every coordinate cost 10x the rest)."""
    x = magnitudes
    loudness = (x.sum(0) - x.amax(0) - x.amin(0)) / (x.shape[0] - 2)
    sample = loudness[::max(1, loudness.numel() // QUIET_SAMPLE)]
    cut = sample.kthvalue(max(1, int(sample.numel() * QUIET_SHARE))).values
    quiet = (loudness <= cut).to(x.dtype)
    energy = torch.mv(x.square_(), quiet).tolist()  # one pass: each copy's quiet energy
    return [e / total if total else 0.0 for e, total in zip(energy, sq, strict=True)]


@dataclass
class ShardScorer:
    """Accumulates one step's buckets at their owner; `scores` closes the step."""

    size: int
    sq: list[float] = field(default_factory=list)  # each copy's squared norm, all buckets
    dots: list[list[float]] = field(default_factory=list)  # pairwise dot products
    norm_ratios: list[list[float]] = field(default_factory=list)  # per bucket, per copy
    shape_ratios: list[list[float]] = field(default_factory=list)
    quiet_ratios: list[list[float]] = field(default_factory=list)
    # (bucket, replica) -> fingerprints of its copies at the last STALE_STEPS steps
    _last: dict[tuple[int, int], deque[tuple[float, float]]] = field(default_factory=dict)
    _stale: set[int] = field(default_factory=set)
    _seen: bool = False

    def __post_init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        r = self.size
        self.sq, self.dots = [0.0] * r, [[0.0] * r for _ in range(r)]
        self.norm_ratios, self.shape_ratios = [[] for _ in range(r)], [[] for _ in range(r)]
        self.quiet_ratios = [[] for _ in range(r)]
        self._stale, self._seen = set(), False

    def add(self, bucket: int, copies: list[torch.Tensor]) -> None:
        """Score one bucket's copies of the owner's shard (replica order)."""
        # the copies stacked (R x n) and read in a few whole passes: per bucket, a dozen
        # small tensor calls instead of one per pair of copies and per figure (the scoring
        # was most of the checks' time, docs/benchmarks.md)
        x = torch.stack([c.detach().reshape(-1).float() for c in copies])
        r, n = self.size, x.shape[1]
        gram: list[list[float]] = torch.mm(x, x.t()).tolist()
        totals = x.sum(1).tolist()
        sq = [gram[k][k] for k in range(r)]
        norms = [math.sqrt(max(v, 0.0)) for v in sq]
        # R = 2: over each copy's own non-zeros. Rows of tokens one batch held and the other's
        # did not are sparsity, not shape, and the pair's mean has no third copy to outvote
        # it (R >= 3 keeps n: noise filling a sparse bucket's zeros is caught there)
        support = torch.count_nonzero(x, dim=1).tolist() if r == 2 else [n] * r
        mag = x.abs_()  # the stack is ours: its magnitudes in place, x is spent
        l1 = mag.sum(1).tolist()
        shapes = [a / (math.sqrt(m) * nk) if nk else 0.0
                  for a, m, nk in zip(l1, support, norms, strict=True)]
        mnorm, mshape = median(norms), median(shapes)
        quiet = quiet_shares(mag, sq) if r >= 3 and min(norms) > 0 else []
        mquiet = median(quiet) if quiet else 0.0
        for k in range(self.size):
            self.sq[k] += gram[k][k]
            for j in range(self.size):
                self.dots[k][j] += gram[k][j]
            if mnorm > 0:  # a bucket nobody's batch touched says nothing
                self.norm_ratios[k].append(norms[k] / mnorm)
            if min(norms) > 0:  # one copy all zeros (embedding rows of tokens its batch
                # did not hold): no shape to compare, the other's is not "flat" for that
                self.shape_ratios[k].append(shapes[k] / mshape)
            if mquiet > 0:
                self.quiet_ratios[k].append(quiet[k] / mquiet)
            fingerprint = (gram[k][k], totals[k])
            held = self._last.setdefault((bucket, k), deque(maxlen=STALE_STEPS))
            if gram[k][k] and fingerprint in held:
                self._stale.add(k)
            held.append(fingerprint)
        self._seen = True

    def scores(self) -> list[CopyScore]:
        """This step's score of each copy (empty: the owner held no shard), then a new step."""
        if not self._seen:
            return []
        out = []
        for k in range(self.size):
            cosines = [self.dots[k][j] / math.sqrt(self.sq[k] * self.sq[j])
                       for j in range(self.size) if j != k and self.sq[k] and self.sq[j]]
            out.append(CopyScore(
                k, median(self.norm_ratios[k]) if self.norm_ratios[k] else 1.0,
                max(cosines) if cosines else 0.0, stale=k in self._stale,
                zero=self.sq[k] == 0.0,
                shape=max(self.shape_ratios[k]) if self.shape_ratios[k] else 1.0,
                quiet=median(self.quiet_ratios[k]) if self.quiet_ratios[k] else 1.0))
        self._reset()
        return out


def judge(scores: list[CopyScore], cosine_min: float = COSINE_MIN) -> list[Finding]:
    """The findings of one step's scores, with the module's thresholds (`cosine_min`: the
    worker's is a window median's, `scorewindow.WINDOW_COSINE_MIN`; `quiet` is judged only as
    a window's median: `scorewindow.ScoreWindow` leaves it at 1.0 until its window is full)."""
    out: list[Finding] = []
    for s in scores:  # self-evident at any R: no honest replica sends these
        if s.zero:
            out.append(Finding(s.replica, "grad_zero", 0.0, "its copy of the shard is all "
                               "zeros"))
        elif s.stale:
            out.append(Finding(s.replica, "grad_stale", 1.0, "its copy repeats, bit for bit, "
                               f"one it sent in the last {STALE_STEPS} steps"))
    if out or len(scores) < 3:  # R = 2: `pairscore.PairJudge`, over a window of steps
        return out
    for s in scores:
        if not NORM_LOW <= s.norm_ratio <= NORM_HIGH:
            out.append(Finding(s.replica, "grad_norm", s.norm_ratio,
                               f"its norm is {s.norm_ratio:.3g}x the median copy's (honest: "
                               f"{NORM_LOW}..{NORM_HIGH})"))
        elif s.cosine < cosine_min:
            out.append(Finding(s.replica, "grad_cosine", s.cosine,
                               f"its best cosine with any other copy is {s.cosine:.3g} "
                               f"(honest: >= {cosine_min})"))
        elif s.shape > SHAPE_HIGH:
            out.append(Finding(s.replica, "grad_noise", s.shape,
                               f"its L1/L2 shape is {s.shape:.3g}x the median copy's in one "
                               f"bucket (honest: <= {SHAPE_HIGH}; added noise flattens a "
                               f"gradient's heavy tails)"))
        elif s.quiet > QUIET_HIGH:
            out.append(Finding(s.replica, "grad_noise", s.quiet,
                               f"its share of energy where the copies are quiet is {s.quiet:.3g}x "
                               f"the median copy's, over its last steps (honest: <= "
                               f"{QUIET_HIGH}; added noise is as loud where honest gradients "
                               f"are quiet)"))
    return out

