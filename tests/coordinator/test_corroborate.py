"""Replica-check evidence confirms a fault only when two agents other than the suspect name it
within a window of steps, and a statistical kind (`grad_norm`) only when each of them named it
at several steps (coordinator/integrity/corroborate.py)."""

from __future__ import annotations

from coordinator.integrity.corroborate import PERSIST_STEPS, WINDOW_STEPS, Corroboration
from coordinator.integrity.ledger import IntegrityLedger
from coordinator.integrity.reports import EvidenceRecord
from coordinator.integrity.status import SHOWN, agent_integrity_json, integrity_status
from dtfm.core.verify import COPY_WINDOW
from protos.dtfm.v1 import common_pb2, coordinator_pb2


def rec(suspect: str, reporter: str, step: int, epoch: int = 1,
        kind: str = "grad_zero") -> EvidenceRecord:
    return EvidenceRecord(agent_id=suspect, kind=kind, step=step, detail="its copy is all zeros",
                          reporter=reporter, suspect_rank=2 if suspect else -1, score=10.0,
                          epoch=epoch, candidates=(suspect,) if suspect else ("a", "b"))


def test_two_reporters_confirm_and_the_first_bad_step_is_the_earliest_named() -> None:
    c = Corroboration()
    assert c.weigh(rec("bad", "a", 9)) == (False, 9)
    assert c.weigh(rec("bad", "a", 10)) == (False, 10)  # the same reporter again: not enough
    assert c.weigh(rec("bad", "b", 11)) == (True, 9)


def test_one_liar_cannot_confirm_nor_can_the_suspect_itself() -> None:
    c = Corroboration()
    for step in range(1, 30):
        assert c.weigh(rec("honest", "liar", step))[0] is False
        assert c.weigh(rec("honest", "honest", step))[0] is False  # weights: all report


def test_reports_far_apart_or_in_other_epochs_do_not_agree() -> None:
    c = Corroboration()
    assert not c.weigh(rec("x", "a", 5))[0]
    assert not c.weigh(rec("x", "b", 5 + WINDOW_STEPS + 1))[0]
    assert not c.weigh(rec("x", "a", 40, epoch=2))[0]  # a new epoch starts afresh
    c2 = Corroboration()
    c2.weigh(rec("x", "a", 5, epoch=1))
    assert not c2.weigh(rec("x", "b", 6, epoch=2))[0]


def test_an_honest_outlier_named_at_one_step_by_every_replica_is_not_confirmed() -> None:
    """What a 1000-step honest run showed: a copy of a hard batch is 3-7x the median norm at
    an isolated step, and both other replicas of its stage name it (11 such steps)."""
    c = Corroboration()
    for step in (82, 82 + WINDOW_STEPS + 20, 146, 222):
        for reporter in ("a", "b"):
            assert not c.weigh(rec("honest", reporter, step, kind="grad_norm"))[0], step
    # twice within the window by both: still not enough
    assert not c.weigh(rec("honest", "a", 150, kind="grad_norm"))[0]
    assert not c.weigh(rec("honest", "b", 150, kind="grad_norm"))[0]


def test_a_scaled_copy_named_at_consecutive_steps_is_confirmed_from_its_first() -> None:
    c = Corroboration()
    onset = 8
    verdicts = []
    for step in range(onset, onset + PERSIST_STEPS):
        verdicts += [c.weigh(rec("bad", "a", step, kind="grad_norm")),
                     c.weigh(rec("bad", "b", step, kind="grad_norm"))]
    assert verdicts[-1] == (True, onset)  # within PERSIST_STEPS of the onset
    assert not any(v[0] for v in verdicts[:-1])
    # a sure kind needs no persistence: one agreeing step
    c2 = Corroboration()
    assert not c2.weigh(rec("bad", "a", 8, kind="avg_zero"))[0]
    assert c2.weigh(rec("bad", "b", 8, kind="avg_zero")) == (True, 8)


def test_a_gradients_direction_alone_never_confirms() -> None:
    c = Corroboration()
    for step in range(5, 5 + 2 * PERSIST_STEPS):
        assert not c.weigh(rec("x", "a", step, kind="grad_cosine"))[0]
        assert not c.weigh(rec("x", "b", step, kind="grad_cosine"))[0]


def test_a_noised_copy_is_confirmed_by_its_shape_only_when_it_persists() -> None:
    """Noise of one sigma flattens a gradient's shape at most steps, where honest copies did at
    isolated steps (5 pieces in 1000 honest steps): two reporters naming it at `PERSIST_STEPS`
    steps each within the window confirm it; an isolated step, or two, by both do not."""
    c = Corroboration()
    for step in (30, 31):
        for reporter in ("a", "b"):
            assert not c.weigh(rec("honest", reporter, step, kind="grad_noise"))[0]
    c = Corroboration()
    verdicts = []
    for step in (8, 10, 13):  # flagged at most steps, not every one
        verdicts += [c.weigh(rec("bad", "a", step, kind="grad_noise")),
                     c.weigh(rec("bad", "b", step, kind="grad_noise"))]
    # the first step proven bad: step 8's record may be a window's median (quiet energy),
    # which an attack from step 8 - COPY_WINDOW + 1 on can have crossed
    assert verdicts[-1] == (True, 8 - COPY_WINDOW + 1) and not any(v[0] for v in verdicts[:-1])


def test_feed_records_evidence_and_excludes_on_confirmation_only() -> None:
    ledger = IntegrityLedger()
    c = Corroboration()
    c.feed([rec("", "a", 3, kind="grad_disagree")], ledger)  # undecided: nobody is named
    assert ledger.suspects() == []
    c.feed([rec("bad", "a", 8)], ledger)
    assert ledger.excluded("bad") is None and [e.step for e in ledger.evidence("bad")] == [8]
    c.feed([rec("bad", "b", 9)], ledger)
    exclusion = ledger.excluded("bad")
    assert exclusion is not None and exclusion.step == 8
    assert ledger.rollback_before == 8
    assert ledger.excluded("a") is None and ledger.excluded("b") is None
    # the exclusion carries every agreeing reporter's record, not only the one that came last
    # (a demo under load once showed one reporter for a fault two had confirmed)
    assert {e.reporter for e in exclusion.evidence} == {"a", "b"}
    assert all(e.confirmed for e in exclusion.evidence)
    assert [e.confirmed for e in ledger.evidence("bad")] == [True, True]


def test_a_confirmation_marks_the_agreeing_reporters_newest_piece_only() -> None:
    ledger = IntegrityLedger()
    c = Corroboration()
    c.feed([rec("bad", "a", 2), rec("bad", "a", 3), rec("bad", "liar-of-nothing", 30),
            rec("bad", "a", 4, kind="grad_cosine")], ledger)  # a kind that never confirms
    c.feed([rec("bad", "b", 4)], ledger)
    pieces = ledger.evidence("bad")
    assert [(e.reporter, e.step, e.confirmed) for e in pieces] == [
        ("a", 2, False), ("a", 3, True), ("liar-of-nothing", 30, False), ("a", 4, False),
        ("b", 2, True)]
    assert [e.reporter for e in ledger.excluded("bad").evidence] == ["a", "b"]


def test_status_shows_every_confirming_reporter_after_later_reports_crowd_the_list() -> None:
    """A demo under load: one victim's reports confirmed the fault, then the other victim's
    next ten reports (confirmed too) filled the row's newest pieces, and `status --json`
    named that victim alone. The exclusion keeps its own pieces on the wire."""
    ledger = IntegrityLedger()
    c = Corroboration()
    c.feed([rec("bad", "a", s, kind="avg_zero") for s in (8, 9, 10)], ledger)
    c.feed([rec("bad", "b", 8, kind="avg_zero")], ledger)
    c.feed([rec("bad", "a", s, kind="avg_zero") for s in range(11, 11 + 2 * SHOWN)], ledger)
    row = integrity_status(coordinator_pb2.AgentStatus(
        info=common_pb2.AgentInfo(agent_id="bad")), ledger)
    shown = agent_integrity_json(row)
    assert {e["reporter"] for e in shown["evidence"]} == {"a"}  # the newest pieces: a's
    assert {e["reporter"] for e in shown["exclusion"]["evidence"]} == {"a", "b"}
    assert all(e["confirmed"] and e["kind"] == "avg_zero"
               for e in shown["exclusion"]["evidence"])
    assert shown["exclusion"]["step"] == 8
