"""The evidence ledger's rules (coordinator/integrity/ledger.py) and the rollback's arithmetic
(coordinator/integrity/rollback.py): pure, in milliseconds."""

from __future__ import annotations

from coordinator.integrity import ledger as ledger_mod
from coordinator.integrity import rollback
from coordinator.integrity.ledger import IntegrityLedger


def test_only_a_confirmed_fault_excludes_and_its_step_bounds_the_rollback() -> None:
    excluded: list[str] = []
    ledger = IntegrityLedger()
    ledger.on_exclude = lambda agent_id, exclusion: excluded.append(agent_id)
    assert not ledger.record("a1", "dial_vote", detail="a lone refusal", reporter="a2")
    assert not ledger.record("a1", "gradient_outlier", 12, "norm 10x the median",
                             reporter="a3")
    assert excluded == [] and ledger.rollback_before == 0
    assert ledger.record("a1", "weight_digest", 15, "odd one out of 3", confirmed=True)
    assert ledger.record("a4", "gradient_outlier", 9, "cosine -1", confirmed=True)
    assert excluded == ["a1", "a4"] and ledger.total_exclusions == 2
    assert ledger.rollback_before == 9  # the first step proven bad, over both faults
    x = ledger.excluded("a1")
    assert x is not None and x.step == 15 and "odd one out" in x.reason
    assert "coordinator admit a1" in ledger.refusal("a1") and ledger.refusal("a2") == ""
    assert [e.kind for e in ledger.evidence("a1")] == ["dial_vote", "gradient_outlier",
                                                       "weight_digest"]
    ledger.rolled_back()
    assert ledger.rollback_before == 0
    assert ledger.admit("a1") is not None and ledger.admit("a1") is None
    assert ledger.refusal("a1") == "" and len(ledger.evidence("a1")) == 3  # kept on record


def test_an_excluded_reporter_accuses_nobody() -> None:
    ledger = IntegrityLedger()
    ledger.record("liar", "tampered_frame", 3, "MAC failed", confirmed=True)
    assert not ledger.record("honest", "gradient_outlier", 4, "says the liar",
                             reporter="liar", confirmed=True)
    assert ledger.evidence("honest") == [] and ledger.excluded("honest") is None


def test_the_ledger_survives_a_round_trip_and_stays_bounded() -> None:
    ledger = IntegrityLedger()
    for i in range(ledger_mod.MAX_EVIDENCE + 5):
        ledger.record("noisy", "link_figure", detail="x" * 1000, reporter=f"p{i}")
    ledger.record("bad", "weight_digest", 7, "odd one out", confirmed=True)
    back = IntegrityLedger(ledger.to_json())
    assert len(back.evidence("noisy")) == ledger_mod.MAX_EVIDENCE
    assert len(back.evidence("noisy")[0].detail) == ledger_mod.MAX_DETAIL
    assert back.excluded("bad") is not None and back.rollback_before == 7
    assert back.total_exclusions == 1
    flood = IntegrityLedger()
    for i in range(ledger_mod.MAX_SUSPECTS + 10):
        flood.record(f"id{i}", "dial_vote")
    assert len(flood.suspects()) == ledger_mod.MAX_SUSPECTS


def test_a_known_good_checkpoint_is_kept_to_roll_back_to() -> None:
    # every 4 steps: at step 30 the checkpoint of step 20 is 10 steps behind, unchallenged
    assert rollback.known_good(30, 4) == 20
    assert rollback.known_good(9, 4) == 0  # nothing vetted yet
    assert rollback.known_good(100, 4, sync_every=8) == 16  # 10 rounds of 8 steps
    assert rollback.keep_floor(0, 30, 4, 1, 0) == 20
    assert rollback.keep_floor(12, 30, 4, 1, 0) == 12  # a mirror's older floor wins
    # a pending rollback before step 27 keeps the checkpoint of step 24 it resumes from
    assert rollback.keep_floor(0, 30, 4, 1, 27) == 24
    assert rollback.newest_before(27, 4) == 24 and rollback.newest_before(4, 4) == 0
    assert rollback.keep_floor(0, 30, 0, 1, 0) == 0  # no checkpoints: no floor
    assert rollback.keep_floor(0, 9, 4, 1, 0) == 1  # nothing vetted yet: keep every step


def test_checkpoints_are_vetted_through_every_members_delivered_evidence() -> None:
    # (step, integrity_through) per member; the epoch started from step 8
    assert rollback.vetted_step([(30, 30), (30, 30)], 8) == 30
    assert rollback.vetted_step([(30, 30), (30, 15)], 8) == 15  # one's records lag
    assert rollback.vetted_step([(30, 30), None], 8) == 8  # one has not reported yet
    assert rollback.vetted_step([(30, 30), (12, 99)], 8) == 12  # never past its own step
    assert rollback.vetted_step([(30, 30), (30, 0)], 8) == 8  # an older agent says nothing
    assert rollback.vetted_step([], 8) == 8


def test_a_restarted_coordinator_lifts_the_bound_its_adopted_epoch_was_planned_with() -> None:
    from coordinator.daemon.registry import Registry
    from coordinator.integrity.exclusion import JobIntegrity
    from protos.dtfm.v1 import common_pb2

    class Tracker:
        step = 12

    first = JobIntegrity(Registry(liveness_timeout_s=10), Tracker())
    first.checkpoint_every = 4
    first.ledger.record("bad", "weight_digest", 10, "odd one out", confirmed=True)
    assignments = [common_pb2.Assignment(), common_pb2.Assignment()]
    first.plan_epoch(assignments, sync_every=1)
    assert [a.resume_before for a in assignments] == [10, 10]
    assert first.checkpoints.step == 8  # the newest checkpoint before step 10
    again = JobIntegrity(Registry(liveness_timeout_s=10), Tracker())
    again.restore(first.to_json())  # the adopted epoch's own checkpoint lifts the bound
    assert again.ledger.rollback_before == 10 and again.refusal("bad")
    again.checkpointed()
    assert again.ledger.rollback_before == 0
