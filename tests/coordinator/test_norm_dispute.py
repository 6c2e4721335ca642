"""A rank's norm that one stage alone shows is a dispute between that stage's odd replica and
the rank (issue 43). The table that shows it is the odd replica's own row: a replica that
drifted and wrote another norm there escaped the digest (nobody named it, and one stage's
records never confirm), and a rank that sent its pipeline another norm in a two-stage job
(or to one stage only) stayed evidence. Now the two are parted into different pipelines
(dispute.py, `PIPELINE`), and whichever disputes its new partner too is the agent common to
two disputes: confirmed."""

from __future__ import annotations

from coordinator.integrity.corroborate import Corroboration
from coordinator.integrity.dispute import (
    APART,
    PENDING,
    Apart,
    Disputes,
    pipeline_pairs,
    separate,
)
from coordinator.integrity.explained import HeldConfirmations
from coordinator.integrity.ledger import COORDINATOR, IntegrityLedger
from coordinator.integrity.linkwitness import LinkWitness
from coordinator.integrity.reports import EvidenceRecord
from dtfm.core.verify import NORM_DISAGREE
from protos.dtfm.v1 import coordinator_pb2
from tests.coordinator.test_explained import AGENTS, jobs_integrity, norm_differs


def test_one_stages_agreeing_reporters_are_a_lone_witness_two_stages_confirm() -> None:
    c, lone = Corroboration(), []

    def note(rec: EvidenceRecord, first: int, agreeing: list[str]) -> bool:
        lone.append((rec.reporter, first, tuple(agreeing)))
        return True
    ledger = IntegrityLedger()
    c.feed([norm_differs("a1", 12, "a0", 0)], ledger, lone=note)
    assert lone == []  # one reporter: nothing yet
    c.feed([norm_differs("a1", 12, "a2", 0)], ledger, lone=note)
    assert lone == [("a2", 12, ("a0", "a2"))]
    confirmed: list[str] = []

    def wait(rec: EvidenceRecord, first: int, agreeing: list[str]) -> bool:
        confirmed.append(rec.reporter)
        return True
    c.feed([norm_differs("a1", 12, "a3", 2)], ledger, lone=note, defer=wait)
    assert confirmed == ["a3"] and len(lone) == 1  # a second stage: confirming, not lone


def held() -> tuple[HeldConfirmations, IntegrityLedger]:
    ranks = {a: r for r, a in enumerate(AGENTS)}
    return HeldConfirmations(LinkWitness(), ranks.get), IntegrityLedger()


def test_a_lone_witness_waits_then_is_returned_once_for_a_dispute() -> None:
    h, ledger = held()
    rec = norm_differs("a1", 12)
    assert h.part_later(rec, 12, ["a0", "a2"])
    assert not h.part_later(norm_differs("a1", 12, "a4"), 12, ["a0", "a4"])  # once per step
    assert not h.part_later(norm_differs("zz", 12), 12, ["a0", "a2"])  # of no rank
    assert h.release(ledger, 20, vetted=18) == []  # members' records short of its report
    assert h.release(ledger, 21, vetted=20) == [rec]
    assert h.release(ledger, 22, vetted=22) == [] and not ledger.exclusions


def test_a_lone_witness_whose_suspect_a_second_stage_confirms_is_no_dispute() -> None:
    h, ledger = held()
    assert h.part_later(norm_differs("a1", 12), 12, ["a0", "a2"])
    assert h.defer(norm_differs("a1", 12, "a3", 2), 12, ["a0", "a3"])  # waits to confirm
    assert h.release(ledger, 21, vetted=20) == []  # the lone witness is dropped at once
    assert ledger.excluded("a1") is None  # the confirmation waits for its own stage
    assert h.release(ledger, 22, vetted=21) == [] and ledger.excluded("a1") is not None


def test_an_explained_lone_witness_stays_evidence() -> None:
    ranks = {a: r for r, a in enumerate(AGENTS)}
    h = HeldConfirmations(LinkWitness(), ranks.get,
                          lambda rec: "its own stage disputes the average it got")
    ledger = IntegrityLedger()
    assert h.part_later(norm_differs("a1", 12), 12, ["a0", "a2"])
    assert h.release(ledger, 21, vetted=21) == []
    (piece,) = ledger.evidence("a1")
    assert not piece.confirmed and "not confirmed: its own stage disputes" in piece.detail


def norm_dispute(odd: str, sender: str, step: int, epoch: int = 1) -> EvidenceRecord:
    return EvidenceRecord("", NORM_DISAGREE, step, "", COORDINATOR, -1, 1.0, epoch,
                          (odd, sender), 0)


def test_a_pipelines_pair_is_parted_into_two_pipelines_and_its_common_agent_confirmed(
        ) -> None:
    grid = [[0, 2, 4], [1, 3, 5]]  # 2 stages x 3 replicas, by rank
    assert frozenset((0, 1)) in pipeline_pairs(grid) and frozenset((0, 3)) not in \
        pipeline_pairs(grid)
    parted = separate(grid, Apart(set(), set(), {frozenset((0, 1))}))
    assert parted is not None and frozenset((0, 1)) not in pipeline_pairs(parted)
    assert sorted(map(sorted, parted)) == sorted(map(sorted, grid))  # one swap in a stage
    d, ledger = Disputes(), IntegrityLedger()
    assert d.feed([norm_dispute("a0", "a1", 12)], ledger)
    assert "stages of one pipeline" in d.replan_reason
    assert d.apart(AGENTS) == Apart(set(), set(), {frozenset((0, 1))})
    d.planned([["a0", "a2", "a4"], ["a3", "a1", "a5"]])  # a1 now in a2's pipeline
    assert d.disputes[0].done == APART
    # a liar a1 sends its new partner another norm too: the agent common to both
    d.feed([norm_dispute("a2", "a1", 30, epoch=2)], ledger)
    assert ledger.excluded("a1") is not None and ledger.excluded("a0") is None


def test_a_pipelines_dispute_is_the_coordinators_and_confirms_with_no_other_relation() -> None:
    d, ledger = Disputes(), IntegrityLedger()
    forged = EvidenceRecord("", NORM_DISAGREE, 12, "", "a0", -1, 1.0, 1, ("a0", "a1"), 0)
    assert not d.feed([forged], ledger) and not d.disputes  # a worker cannot open one
    assert d.feed([norm_dispute("a0", "a1", 12)], ledger)
    avg = EvidenceRecord("", "avg_disagree", 14, "", "a1", -1, 1.0, 1, ("a1", "a3"), 1)
    d.feed([avg], ledger)  # a1 with another partner, of another relation: not confirmed
    assert not ledger.exclusions and [x.done for x in d.disputes] == [PENDING, PENDING]


def test_the_jobs_integrity_opens_the_dispute_a_lone_stage_shows() -> None:
    """2 x 3 (rank = replica * 2 + stage): stage 0's replicas a0, a2, a4 find a0 odd and a0's
    table shows another norm from a1, its pipeline's stage 1; stage 1's own digest finds
    nothing (a1's weights agree). Once every member's records are in, a0 and a1 dispute."""
    integrity = jobs_integrity()
    Corroboration().feed([norm_differs("a1", 20, r) for r in ("a0", "a2", "a4")],
                         integrity.ledger, defer=integrity.defer, lone=integrity.lone)
    report = coordinator_pb2.ProgressReport(epoch=1, step=20)
    assert not integrity.witness("a0", report) and not integrity.disputes.disputes
    integrity.keep_floor(0, [(21, 21)] * 6)  # every member's records through step 21
    assert integrity.witness("a0", coordinator_pb2.ProgressReport(epoch=1, step=21))
    (opened,) = integrity.disputes.disputes
    assert opened.pair == {"a0", "a1"} and opened.kind == NORM_DISAGREE
    assert integrity.disputes.rollback_before and not integrity.ledger.exclusions
