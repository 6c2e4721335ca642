"""Disputes: two replicas of a stage (R = 2), or a link's two ends, settled by placing them apart.

Why this third party. With two copies of a gradient (or two weight digests) that disagree,
either may be the wrong one: a worker reports the disagreement naming nobody
(`grad_disagree`, `weights_disagree`; agent/worker/pairscore.py, replicacheck.py). The issue
offered three third parties: a spare agent, another stage member, or the coordinator
recomputing a microbatch. Recomputing one replica's gradient at a middle stage needs that
step's activations from the stages before it and the gradients from the stages after it (the
whole pipeline replayed from a checkpoint both agreed on), on a machine that may not hold the
stage at all. What the job already has is the rule R >= 3 confirms by
(coordinator/integrity/corroborate.py): a suspect named by two distinct others. So the other
stage members are the third party, by a new pairing:

1. A dispute between A and B opens: the evidence is kept against both (unconfirmed), the job
   stops, rolls back before the dispute's onset (`dtfm.core.verify.onset`: a pair verdict is a
   window's median, a digest covers the steps since the last one) and plans again with A and
   B in different stages (`separate`), each beside a new partner.
2. A faulty device, or a volunteer that keeps attacking, disputes its new partner too. The
   agent common to two disputes with distinct partners, each of whom disputed nobody else, is
   a confirmed fault: excluded and rolled back before the earlier onset
   (coordinator/integrity/exclusion.py does the rest, as for R >= 3).
3. Only steps the dispute did not see can confirm it. The rollback replays the same steps
   on the same data, and an honest pair's disagreement comes from that data: which of the
   stage's two batches held a loss spike. So a gradient dispute in the same stage over steps
   an earlier epoch's dispute already judged is a replay, whoever the pair now is, and is
   neither a new dispute nor a second one (seen in CI: the agent that kept its place in the
   stage disputed its new partner at the very step of the first dispute, and was excluded).
   A lasting attack disputes again on fresh steps, a `PAIR_WINDOW` later; a weights dispute
   is never a replay (one checkpoint put the two replicas' weights back in step).
4. An honest pair's false dispute (the pair check flagged 0 of 3040 honest owner-steps,
   docs/architecture.md) costs one re-plan and a rollback and excludes nobody: a dispute is
   remembered for `MEMORY_STEPS` past its step, then lapses. The memory also bounds what a
   liar can cost: one that invents a dispute now and then is confirmed by its second within
   the memory, so it forces at most one re-plan per `MEMORY_STEPS` steps.

A liar can report a dispute only of its own pair (the reporter must be one of the two), so a
liar that invents disputes is the agent common to all of them and names itself. An attacker
that stops once re-paired is harmless from then on, and what it did is rolled back. Two bad
agents that both dispute the same honest agent would frame it; the partners' "disputed nobody
else" condition keeps that from confirming while either of them has a dispute of its own.
A job of one stage, or a placement that swaps nobody (rank order), has no other stage to put
either in: there a spare agent is the third party. The next epoch trains the reporter beside
a spare in place of the agent it disputed (`benched`), and the same rule then names whichever
disputes again. What cannot be settled: such a job with no spare agent free, or a pinned
placement; the dispute then stays evidence and the job trains on (docs/architecture.md). Weights
that differ (`weights_disagree`) still roll back there: two replicas stepping with the same
averaged gradient from different weights never agree again, and one checkpoint puts them back
in step (a one-off bit flip is then gone; a fault that lasts disputes again after the memory).

The same rule settles, at any R, a receiver whose weights the digest found odd and the owner
of the average it got another of (`avg_disagree`, agent/worker/replicacheck.py: the owner may
have sent it another average, or the receiver drifted and reports another); their weights
differ, so where nothing parts them they resume from one checkpoint, as `weights_disagree`.

The same rule settles a rank's norm that one stage alone shows (`norm_disagree`, opened by
the coordinator: coordinator/integrity/explained.py). The stage's replicas saw their odd one's
table say that the rank, its pipeline's other stage, sent another squared norm; but that row
is the odd replica's own to write, so either the rank sent it (to that stage only, or in a
pipeline of two stages, where no second stage can witness it) or the odd replica drifted and
wrote it to blame its partner. Parting them means different pipelines (`Apart.pipeline`);
such a dispute confirms only with another of its kind, and its onset is the digest's window
(`verify.onset`: the step is the odd replica's word).

The same rule settles the two ends of a pipeline link whose figures disagree (`link_disagree`,
coordinator/integrity/linkwitness.py: one of them misreports what crossed it, at any R). The
pair is then a sender and its receiver, neighbours in one pipeline, so parting them means no
longer neighbours (`Apart.neighbours`); a dispute of a link confirms only with another link's
dispute, never with a replicas' one (an honest receiver fed 10x disputes both).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from coordinator.integrity.corroborate import WINDOW_STEPS
from coordinator.integrity.ledger import COORDINATOR, IntegrityLedger
from coordinator.integrity.reports import EvidenceRecord
from coordinator.links.failure import avoid
from dtfm.core.verify import AVG_DISAGREE, NORM_DISAGREE, PAIR_WINDOW, onset

log = logging.getLogger(__name__)
T = TypeVar("T")

DISPUTING = frozenset({"grad_disagree", "weights_disagree", "act_disagree", "link_disagree",
                       AVG_DISAGREE, NORM_DISAGREE})
# disputes over replicas' weights that differ: they never agree again by training
WEIGHTS_DIFFER = frozenset({"weights_disagree", AVG_DISAGREE, NORM_DISAGREE})
# disputes between the two ends of a pipeline link (linkwitness.py), not two replicas: their
# pair is parted by making them no longer pipeline neighbours
LINK_DISPUTES = frozenset({"link_disagree"})
# disputes between a rank and another stage of its own pipeline, over the norm one of them
# says the other sent (explained.py): parted by putting them in different pipelines
PIPELINE_DISPUTES = frozenset({NORM_DISAGREE})
# disputes only the coordinator opens, from what it weighed itself: a worker's record of
# these kinds is no dispute
COORDINATORS = LINK_DISPUTES | PIPELINE_DISPUTES
STAGE, NEIGHBOURS, PIPELINE = "stage", "neighbours", "pipeline"  # what a pair is to each other
# disputes over what a stage computed from its batches: a rollback replays the same data
REPLAYABLE = frozenset({"grad_disagree", "act_disagree"})
# steps past a dispute within which a dispute with a new partner names the common agent: a
# pair verdict needs `PAIR_WINDOW` (9) steps of a new worker and a digest comes every
# `DIGEST_EVERY` (10), so a lasting fault repeats within ~20 steps of the re-plan's resume
MEMORY_STEPS = 10 * WINDOW_STEPS
MAX_DISPUTES = 256  # kept (the oldest dropped first)
PENDING, APART, CANNOT = "pending", "apart", "cannot"  # what was done about a dispute


@dataclass
class Dispute:
    a: str  # the two agents, sorted
    b: str
    kind: str
    step: int  # as reported
    onset: int  # the earliest step what it saw can have begun
    epoch: int
    reporter: str
    done: str = PENDING  # PENDING: to be placed apart; APART: an epoch was; CANNOT: none can
    stage: int = -1  # the stage the pair replicated (-1: not known)
    seen: int = 0  # the last step its pair reported it at, in its epoch

    @property
    def judged_until(self) -> int:
        """The last step its pair judged it at (`seen`; 0 in a state saved before it)."""
        return max(self.step, self.seen)

    def replayed_by(self, rec: EvidenceRecord, start: int) -> bool:
        """Whether `rec`, a gradient dispute whose window began at `start`, judged steps this
        dispute had judged, in its stage, again after a rollback: the same data again."""
        return (rec.kind == self.kind and self.kind in REPLAYABLE
                and rec.stage == self.stage >= 0
                and rec.epoch > self.epoch and start <= self.judged_until)

    @property
    def pair(self) -> frozenset[str]:
        return frozenset((self.a, self.b))

    def partner(self, agent_id: str) -> str:
        return self.b if agent_id == self.a else self.a

    @property
    def relation(self) -> str:
        """What the pair is to each other, and so what parting them means: replicas of one
        stage (`STAGE`), a link's two ends (`NEIGHBOURS`), two stages of one pipeline
        (`PIPELINE`)."""
        return (NEIGHBOURS if self.kind in LINK_DISPUTES
                else PIPELINE if self.kind in PIPELINE_DISPUTES else STAGE)

    @property
    def who(self) -> str:
        """What the pair is to each other, for the log and the ledger."""
        return {NEIGHBOURS: "pipeline neighbours", PIPELINE: "stages of one pipeline",
                STAGE: "replicas of one stage"}[self.relation]

    def live(self, step: int) -> bool:
        """Whether a record of `step` still finds it remembered (`MEMORY_STEPS`)."""
        return step <= self.step + MEMORY_STEPS


class Disputes:
    """The R = 2 disputes of one job, and what they ask of it (a re-plan, a rollback)."""

    def __init__(self, saved: Iterable[Any] = ()) -> None:
        self.disputes: list[Dispute] = []
        self._asked: list[Dispute] = []  # the disputes the epoch being planned was asked to part
        self.rollback_before = 0  # the earliest onset of a dispute still to roll back (0: none)
        self.replan_reason = ""  # why the job must re-plan now ("" : it need not)
        self._replays: set[tuple[frozenset[str], int]] = set()  # replays already logged
        for d in saved:
            try:
                self.disputes.append(Dispute(**d))
            except TypeError as exc:  # our own state file: say so, keep the rest
                log.error("integrity: a saved dispute could not be read (%s)", exc)

    def feed(self, records: Iterable[EvidenceRecord], ledger: IntegrityLedger,
             sync_every: int = 1, separable: bool = True, first_step: int = 1,
             by_spare: bool = False) -> bool:
        """Weigh the new records' R = 2 disagreements; True when one opens a dispute that the
        job must re-plan for (`replan_reason` says why). `separable`: whether the running
        layout and placement can put two agents of one stage in different stages, or
        (`by_spare`) can only give one of them a spare agent as its partner instead (one
        stage, or a placement that swaps nobody: `benched`);
        `first_step`: the first step the running epoch trains, before which no onset is
        taken (a reporter's claim about steps before it would roll back what it did not
        train: at worst a liar costs the epoch's own steps, as a crash would)."""
        replan = False
        for rec in records:
            pair = set(rec.candidates)
            if (rec.agent_id or rec.kind not in DISPUTING or len(pair) != 2
                    or len(rec.candidates) != 2
                    or rec.reporter not in (*pair, COORDINATOR)  # its own: linkwitness.py
                    or (rec.kind in COORDINATORS and rec.reporter != COORDINATOR)
                    or any(ledger.excluded(a) for a in pair)):
                continue
            self.disputes = [d for d in self.disputes if d.live(rec.step)]
            if same := [d for d in self.disputes if d.pair == pair]:
                for d in same:  # the same disagreement, reported again (every step, by both)
                    if d.epoch == rec.epoch:  # a liar's claims reach no further than a window
                        d.seen = min(max(d.seen, rec.step), d.step + PAIR_WINDOW)
                continue
            start = max(onset(rec.kind, rec.step, sync_every), first_step)
            if replay := next((d for d in self.disputes if d.replayed_by(rec, start)), None):
                self._replayed(rec, replay)
                continue
            a, b = sorted(pair)
            new = Dispute(a, b, rec.kind, rec.step, start, rec.epoch, rec.reporter,
                          PENDING if separable else CANNOT, rec.stage, rec.step)
            if culprit := self._confirm(new, ledger):
                self.disputes = [d for d in self.disputes if culprit not in d.pair]
                continue
            self.disputes = [*self.disputes, new][-MAX_DISPUTES:]
            resync = not separable and rec.kind in WEIGHTS_DIFFER
            bench = self.bench_of(new)
            parting = (f"training {new.partner(bench)} beside a spare agent in place of "
                       f"{bench}" if by_spare else "placing them apart, each with a new partner")
            settle = (f"{parting}, to settle it"
                      if separable else "no placement can part them (one stage, or a fixed "
                      "placement) and no spare agent is free: it stays evidence" + (
                          ", and both resume from one checkpoint" if resync else ""))
            said = f" ({rec.detail})" if new.kind in COORDINATORS and rec.detail else ""
            for x in (a, b):
                ledger.record(x, rec.kind, rec.step,
                              f"disagreed with {new.partner(x)} at step {rec.step}, either may "
                              f"be wrong (score {rec.score:.3g}, epoch {rec.epoch}){said}: "
                              f"{settle}", reporter=rec.reporter)
            if separable or resync:  # weights that differ never agree again by training
                self.rollback_before = min(s for s in (self.rollback_before, new.onset) if s)
                self.replan_reason = (
                    f"agents {a} and {b}, {new.who}, disagree ({rec.kind} at step "
                    f"{rec.step}; either may be wrong): " + (
                        f"{parting}, and rolling back"
                        if separable else "nobody to place them with instead; both "
                        "resume") + f" before step {self.rollback_before}")
                replan = True
        return replan

    def _replayed(self, rec: EvidenceRecord, earlier: Dispute) -> None:
        """Say once per pair and epoch that `rec` replays `earlier`'s steps."""
        key = (frozenset(rec.candidates), rec.epoch)
        if key in self._replays:
            return
        if len(self._replays) >= MAX_DISPUTES:  # bounded; at worst a line said twice
            self._replays.clear()
        self._replays.add(key)
        log.info("integrity: %s and %s (stage %d) disagree at step %d of epoch %d, on steps "
                 "the dispute of %s and %s at step %d already judged: the rollback replays "
                 "the same data, which a new pairing cannot settle (an honest pair's "
                 "disagreement comes from its batches); only steps after %d count",
                 *sorted(rec.candidates), rec.stage, rec.step, rec.epoch, earlier.a, earlier.b,
                 earlier.step, earlier.judged_until)

    def _confirm(self, new: Dispute, ledger: IntegrityLedger) -> str:
        """The agent of `new` that an earlier dispute with another partner names (confirmed in
        `ledger`), or ""."""
        for x in (new.a, new.b):
            for d in self.disputes:
                # a dispute confirms only with another of its relation: an honest receiver
                # fed 10x disputes its sender's link and, at R = 2, its replica's gradients
                # too; an honest receiver of another average disputes its owner (stage) and
                # its norm its pipeline's odd replicas (pipeline), when nothing explains it
                if (x not in d.pair or d.partner(x) == new.partner(x)
                        or d.relation != new.relation):
                    continue
                partners = (d.partner(x), new.partner(x))
                if any(x not in e.pair for e in self.disputes for p in partners
                       if p in e.pair):
                    continue  # a partner disputed someone else too: it may be the liar
                first = min(d.onset, new.onset)
                ledger.record(x, new.kind, first,
                              f"the agent common to two disagreements with different partners: "
                              f"{d.kind} with {partners[0]} at step {d.step}, then {new.kind} "
                              f"with {partners[1]} at step {new.step}"
                              + (" after they were placed apart" if new.epoch != d.epoch
                                 else " in the same epoch")
                              + f" (first step proven bad: {first})",
                              reporter=COORDINATOR, confirmed=True)
                return x
        return ""

    @staticmethod
    def bench_of(d: Dispute) -> str:
        """Which of `d`'s pair sits out for a spare where no swap parts them: the one the
        reporter disputed. A liar that reports a dispute keeps its place and must dispute
        the spare too, which names it; an honest reporter keeps its place beside the spare,
        and the one it disputed trains no more while the dispute stands."""
        return d.partner(d.reporter) if d.reporter in d.pair else d.b

    def benched(self, ids: Sequence[str]) -> set[str]:
        """The agents of `ids` that the next epoch should leave out while a spare can take
        their place: one of each remembered dispute's pair (`bench_of`; as `apart` keeps
        pairs apart, for as long), for a layout or a placement that cannot put the two in
        different stages (coordinator/job/membership.py picks them last, so only a job short
        of agents plans on them)."""
        inside = set(ids)
        return {self.bench_of(d) for d in self.disputes
                if d.done != CANNOT and d.pair <= inside}

    def apart(self, ids: Sequence[str]) -> Apart:
        """The pairs (indices into `ids`) an epoch of `ids` must keep apart: replicas out of
        one stage, a link's two ends out of one pipeline's neighbouring stages."""
        index = {a: i for i, a in enumerate(ids)}
        self._asked = [d for d in self.disputes
                       if d.done != CANNOT and d.a in index and d.b in index]

        def pairs(relation: str) -> set[frozenset[Any]]:
            return {frozenset((index[d.a], index[d.b])) for d in self._asked
                    if d.relation == relation}
        return Apart(pairs(STAGE), pairs(NEIGHBOURS), pairs(PIPELINE))

    def planned(self, rows: Sequence[Sequence[str]]) -> None:
        """An epoch was planned with `rows` (agent ids, a row per stage): a pending dispute
        whose pair it parts is apart; one it was asked to part (`apart`) and could not stays
        evidence; one that came in while it was placed waits for the next plan (and keeps
        `replan_reason`)."""
        together = Apart(stage_pairs(rows), neighbour_pairs(rows), pipeline_pairs(rows))
        for d in self.disputes:
            if d.done != PENDING:
                continue
            if d.pair not in together.of(d.relation):
                d.done = APART
            elif any(d is asked for asked in self._asked):
                d.done = CANNOT
        if not any(d.done == PENDING for d in self.disputes):
            self.replan_reason = ""
        self._asked = []

    def rolled_back(self) -> None:
        """An epoch planned with the rollback bound wrote a checkpoint of its own: only the
        disputes opened since it was planned still ask for one."""
        self.rollback_before = min((d.onset for d in self.disputes if d.done == PENDING),
                                   default=0)

    def to_json(self) -> dict[str, Any]:
        return {"disputes": [asdict(d) for d in self.disputes],
                "rollback_before": self.rollback_before}


def restore(saved: Any) -> Disputes:
    """A job's disputes as `Disputes.to_json` kept them (empty on anything else)."""
    if not isinstance(saved, dict):
        return Disputes()
    disputes = Disputes(saved.get("disputes", ()))
    disputes.rollback_before = int(saved.get("rollback_before", 0) or 0)
    if pending := [d for d in disputes.disputes if d.done == PENDING]:  # the re-plan it asked
        d = pending[0]  # for had not happened when the coordinator stopped: it still must
        disputes.replan_reason = (f"agents {d.a} and {d.b}, {d.who}, disagreed "
                                  f"({d.kind} at step {d.step}) before a coordinator restart: "
                                  f"placing them apart now")
    return disputes


def swaps_part(placement_kind: str, stages: int) -> bool:
    """Whether a swap between stages can part a dispute's pair (several stages, scheduled
    placement), rather than a spare taking one's place (`Disputes.benched`)."""
    return stages > 1 and placement_kind == "scheduled"


def unsettled(placement_kind: str, stages: int, pinned: bool, spare_free: bool) -> str:
    """Why an epoch of this placement cannot settle a dispute between two agents, "" where it
    can: said when the epoch starts (a log warning and the job's state message), because an
    operator who chose it learns otherwise only once a fault stays unexcluded."""
    if swaps_part(placement_kind, stages):
        return ""
    if pinned:
        why = "a pinned placement (--placement FILE) moves nobody"
    elif spare_free:
        return ""
    else:
        why = (f"no spare agent is free and {placement_kind} placement"
               + (" of one stage" if stages == 1 else "") + " puts nobody elsewhere")
    return (f"a dispute between two agents (replicas of a stage at R = 2, an average's "
            f"owner and a receiver, a link's two ends, a norm's sender and the replica it "
            f"made odd) cannot be settled: {why}; it stays "
            f"evidence and the job trains on. Start one agent more than the job uses"
            + ("" if stages == 1 or pinned else ", or use --placement scheduled")
            + (", or plan with `coordinator plan`, not a pinned file" if pinned else ""))


@dataclass(frozen=True)
class Apart:
    """Pairs of devices (or agents) to keep apart: `stage`, out of one stage (replicas that
    disputed); `neighbours`, from being one pipeline's neighbouring stages (a link's ends);
    `pipeline`, out of one pipeline (a norm's sender and the replica it made odd)."""

    stage: set[frozenset[Any]]
    neighbours: set[frozenset[Any]]
    pipeline: set[frozenset[Any]] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.stage or self.neighbours or self.pipeline)

    def of(self, relation: str) -> set[frozenset[Any]]:
        return {STAGE: self.stage, NEIGHBOURS: self.neighbours,
                PIPELINE: self.pipeline}[relation]


def separate(grid: Sequence[Sequence[int]], apart: Apart) -> list[list[int]] | None:
    """`grid` (a row per stage, a column per replica) with no `apart.stage` pair in one row,
    no `apart.neighbours` pair in neighbouring rows of one column and no `apart.pipeline`
    pair in one column, by as few swaps as it takes (`links.failure.avoid`, which keeps dead
    links apart the same way); the grid unchanged when none is together, None when no swap
    parts them (one stage)."""
    def together(g: Sequence[Sequence[int]]) -> set[frozenset[int]]:
        return ((stage_pairs(g) & apart.stage) | (neighbour_pairs(g) & apart.neighbours)
                | (pipeline_pairs(g) & apart.pipeline))

    return avoid(grid, apart.stage | apart.neighbours | apart.pipeline, linked=together)


def stage_pairs(grid: Sequence[Sequence[T]]) -> set[frozenset[T]]:
    """The pairs of devices that replicate one stage: the only pairs a dispute keeps apart."""
    return {frozenset(p) for row in grid for p in itertools.combinations(row, 2)}


def pipeline_pairs(grid: Sequence[Sequence[T]]) -> set[frozenset[T]]:
    """The pairs of devices in one pipeline (one column), at any two stages."""
    columns = [[row[k] for row in grid if k < len(row)] for k in range(max(map(len, grid),
                                                                         default=0))]
    return {frozenset(p) for col in columns for p in itertools.combinations(col, 2)}


def neighbour_pairs(grid: Sequence[Sequence[T]]) -> set[frozenset[T]]:
    """The pairs of devices at neighbouring stages of one pipeline: a link's two ends."""
    return {frozenset((row[k], nxt[k])) for row, nxt in itertools.pairwise(grid)
            for k in range(min(len(row), len(nxt)))}
