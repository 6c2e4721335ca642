"""Gradient evidence whose confirmation waits for the pipeline links' verdict.

Why: a stage computes its gradients from the activations it received and the gradients sent
back to it. A neighbour that sends wrong ones (scaled, zeroed) makes an honest agent's
gradient copies wrong too, and its replicas' owners name it, two of them, within a step or
two: the honest agent was excluded for its neighbour's fault (a held-out run of
tests/system/test_bad_activations.py excluded three honest agents and not the bad one). The
pipeline links are judged a window later (coordinator/integrity/linkwitness.py). So a
confirmed gradient fault against an agent of a pipelined job waits (`defer`) until the
links of the steps it covers are judged; then it is dropped where a wrong link upstream of
it in its pipeline explains it, and confirmed otherwise (`release`). A fault waiting longer
than `RELEASE_STEPS` past its step, because the links go unjudged (a member that reports no
figures), is confirmed as it would have been.

A rank named for the squared norm it sent its pipeline (`norm_differs`,
agent/worker/normtable.py) waits too, for another verdict: its own stage's judgement of the
same digest. The norm it sent differs from its replicas' either because it lied about it or
because its own averaged gradient differs, which an owner that sent it another average
causes; its own stage then reports a dispute of the two (`avg_disagree`) at the same digest,
from other agents whose records may arrive later. So it waits until every member's records
have arrived through the step of the report that delivered it, at or past the digest that
found it (`vetted`: rollback.vetted_step), and is dropped where `explain_own` explains it
(exclusion.py: a dispute of an average it got that is still remembered, or a pending
rollback from before the step, which the owner named outright sets), confirmed otherwise.

What one stage alone shows of a rank's norm (`Corroboration.lone_stage`: the odd replica's
table is the only witness, which it writes itself) waits the same way (`part_later`), and,
unexplained and confirmed by no second stage, is returned by `release` for the job to open a
dispute between the rank and that odd replica (exclusion.py, `NORM_DISAGREE`; dispute.py).

Only the kinds a wrong input can cause wait: a copy's norm or shape, a zeroed copy (gradients sent
back as zeros zero the stage's own), a non-finite copy, and an owner's own share of its
averages (agent/worker/avgaudit.py: an honest owner whose own gradient a neighbour's x10
activations inflated holds a share near R, as an owner hiding an alteration in its own copy
does). Bounded: at most `MAX_HELD` wait.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.integrity.corroborate import CONFIRMING
from coordinator.integrity.ledger import IntegrityLedger
from coordinator.integrity.linkwitness import LinkWitness
from coordinator.integrity.reports import EvidenceRecord
from dtfm.core.verify import NORM_DIFFERS

log = logging.getLogger(__name__)

HELD_KINDS = frozenset({"grad_norm", "grad_noise", "grad_zero", "grad_nonfinite", "avg_share"})
# kinds that wait for the sender's own stage's records of the same digest instead
OWN_STAGE_KINDS = frozenset({NORM_DIFFERS})
RELEASE_STEPS = 30  # steps past a held fault after which it is confirmed unjudged
UNEXPLAINED = {False: "no wrong pipeline input explains it",
               True: "its own stage disputes no average it got"}
MAX_HELD = 256


@dataclass
class _Held:
    rec: EvidenceRecord
    first: int
    agreeing: tuple[str, ...]
    until: int = 0  # own stage: the step its records must have arrived through (0: not yet)
    part: bool = False  # one stage's witnesses only: a dispute to open, not a fault to confirm

    @property
    def own_stage(self) -> bool:
        return self.rec.kind in OWN_STAGE_KINDS


class HeldConfirmations:
    """The gradient faults of one job waiting for its pipeline links' verdict."""

    def __init__(self, links: LinkWitness, rank_of: Callable[[str], int | None],
                 explain_own: Callable[[EvidenceRecord], str] = lambda rec: "") -> None:
        self.links, self.rank_of, self.explain_own = links, rank_of, explain_own
        self._held: list[_Held] = []

    def defer(self, rec: EvidenceRecord, first: int, agreeing: list[str]) -> bool:
        """Whether `rec`'s confirmation waits (a pipelined job, a kind a wrong input can
        cause, a suspect of the running epoch; or a kind its sender's own stage must judge
        first, which never confirms unheld: with no room to wait, it stays evidence)."""
        if rec.kind in OWN_STAGE_KINDS:
            if self.rank_of(rec.agent_id) is not None and len(self._held) < MAX_HELD:
                self._held.append(_Held(rec, first, tuple(agreeing)))
                log.info("integrity: the fault against %s (%s at step %d) waits for its own "
                         "stage's records of the same digest", rec.agent_id, rec.kind, rec.step)
            return True
        if (self.links.stages < 2 or rec.kind not in HELD_KINDS
                or self.rank_of(rec.agent_id) is None or len(self._held) >= MAX_HELD):
            return False
        self._held.append(_Held(rec, first, tuple(agreeing)))
        log.info("integrity: the fault against %s (%s at step %d) waits for the pipeline "
                 "links' verdict of its steps", rec.agent_id, rec.kind, rec.step)
        return True

    def part_later(self, rec: EvidenceRecord, first: int, agreeing: list[str]) -> bool:
        """Hold `rec`, a rank's norm that one stage's odd replica alone shows
        (`Corroboration.lone_stage`), until its own stage's records are in: unexplained
        then, and confirmed by no second stage meanwhile, it is a dispute between the two
        (`release` returns it). Whether it is held (once per suspect and step)."""
        if rec.kind not in OWN_STAGE_KINDS or self.rank_of(rec.agent_id) is None or \
                len(self._held) >= MAX_HELD or any(
                    h.part and h.rec.agent_id == rec.agent_id and h.rec.step == rec.step
                    for h in self._held):
            return False
        self._held.append(_Held(rec, first, tuple(agreeing), part=True))
        log.info("integrity: %s's norm at step %d, which one stage's replicas alone show, "
                 "waits for its own stage's records before the two are a dispute",
                 rec.agent_id, rec.step)
        return True

    def release(self, ledger: IntegrityLedger, step: int, vetted: int = 0
                ) -> list[EvidenceRecord]:
        """Confirm or drop what the links' verdict now covers (`step`: the job's progress;
        `vetted`: the step through which every member's records have arrived). Returns the
        lone witnesses' records (`part_later`) now judged and unexplained, whose suspect no
        second stage confirmed: each a dispute for the caller to open (exclusion.py)."""
        waiting: list[_Held] = []
        parting: list[EvidenceRecord] = []
        # confirmations first: a lone stage's record whose suspect another stage confirms
        # as well is no dispute
        for h in sorted(self._held, key=lambda h: h.part):
            rank = self.rank_of(h.rec.agent_id)
            if h.own_stage:  # the report that delivered it is at or past its digest
                h.until = h.until or max(step, h.rec.step)
                why = self.explain_own(h.rec)
                judged = vetted >= h.until or step >= h.until + RELEASE_STEPS
            else:
                why = self.links.explained(rank, h.rec.step) if rank is not None else ""
                judged = self.links.judged_through >= h.rec.step or \
                    step >= h.rec.step + RELEASE_STEPS
            if h.part and (ledger.excluded(h.rec.agent_id) or any(
                    not o.part and o.rec.agent_id == h.rec.agent_id
                    for o in (*waiting, *self._held) if o is not h)):
                continue  # confirmed by a second stage, or waiting to be
            if why:
                ledger.record(h.rec.agent_id, h.rec.kind, h.rec.step,
                              f"{h.rec.detail} (not confirmed: {why})",
                              reporter=h.rec.reporter)
            elif judged and h.part:
                parting.append(h.rec)
            elif judged:
                ledger.record(h.rec.agent_id, h.rec.kind, h.first,
                              f"{h.rec.detail} (score {h.rec.score:.3g}, epoch "
                              f"{h.rec.epoch}, confirmed by a second reporter; "
                              f"{UNEXPLAINED[h.own_stage]})",
                              reporter=h.rec.reporter, confirmed=True,
                              agreeing=h.agreeing, agreeing_kinds=CONFIRMING)
            else:
                waiting.append(h)
        self._held = waiting
        return parting

    def earliest(self) -> int:
        """The first bad step of the earliest fault waiting (0: none): the agents keep the
        checkpoint before it until it is confirmed or explained (exclusion.py)."""
        return min((h.first for h in self._held), default=0)

    def epoch_ended(self) -> None:
        """A new epoch: what still waits covered steps the old one's links judge no more.
        Dropped: a recovery rolls those steps back or replays them, and a fault that lasts
        shows again, with the new epoch's links judged beside it."""
        if self._held:
            log.info("integrity: %d gradient fault(s) waiting for the pipeline links' verdict "
                     "lapse with their epoch (%s)", len(self._held),
                     ", ".join(sorted({h.rec.agent_id for h in self._held})))
        self._held = []
