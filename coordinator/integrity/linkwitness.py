"""Pipeline activations and their gradients, checked by the coordinator from both ends of
every link (issue 43, item 3).

Why both ends. Only the receiver of a pipeline message sees what arrived, so a receiver's word
alone could frame its sender ("rank 3 sent me garbage"), and a sender's alone could hide what
it sent. Every worker reports, per window of `LINK_WINDOW` steps (dtfm.core.verify;
agent/worker/linkstats.py), the root mean square of what it sent and of what it received on
each pipeline link, activations forward and their gradients back (the median over the
window's steps). The coordinator, the one party the threat model trusts, holds both ends'
figures of every link:

- **The two ends disagree** (beyond `AGREE_TOL`, which a codec's rounding stays far inside):
  one of them lies about what crossed the link. It cannot tell which: the record
  (`link_disagree`) names both, undecided, and opens a dispute between them, settled as
  the replicas' are, by new partners (coordinator/integrity/dispute.py). Everything its
  pipeline computed after that link was computed from what crossed it, so no link after it
  is blamed on its sender (`_shield`), nor are the gradients of that pipeline's ranks
  (`explained`): a sender that reports honest figures and sends 10x would otherwise have its
  honest receiver excluded for passing the 10x on, and a receiver that lies about its input
  would make its own wrong output look like what followed.
- **They agree**, so the sender stands by what it sent. Its value is compared with the same
  boundary's links of the other replicas' pipelines (same weights, other data: the same
  scale). A link at `CONFIRM_RATIO` times the median or more (or below its inverse), or one
  that carries zeros where the others do not, is wrong, and its sender admitted sending it.
- **A wrong input makes a wrong output.** A stage fed scaled activations sends scaled
  activations on (the residual stream carries them), and every gradient computed from them
  back. So in each pipeline the coordinator walks the links in the order the step computes
  them (activations from stage 0 to the last, then gradients back to stage 0) and blames
  only the first wrong one: its sender is the fault, the rest is what followed from it.
- **R = 2**: two values cannot say which is wrong. The first boundary at which the two
  pipelines' activations differ by `CONFIRM_RATIO` names the pair of senders there,
  replicas of one stage, as a dispute (`act_disagree`), settled like a gradient dispute
  (coordinator/integrity/dispute.py); zeros on one of the two name their sender.
- **R >= 3, smaller deviations** (`SUSPECT_RATIO` up to `CONFIRM_RATIO`: noise of about one
  sigma raises the root mean square by 1.41x) are evidence against the sender, unconfirmed;
  the same sender of activations found so in `PERSIST_WINDOWS` windows in a row is
  confirmed.
- **Activation gradients are judged by the stage's gain where it has one.** Their size
  follows the batch's loss: an honest hard batch sends gradients many times the others' (a
  fine-tuned import's gradient copies reached 6-19x for 4 steps in a row, docs/architecture.md
  "R = 2"). A middle stage receives gradients as well as sending them, and what it sends back
  over what it received (its gain; both figures corroborated by the other ends) does not
  follow the loss: honest windows of it stayed within 1.21x of the other pipelines' fresh,
  1.08x fitted and 1.20x learnt by heart (bench/linkspread.py `gain-K`). So a middle stage's
  gradients are judged by their gain, as activations are by their size (confirmed from
  `CONFIRM_RATIO`, or `PERSIST_WINDOWS` in a row from `SUSPECT_RATIO`; R = 2 disputes). The
  last stage has no gain (its gradient starts at the loss): its scaled gradients stay
  evidence, confirmed only as zeros, and still explain the wrong gradients upstream of them
  (`explained`).

The thresholds come from the honest spread measured through training (docs/architecture.md,
"Activations"). Bounded against a flood: at most `MAX_HELD` windows wait, none older than
`KEPT_WINDOWS` behind the slowest member's newest, and only ranks of the layout count. A member
that reports no figures holds every window back: the check then names nobody (a limit).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dtfm.core.verify import LINK_WINDOW

AGREE_TOL = 0.25  # |sent - received| over the larger: the two ends' figures of one link
# A link's window figure against its boundary's median (R = 2: the pair's ratio). Honest
# windows of gpt-tiny, 150 steps, at 2 sequences a replica (the smallest share the tests
# train): activations within 1.22x, their gradients within 1.39x (single steps up to 17x:
# hence windows); at 8 sequences 1.09x and 1.21x (docs/architecture.md, "Activations").
SUSPECT_RATIO = 1.3  # evidence from here (R >= 3)
CONFIRM_RATIO = 3.0  # confirmed from here, and zeros (no honest look-alike); R = 2 disputes
PERSIST_WINDOWS = 3  # windows in a row that confirm an activations suspect below CONFIRM_RATIO
# (gradients' honest spread reaches SUSPECT_RATIO: a suspect there stays evidence)
ZERO_RMS = 1e-12  # a message of zeros
KEPT_WINDOWS = 8  # window steps kept behind the slowest member's newest, waiting for the rest
MAX_HELD = 4 * KEPT_WINDOWS  # windows held at most (the oldest dropped first)
UNDECIDED = -1  # a wrong link's sender where its two ends disagree: either may be at fault

FIGURES = ("act_out", "act_in", "grad_out", "grad_in")


@dataclass(frozen=True)
class Link:
    """One pipeline link in one direction: `kind` "act" (sender at stage b - 1, receiver at
    stage b) or "actgrad" (their gradients, back), `boundary` b >= 1, `replica` the
    pipeline."""

    kind: str
    boundary: int
    replica: int
    sender: int  # ranks
    receiver: int


@dataclass(frozen=True)
class Finding:
    """What one window showed about one link (or, R = 2, one boundary's pair of links)."""

    kind: str  # dtfm.core.verify.LINK_KINDS
    step: int  # the window's last step
    suspects: tuple[int, ...]  # ranks: one sender, or two ends / two senders (undecided)
    score: float  # the ratio that failed
    confirmed: bool
    detail: str

    @property
    def onset(self) -> int:
        """The first step the window holds: what it saw can have begun no earlier."""
        return max(self.step - LINK_WINDOW + 1, 1)


def links(stages: int, replicas: int) -> list[Link]:
    """Every link of the layout, each pipeline's in the order a step computes them."""
    out = []
    for r in range(replicas):
        base = r * stages
        out += [Link("act", b, r, base + b - 1, base + b) for b in range(1, stages)]
        out += [Link("actgrad", b, r, base + b, base + b - 1)
                for b in range(stages - 1, 0, -1)]
    return out


def _ends(link: Link, figures: Mapping[int, Sequence[float]]) -> tuple[float, float]:
    out, into = (0, 1) if link.kind == "act" else (2, 3)
    return figures[link.sender][out], figures[link.receiver][into]


@dataclass
class LinkWitness:
    """The window figures of one epoch's members, and what they show."""

    stages: int = 0
    replicas: int = 0
    epoch: int = -1
    # whether middle stages' gains are judged: not where the pipeline does not flush
    # (`--pipeline-delay 1`), whose stale steps' honest gains spread past the thresholds
    # (3.8x between two replicas on the 8-city world, docs/benchmarks.md); activations and
    # zeros still are
    judge_gains: bool = True
    _windows: dict[int, dict[int, tuple[float, ...]]] = field(default_factory=dict)
    _judged: set[int] = field(default_factory=set)
    _suspected: dict[int, int] = field(default_factory=dict)  # sender rank -> windows in a row
    _newest: dict[int, int] = field(default_factory=dict)  # rank -> its newest window step
    judged_through: int = 0  # the newest window step judged
    # the wrong links found, newest last: (onset, step, the pipelines it touched, sender)
    _roots: list[tuple[int, int, frozenset[int], int]] = field(default_factory=list)

    def plan(self, epoch: int, stages: int, replicas: int, judge_gains: bool = True) -> None:
        """A new epoch and its layout: what the last one reported no longer applies."""
        self.epoch, self.stages, self.replicas = epoch, stages, replicas
        self.judge_gains = judge_gains
        self._windows, self._judged, self._suspected, self._newest = {}, set(), {}, {}
        self.judged_through, self._roots = 0, []

    def add(self, epoch: int, rank: int, step: int, figures: Sequence[float]) -> None:
        """One member's figures (`FIGURES`, NaN: no such link) for the window ending at
        `step`. Another epoch's, or a rank outside the layout, is ignored."""
        if (epoch != self.epoch or not 0 <= rank < self.stages * self.replicas
                or len(figures) != len(FIGURES) or step in self._judged):
            return
        self._newest[rank] = max(self._newest.get(rank, 0), step)
        self._windows.setdefault(step, {})[rank] = tuple(float(f) for f in figures)
        if len(self._windows) > MAX_HELD:
            self._prune()

    def _prune(self) -> None:
        """Drop the windows older than `KEPT_WINDOWS` behind the slowest member's newest
        (one that died never completes them), then the newest past `MAX_HELD`: windows are
        judged oldest first, so a member that races ahead, or lies about its step, fills
        the room with its own and cannot push the others' out before they are complete."""
        floor = min(self._newest.values(), default=0) - KEPT_WINDOWS * LINK_WINDOW
        kept = sorted(s for s in self._windows if s >= floor)[:MAX_HELD]
        self._windows = {s: self._windows[s] for s in kept}

    @property
    def held(self) -> int:
        """How many windows wait for members' figures (at most `MAX_HELD`)."""
        return len(self._windows)

    def judge(self) -> list[Finding]:
        """The findings of every window all members have reported, oldest first."""
        if len(self._windows) > KEPT_WINDOWS:
            self._prune()
        members = self.stages * self.replicas
        found: list[Finding] = []
        for step in sorted(s for s, got in self._windows.items() if len(got) == members):
            found += self._judge(step, self._windows.pop(step))
            self._judged.add(step)
            self.judged_through = max(self.judged_through, step)
        for f in found:
            touched = frozenset(r // max(self.stages, 1) for r in f.suspects)
            # a link in dispute names no sender: either end may have spoiled what followed
            sender = UNDECIDED if f.kind == "link_disagree" else f.suspects[0]
            self._roots = [*self._roots, (f.onset, f.step, touched, sender)][-MAX_HELD:]
        if len(self._judged) > 4 * KEPT_WINDOWS:
            self._judged = set(sorted(self._judged)[-KEPT_WINDOWS:])
        return found

    def explained(self, rank: int, step: int) -> str:
        """Why `rank`'s own numbers at `step` may be wrong through no fault of its own: a
        wrong link found in its pipeline over a window holding `step`, whose sender is
        another rank (it fed this rank, or the stages between); "" when none was."""
        pipeline = rank // max(self.stages, 1)
        for begun, ended, touched, sender in reversed(self._roots):
            if pipeline in touched and sender != rank and begun <= step <= ended:
                if sender == UNDECIDED:
                    return (f"the two ends of a link in its pipeline disagreed about what "
                            f"crossed it over steps {begun}-{ended}, and rank {rank}'s numbers "
                            f"were computed from it (a dispute settles which end lied)")
                return (f"rank {sender} sent wrong pipeline messages in its pipeline over "
                        f"steps {begun}-{ended}, which rank {rank}'s numbers were computed from")
        return ""

    def _judge(self, step: int, figures: Mapping[int, Sequence[float]]) -> list[Finding]:
        agreed: dict[Link, float] = {}
        disagree: dict[Link, tuple[float, float]] = {}
        every = links(self.stages, self.replicas)
        for link in every:
            sent, got = _ends(link, figures)
            if math.isnan(sent) or math.isnan(got):
                continue
            if abs(sent - got) > AGREE_TOL * max(sent, got, ZERO_RMS):
                disagree[link] = (sent, got)
            else:
                agreed[link] = got
        measured, gained = _gains(agreed)
        if not self.judge_gains:
            measured = {k: v for k, v in measured.items() if k not in gained}
            gained = set()
        wrong = self._outliers(measured, gained)
        per = 2 * (self.stages - 1)  # `links` lists each pipeline's in turn
        pipelines = [every[r * per:(r + 1) * per] for r in range(self.replicas)]
        found = []
        for link, (sent, got) in disagree.items():
            followed = _shield(pipelines[link.replica], link, wrong)  # takes them out of wrong
            found.append(self._disagreeing(step, link, sent, got, followed))
        if self.replicas == 2:
            return found + self._pairs(step, wrong, gained)
        suspected, self._suspected = self._suspected, {}
        for pipeline in pipelines:
            order = [k for k in pipeline if k in wrong]
            for root in _roots(order, gained):
                ratio, zero = wrong[root]
                runs = self._suspected[root.sender] = suspected.get(root.sender, 0) + 1
                after = order[order.index(root) + 1:]
                found.append(self._blame(step, root, ratio, zero, runs, len(after),
                                         root in gained))
        return found

    def _outliers(self, agreed: dict[Link, float], gained: set[Link]
                  ) -> dict[Link, tuple[float, bool]]:
        """The agreed links far from their boundary's others: link -> (ratio, zeros).
        `gained` links' figures are their sender's gains, compared only with gains."""
        wrong: dict[Link, tuple[float, bool]] = {}
        groups: dict[tuple[str, int, bool], list[Link]] = {}
        for k in agreed:
            groups.setdefault((k.kind, k.boundary, k in gained), []).append(k)
        for group in groups.values():
            if len(group) < 2:
                continue
            values = [agreed[k] for k in group]
            centre = statistics.median(values)
            for k in group:
                v = agreed[k]
                if v <= ZERO_RMS < centre:
                    wrong[k] = (0.0, True)
                    continue
                ratio = v / centre if centre > ZERO_RMS else 1.0
                if self.replicas == 2:  # two: their ratio, on both
                    ratio = max(values) / max(min(values), ZERO_RMS)
                if max(ratio, 1 / max(ratio, ZERO_RMS)) >= SUSPECT_RATIO:
                    wrong[k] = (ratio, False)
        return wrong

    @staticmethod
    def _disagreeing(step: int, link: Link, sent: float, got: float, followed: int
                     ) -> Finding:
        """The finding against both ends of `link`, whose figures differ beyond `AGREE_TOL`
        (`followed`: the wrong links after it in its pipeline, which nobody is blamed for)."""
        return Finding(
            "link_disagree", step, (link.sender, link.receiver),
            max(sent, got) / max(min(sent, got), ZERO_RMS), False,
            f"rank {link.sender} says it sent {link.kind} of root mean square {sent:.4g} to "
            f"rank {link.receiver}, which says it received {got:.4g} (window ending at step "
            f"{step}): one of the two misreports"
            + (f"; {followed} later link(s) of its pipeline followed from it, blamed on "
               f"neither" if followed else ""))

    @staticmethod
    def _blame(step: int, root: Link, ratio: float, zero: bool, runs: int,
               followed: int, gain: bool = False) -> Finding:
        """The finding against `root`'s sender, found wrong `runs` windows in a row (`gain`:
        judged by its sender's gain)."""
        what = "activations" if root.kind == "act" else "activation gradients"
        far = max(ratio, 1 / max(ratio, ZERO_RMS))
        # the last stage's activation gradients scale with the batch's loss: an honest hard
        # batch sends large ones (a fine-tuned import's gradient copies reached 6-19x for 4
        # steps in a row), so only their zeros confirm; a middle stage's gain does not
        confirmed = zero or ((root.kind == "act" or gain) and (far >= CONFIRM_RATIO
                                                                or runs >= PERSIST_WINDOWS))
        how = "zeros where the other replicas' carry values" if zero else (
            f"{ratio:.3g}x the gain (what it sent back over what it received) of the same "
            f"stage in the other pipelines" if gain else
            f"{ratio:.3g}x the root mean square of the same boundary's other pipelines")
        return Finding(
            f"{root.kind}_{'zero' if zero else 'scaled'}", step, (root.sender,),
            0.0 if zero else ratio, confirmed,
            f"rank {root.sender} sent {what} to rank {root.receiver} at {how} (median over "
            f"the window ending at step {step}, both ends agreeing on it"
            + (f"; {runs} windows in a row" if runs > 1 else "") + ")"
            + (f"; {followed} later link(s) of its pipeline followed from it"
               if followed else ""))

    def _pairs(self, step: int, wrong: dict[Link, tuple[float, bool]],
               gained: set[Link]) -> list[Finding]:
        """R = 2: the first boundary, in the order a step computes them, whose two links
        disagree names its two senders, undecided."""
        order = links(self.stages, 1)  # pipeline 0's, in computation order
        for k in order:
            pair = [x for x in wrong if (x.kind, x.boundary) == (k.kind, k.boundary)]
            if not pair:
                continue
            if len(zeros := [x for x in pair if wrong[x][1]]) == 1:  # self-evident
                return [self._blame(step, zeros[0], 0.0, True, 1, 0)]
            ratio = max(wrong[pair[0]][0], 1 / max(wrong[pair[0]][0], ZERO_RMS))
            # honest windows reach 1.4x, and the last stage's gradients follow the batch's
            # loss: no re-plan for them
            if ratio < CONFIRM_RATIO or not (k.kind == "act" or set(pair) <= gained):
                continue
            senders = tuple(sorted({k.sender, k.sender + self.stages}))
            what = "activations across boundary {} whose root mean squares" if \
                k.kind == "act" else ("activation gradients back across boundary {} at gains "
                                      "(what each sent back over what it received) that")
            return [Finding("act_disagree", step, senders, ratio, False,
                            f"ranks {senders[0]} and {senders[1]}, replicas of one stage, sent "
                            f"{what.format(k.boundary)} "
                            f"differ {ratio:.3g}x (median over the window ending at step "
                            f"{step}, both ends of each link agreeing): either may be wrong")]
        return []


def _shield(pipeline: list[Link], link: Link, wrong: dict[Link, tuple[float, bool]]) -> int:
    """Take out of `wrong` the links of `pipeline` (in computation order) computed after
    `link`, whose two ends disagree, and count them. What crossed `link` is in dispute, and
    everything after it was computed from it: a receiver fed 10x by a sender that reports
    honest figures sends 10x on through no fault of its own, and a receiver that lies about
    its input to excuse its own wrong output is as likely. Neither is blamed here; the
    dispute between the two ends (coordinator/integrity/dispute.py) settles which it was."""
    after = [k for k in pipeline[pipeline.index(link) + 1:] if k in wrong]
    for k in after:
        del wrong[k]
    return len(after)


def _roots(wrong: list[Link], gained: set[Link]) -> list[Link]:
    """Of one pipeline's wrong links in computation order, those to blame: the first (what
    follows is computed from it), and where that is the last stage's activation gradients
    (no gain: a hard batch's look the same) the first wrong gain after it too, which those
    gradients' size cannot explain."""
    if not wrong:
        return []
    first = wrong[0]
    if first.kind == "actgrad" and first not in gained:
        if later := next((k for k in wrong[1:] if k in gained), None):
            return [first, later]
    return [first]


def _gains(agreed: dict[Link, float]) -> tuple[dict[Link, float], set[Link]]:
    """`agreed` with each middle stage's activation gradients replaced by its gain: what it
    sent back over what it received from the stage after it in the same pipeline (both
    links agreed, and what it received not zeros); those links, apart."""
    measured, gained = dict(agreed), set()
    for k, sent in agreed.items():
        if k.kind != "actgrad":
            continue
        into = Link("actgrad", k.boundary + 1, k.replica, k.sender + 1, k.sender)
        received = agreed.get(into)
        if received is not None and received > ZERO_RMS:
            measured[k] = sent / received
            gained.add(k)
    return measured, gained
