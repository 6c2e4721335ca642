"""The replicas' exact audit of the owners' averaged shards (`--verify full`, `sharded`, exact).

Why: an owner that alters the average it sends back (x10, noise) moves every receiver's view
of it as much as an honest owner's mean moves when one of its inputs is bad, so the
receivers' statistics (`avgcheck.py`) are evidence, never proof. But a mean has an identity
that its inputs' owners can check together: if owner k averaged copies c_1..c_R into a_k,

    sum_i <c_i, a_k> = R <a_k, a_k>.

Each replica knows its own copy's dot with every owner's average; each owner knows every
copy it received. So for every exchange each replica records, per owner k, as a contributor
`d` = <my copy, a_k>, `m` = |my copy|^2 and `q` = |a_k|^2 as it arrived, and as an owner, per
copy i it received, `o_i` = <c_i, a_mine> and `n_i` = |c_i|^2. The figures travel with the
weights digest (`World.dp_gather`: point to point, no extra round; each replica can lie about
its own row only), and every replica judges every owner the same way:

- `avg_mismatch` (the owner): the sum of its `o_i` is not R times its own `q`: the average it
  sent is not the mean of the copies it says it received. No honest owner does that, whatever
  its inputs (a bad copy moves the mean, not the identity).
- `avg_inputs` (the owner): its account of two or more contributors' copies (o_i, n_i)
  disagrees with their own (d, m). With at most one bad agent among a stage's replicas, two
  honest contributors cannot both be wrong.
- `avg_claims` (a contributor): its own figures disagree with two or more owners' accounts
  of its copy (a contributor that sends one thing and reports another).
- `avg_equivocal` (the owner): two or more replicas received an average whose |a_k|^2 is not
  the owner's own: it sent different averages to different replicas.
- One dispute between one owner and one contributor names nobody (either may lie); it is
  logged, and the other checks still run. Each receiver that got another average than its
  owner accounts for, or disputes its owner alone, is kept (`AverageAudit.receivers`): its
  weights then differ from the others', and the weights digest must not take it for the
  odd one out on its own word (replicacheck.py: a lone receiver and its owner dispute).

- `avg_share` (the owner; synchronous steps): an owner that alters its average *and* its
  account, putting the whole difference into the one copy nobody else holds, its own, makes
  its figures add up and agree with every contributor's. What gives it away is that copy's
  share <c_k, a_k> / |a_k|^2, which the contributors' own figures imply (R minus the sum of
  theirs, over |a_k|^2): an honest copy's is about 1 (the shares sum to R), a x10 average
  puts it near R, one noised by one sigma near (R + 1) / 2. One step's honest share reached
  3.65, so the median over the exchanges since the last digest is judged (at least
  `SHARE_MIN_ENTRIES`), against `SHARE_HIGH` (docs/architecture.md, "The averaged shard's
  audit": honest 10-step medians <= 1.48, attacked >= 1.81). A bad *input* lowers the
  owner's share (its own copy weighs less in the mean), never raises it.

Figures are float32 dots of the same bits on both sides, summed over a step's buckets in
the same order; `TOLERANCE` (relative, against the Cauchy-Schwarz bound of each dot) leaves
room for another machine's summation order and for the float32 rounding of the mean.
Compressed exchanges (a codec: the average sent is not the mean) and robust aggregation (not
a mean either) are not audited.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from agent.worker.avgcheck import Dots
from agent.worker.gradscore import Finding, median

log = logging.getLogger(__name__)

TOLERANCE = 1e-4  # relative, against each dot's Cauchy-Schwarz bound
SHARE_HIGH = 1.65  # an owner's implied own share, median over a digest's exchanges
SHARE_MIN_ENTRIES = 5  # exchanges a share median needs (with --sync-every: one; not judged)
MAX_PENDING = 16  # exchanges kept for the next digest (DIGEST_EVERY is 10)
AGREEING = 2  # disputes naming one party, or receivers seeing another average


@dataclass(frozen=True)
class OtherAverage:
    """A receiver that got, at `step`, another average from `owner` than the owner accounts
    for (its |a_k|^2 differs), or whose figures dispute the owner's alone. `named`: the
    exchange's findings name the owner (two receivers saw another average, or its account
    does not add up), so the receiver's weights differ through no fault of its own; else
    either of the two may have made it up."""

    step: int
    owner: int
    receiver: int
    named: bool


def width(size: int) -> int:
    """Floats per exchange in a replica's row: the step, then per owner (d, m, q), then per
    copy received (o, n)."""
    return 1 + 5 * size


@dataclass
class AverageAudit:
    """One replica's audit figures over the exchanges since the last digest."""

    size: int
    me: int
    shares: bool = True  # judge the owners' implied shares (synchronous steps only)
    _held: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # bucket -> copies
    _fig: list[float] = field(default_factory=list)
    _seen: bool = False
    _pending: list[list[float]] = field(default_factory=list)
    # the last `judge`'s receivers of another average, earliest exchange first
    receivers: list[OtherAverage] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._fig = [0.0] * (5 * self.size)

    def hold(self, bucket: int, copies: list[torch.Tensor]) -> None:
        """The copies of my shard of `bucket` I average this step (views, no copy)."""
        self._held[bucket] = copies

    def add(self, bucket: int, owner: int, average: torch.Tensor, mine: torch.Tensor,
            dots: Dots | None = None) -> None:
        """One bucket's averaged shard from `owner` and my copy of it (my gradient: for my
        own shard its buffer among the held copies holds the average by now); `dots`: the
        receiver's check already took |a|^2, <a, mine> and |mine|^2 (avgcheck.py)."""
        a = average.detach().reshape(-1).float()
        f, r = self._fig, self.size
        if dots is None:
            x = mine.detach().reshape(-1).float()
            dots = Dots(float(torch.dot(a, a)), float(torch.dot(x, a)), float(torch.dot(x, x)))
        f[3 * owner + 2] += dots.average_sq
        dot, sq = dots.mine, dots.mine_sq
        f[3 * owner] += dot
        f[3 * owner + 1] += sq
        if owner == self.me:
            for i, c in enumerate(self._held.pop(bucket, [])):
                if i == self.me:  # my own copy: `mine`, counted above
                    f[3 * r + 2 * i] += dot
                    f[3 * r + 2 * i + 1] += sq
                    continue
                y = c.detach().reshape(-1)[: a.numel()].float()
                f[3 * r + 2 * i] += float(torch.dot(y, a))
                f[3 * r + 2 * i + 1] += float(torch.dot(y, y))
        self._seen = True

    def close_step(self, step: int) -> None:
        """End an exchange's figures (nothing: no exchange this step)."""
        if self._seen:
            self._pending = (self._pending + [[float(step), *self._fig]])[-MAX_PENDING:]
        self._fig, self._seen, self._held = [0.0] * (5 * self.size), False, {}

    def row(self) -> list[float]:
        """The figures of the exchanges since the last digest, for `World.dp_gather` (the
        same count on every replica of a stage: they exchange at the same steps); spent:
        the next step's figures begin the next row while this one is judged."""
        row, self._pending = [v for entry in self._pending for v in entry], []
        return row

    def judge(self, rows: list[list[float]]) -> list[tuple[int, Finding]]:
        """(step, finding) for each check every replica's `rows` (dp-group order, `row()`
        each) fail, and `receivers` lists the exchanges'
        receivers of another average."""
        self.receivers = []
        w = width(self.size)
        out: list[tuple[int, Finding]] = []
        implied: dict[int, list[float]] = {}  # owner -> its implied own share, per exchange
        steps: list[int] = []
        if not rows or any(len(row) != len(rows[0]) or len(row) % w for row in rows):
            return out  # rows arrive at the length this replica sent (dp_gather)
        for e in range(len(rows[0]) // w):
            entries = [row[e * w:(e + 1) * w] for row in rows]
            step = int(entries[self.me][0])
            if any(x[0] != entries[self.me][0] for x in entries):
                log.warning("averaged-shard audit: the replicas' figures are of different "
                            "steps (%s); not judged", [x[0] for x in entries])
                continue
            other: list[tuple[int, int]] = []
            found = judge_exchange(self.size, [x[1:] for x in entries], implied, other)
            out += [(step, f) for f in found]
            named = {f.replica for f in found}
            self.receivers += [OtherAverage(step, k, j, k in named) for k, j in other]
            steps.append(step)
        if self.shares and self.size >= 3 and steps:  # R = 2: one copy's share is the other's
            out += judge_shares(implied, min(steps))   # complement, as noisy as their ratio
        # a receiver the figures name itself (a contributor that reports other figures than
        # it sent) is no owner's victim: its digest speaks for itself
        self.receivers = [o for o in self.receivers
                          if all(f.replica != o.receiver for _, f in out)]
        return out


def judge_shares(implied: dict[int, list[float]], first: int) -> list[tuple[int, Finding]]:
    """(step, finding) for each owner whose implied own share, median over the exchanges
    (`first`: the earliest one's step, the bound a rollback must resume before), is past
    `SHARE_HIGH`."""
    out = []
    for k, values in implied.items():
        if len(values) < SHARE_MIN_ENTRIES:
            continue
        mid = median(values)
        if mid > SHARE_HIGH:
            out.append((first, Finding(
                k, "avg_share", mid,
                f"its own copy's share of the averages it sent, as the contributors' figures "
                f"imply it, was {mid:.3g} (median of {len(values)} exchanges; honest: about 1, "
                f"<= {SHARE_HIGH}): it put into its own copy what it added to its averages")))
    return out


def judge_exchange(size: int, figs: list[list[float]],
                   implied: dict[int, list[float]] | None = None,
                   other: list[tuple[int, int]] | None = None) -> list[Finding]:
    """The findings of one exchange: `figs[j]` is replica j's figures (`width` less the
    step). `implied` gathers each owner's implied own share where nothing else was found
    about it (`judge_shares`); `other` the (owner, receiver) pairs where the receiver got
    another average than the owner's, or disputes the owner's account alone."""
    out: list[Finding] = []
    claims: dict[int, list[int]] = {}  # contributor -> owners whose account disputes it
    for k in range(size):
        own = figs[k]
        q = own[3 * k + 2]
        o = [own[3 * size + 2 * i] for i in range(size)]
        n = [own[3 * size + 2 * i + 1] for i in range(size)]
        if not all(math.isfinite(v) for v in (q, *o, *n)):
            out.append(Finding(k, "avg_mismatch", math.nan, "its account of the copies it "
                               "averaged is not finite"))
            continue
        if q == 0.0 and not any(o) and not any(n):
            continue  # it held nothing of this exchange
        others = [j for j in range(size) if j != k]
        seen = [j for j in others if not _close(figs[j][3 * k + 2], q, q)]
        if other is not None:
            other += [(k, j) for j in seen]
        if len(seen) >= AGREEING:
            out.append(Finding(k, "avg_equivocal", float(len(seen)),
                               f"{len(seen)} replicas received an average whose squared norm "
                               f"is not the {q:.6g} it reports sending"))
            continue
        disputes = [j for j in others if j not in seen and not (
            _close(figs[j][3 * k], o[j], math.sqrt(max(n[j], figs[j][3 * k + 1], 0.0) * q))
            and _close(figs[j][3 * k + 1], n[j], max(n[j], figs[j][3 * k + 1])))]
        for j in disputes:
            claims.setdefault(j, []).append(k)
        if other is not None and len(disputes) == 1:
            other.append((k, disputes[0]))
        bound = sum(math.sqrt(max(v, 0.0) * q) for v in n)
        total = sum(o)
        if not _close(total, size * q, bound):
            out.append(Finding(k, "avg_mismatch", total / (size * q) if q else math.inf,
                               f"the average it sent is not the mean of the copies it says it "
                               f"received: their dots with it sum to {total:.6g}, not R x "
                               f"|average|^2 = {size * q:.6g}"))
        elif len(disputes) >= AGREEING:
            out.append(Finding(k, "avg_inputs", float(len(disputes)),
                               f"its account of the copies of ranks at replicas {disputes} "
                               f"disagrees with their own"))
        elif not disputes and not seen and implied is not None and q > 0:
            # every contributor's figures agree with the owner's: a receiver that reports
            # another |a_k|^2 is left out of the disputes, and its dot must not move the share
            theirs = sum(figs[j][3 * k] for j in others)
            if math.isfinite(theirs):
                implied.setdefault(k, []).append((size * q - theirs) / q)
    for j, owners in claims.items():
        if len(owners) >= AGREEING and not any(f.replica in owners for f in out):
            out.append(Finding(j, "avg_claims", float(len(owners)),
                               f"its own figures for its copy disagree with the accounts of "
                               f"the owners at replicas {owners}"))
        elif len(owners) == 1 and not any(f.replica in (j, owners[0]) for f in out):
            log.warning("averaged-shard audit: replica %d's account of replica %d's copy "
                        "disagrees with its own; either may be wrong", owners[0], j)
    return out


def _close(a: float, b: float, scale: float) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= TOLERANCE * scale + 1e-30
