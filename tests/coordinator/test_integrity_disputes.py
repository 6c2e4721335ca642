"""R = 2: a disagreement of two replicas is settled by placing them apart; the agent common to
two disputes with different partners is the confirmed fault (coordinator/integrity/dispute.py),
and the job re-plans, rolls back and excludes accordingly (coordinator/job/machine.py)."""

from __future__ import annotations

from types import SimpleNamespace

from coordinator.daemon.config import JobConfig
from coordinator.integrity.corroborate import Corroboration
from coordinator.integrity.dispute import (
    MEMORY_STEPS,
    Apart,
    Disputes,
    neighbour_pairs,
    restore,
    separate,
)
from coordinator.integrity.exclusion import JobIntegrity
from coordinator.integrity.ledger import IntegrityLedger
from coordinator.integrity.reports import EvidenceRecord
from dtfm.core.spec import TrainConfig
from dtfm.core.verify import COPY_WINDOW, DIGEST_EVERY, PAIR_WINDOW, onset
from dtfm.core.workerstate import WorkerState
from protos.dtfm.v1 import coordinator_pb2
from tests.coordinator.test_integrity_exclusion import excluding
from tests.coordinator.test_job_churn import report_all
from tests.coordinator.test_job_states import FakeRegistry, Harness, run, until

S = coordinator_pb2
PARTED = [["x", "y", "liar", "honest", "bad2"], ["b", "c", "z", "bad1"]]  # a plan's rows


def dispute(a: str, b: str, step: int, *, reporter: str = "", epoch: int = 1,
            kind: str = "grad_disagree", stage: int = 0) -> EvidenceRecord:
    return EvidenceRecord(agent_id="", kind=kind, step=step, detail="norm ratio 9.8 over the "
                          "last 9 steps", reporter=reporter or a, suspect_rank=-1, score=9.8,
                          epoch=epoch, candidates=(a, b), stage=stage)


FRESH = 12 + PAIR_WINDOW  # the first verdict whose window holds none of steps 1..12


def test_a_disagreement_asks_to_part_the_pair_and_roll_back_before_its_window() -> None:
    ledger, d = IntegrityLedger(), Disputes()
    assert d.feed([dispute("x", "b", 12)], ledger)
    assert d.rollback_before == 12 - PAIR_WINDOW + 1  # a window's median: it began by then
    assert "b and x" in d.replan_reason and "apart" in d.replan_reason
    assert {e.confirmed for a in ("x", "b") for e in ledger.evidence(a)} == {False}
    assert not ledger.exclusions
    # the same disagreement again (every step, from both owners) asks for nothing more
    assert not d.feed([dispute("b", "x", 13), dispute("x", "b", 14, reporter="b")], ledger)
    assert d.apart(["b", "c", "x"]).stage == {frozenset((0, 2))}
    d.planned(PARTED)
    assert d.replan_reason == ""


def test_the_agent_common_to_two_disputes_with_new_partners_is_excluded() -> None:
    """x disputes b at step 12; placed apart and rolled back, x disputes its new partner c on
    fresh steps too (a replay of steps 1..12 is no evidence:
    test_a_replay_of_the_disputed_steps_by_a_new_pair_is_neither_a_dispute_nor_a_verdict)."""
    ledger, d = IntegrityLedger(), Disputes()
    d.feed([dispute("x", "b", 12)], ledger)
    d.planned(PARTED)
    assert not d.feed([dispute("x", "c", FRESH, epoch=2)], ledger)
    exclusion = ledger.excluded("x")
    assert exclusion is not None and exclusion.step == 12 - PAIR_WINDOW + 1
    assert "b" in exclusion.reason and "c" in exclusion.reason
    assert set(ledger.exclusions) == {"x"}
    assert ledger.rollback_before == exclusion.step


def test_a_liar_reporting_disputes_it_did_not_see_names_itself() -> None:
    """Only a member of the pair may report its dispute, so the liar is in every one."""
    ledger, d = IntegrityLedger(), Disputes()
    assert not d.feed([dispute("b", "c", 12, reporter="liar")], ledger)  # not its pair
    d.feed([dispute("liar", "b", 12)], ledger)
    d.planned(PARTED)
    d.feed([dispute("liar", "c", FRESH, epoch=2)], ledger)
    assert set(ledger.exclusions) == {"liar"}


def test_a_partner_with_a_dispute_of_its_own_keeps_it_from_confirming() -> None:
    """Two bad agents disputing one honest agent in turn must not frame it while either has a
    dispute of its own. Ambiguous from then on (honest, too, disputed two): nobody is named,
    and the disputes stay evidence until they lapse."""
    ledger, d = IntegrityLedger(), Disputes()
    d.feed([dispute("bad2", "z", 10)], ledger)
    d.feed([dispute("honest", "bad1", 11)], ledger)
    d.planned(PARTED)
    assert d.feed([dispute("honest", "bad2", FRESH, epoch=2)], ledger)  # a new dispute only
    assert not ledger.exclusions
    d.planned(PARTED)
    d.feed([dispute("bad1", "y", FRESH + 1, epoch=3)], ledger)  # bad1: honest, then y
    assert not ledger.exclusions


def test_a_dispute_not_repeated_within_the_settling_window_lapses() -> None:
    ledger, d = IntegrityLedger(), Disputes()
    d.feed([dispute("x", "b", 12)], ledger)
    d.planned(PARTED)
    late = 12 + MEMORY_STEPS + 1
    assert d.feed([dispute("x", "c", late, epoch=2)], ledger)  # a new dispute, no verdict
    assert not ledger.exclusions
    assert d.apart(["b", "c", "x"]).stage == {frozenset((1, 2))}  # x and b may meet again


def test_a_pair_that_no_placement_can_part_stays_evidence() -> None:
    ledger, d = IntegrityLedger(), Disputes()
    assert not d.feed([dispute("x", "b", 12)], ledger, separable=False)
    assert d.rollback_before == 0 and d.replan_reason == "" and not d.apart(["x", "b"])
    assert "no placement can part them" in ledger.evidence("x")[0].detail
    assert not d.feed([dispute("x", "b", 40)], ledger, separable=False)  # still that one


def test_where_no_swap_parts_a_pair_a_spare_replaces_the_disputed_one() -> None:
    """One stage (or rank order): x disputes b; the next epoch trains x beside a spare c in
    place of b. x disputing c too names x; a quiet epoch leaves b out while the dispute
    stands, and nobody excluded."""
    for x_lies in (True, False):
        ledger, d = IntegrityLedger(), Disputes()
        assert d.feed([dispute("x", "b", 12)], ledger, separable=True, by_spare=True)
        assert "training x beside a spare agent in place of b" in d.replan_reason
        assert d.rollback_before == 12 - PAIR_WINDOW + 1
        assert "beside a spare" in ledger.evidence("b")[0].detail
        assert d.benched(["x", "b", "c"]) == {"b"}
        assert d.benched(["x", "c"]) == set()  # only a pair both planned on
        assert not d.apart(["x", "c"])
        d.planned([["x", "c"]])
        assert d.replan_reason == "" and d.disputes[0].done == "apart"
        # while it is remembered, b sits out again wherever a spare can take its place
        assert d.benched(["x", "b", "c", "y"]) == {"b"}
        if x_lies:
            assert not d.feed([dispute("x", "c", FRESH, epoch=2)], ledger,
                              separable=True, by_spare=True)
            assert set(ledger.exclusions) == {"x"}
        else:
            assert not ledger.exclusions


def test_the_reporter_keeps_its_place_when_a_spare_settles_its_dispute() -> None:
    ledger, d = IntegrityLedger(), Disputes()
    d.feed([dispute("x", "b", 12, reporter="b")], ledger, separable=True, by_spare=True)
    assert d.benched(["b", "x", "c"]) == {"x"}
    assert "training b beside a spare agent in place of x" in d.replan_reason


def test_weights_that_differ_where_no_placement_parts_them_resume_from_one_checkpoint() -> None:
    """Two replicas of a one-stage job whose weights differ never agree again by training:
    nobody can be named, but both go back to one checkpoint before the drift."""
    ledger, d = IntegrityLedger(), Disputes()
    assert d.feed([dispute("x", "b", 20, kind="weights_disagree")], ledger, separable=False)
    assert d.rollback_before == 20 - DIGEST_EVERY + 1 and "resume" in d.replan_reason
    assert not d.apart(["x", "b"])
    d.planned([["x", "b"]])
    d.rolled_back()
    assert d.rollback_before == 0 and not ledger.exclusions


def test_separate_moves_one_of_a_pair_to_another_stage() -> None:
    grid = [[0, 1], [2, 3]]  # stage 0 holds 0 and 1
    parted = separate(grid, Apart({frozenset((0, 1))}, set()))
    assert parted is not None and sorted(sum(parted, [])) == [0, 1, 2, 3]
    assert all(not {0, 1} <= set(row) for row in parted)
    assert separate(grid, Apart({frozenset((0, 2))}, set())) == grid  # apart: unchanged
    # one stage: nobody to swap with
    assert separate([[0, 1]], Apart({frozenset((0, 1))}, set())) is None
    three = separate([[0, 1], [2, 3], [4, 5]], Apart({frozenset((0, 1)), frozenset((2, 3)),
                                                      frozenset((0, 2))}, set()))
    assert three is not None and all(len(row) == 2 for row in three)
    assert not any(p <= set(row) for row in three
                   for p in ({0, 1}, {2, 3}, {0, 2}))


def test_onsets_cover_what_a_verdict_looks_back_over() -> None:
    assert onset("grad_norm", 12) == 12
    assert onset("grad_disagree", 12) == 12 - PAIR_WINDOW + 1
    assert onset("grad_noise", 12) == 12 - COPY_WINDOW + 1  # a window's median may say it
    assert onset("weights", 20) == 20 - DIGEST_EVERY + 1
    assert onset("weights_disagree", 16, sync_every=4) == 13
    assert onset("weights", 3) == 1


def test_a_weights_digest_confirmed_rolls_back_before_the_previous_comparison() -> None:
    """Weights that differ at a digest may have drifted any time since the last one matched,
    and the honest replicas averaged the drifted replica's gradients since."""
    ledger, c = IntegrityLedger(), Corroboration()
    for reporter in ("a", "b"):
        c.feed([EvidenceRecord("bad", "weights", 20, "the odd digest", reporter, 2, 2.0, 1,
                               ("bad",))], ledger)
    exclusion = ledger.excluded("bad")
    assert exclusion is not None and exclusion.step == 20 - DIGEST_EVERY + 1


def test_disputes_survive_a_coordinator_restart() -> None:
    ledger, d = IntegrityLedger(), Disputes()
    d.feed([dispute("x", "b", 12)], ledger)
    d.planned(PARTED)
    again = restore(d.to_json())
    assert again.disputes == d.disputes and again.rollback_before == d.rollback_before
    again.feed([dispute("x", "c", FRESH, epoch=2)], ledger)
    assert set(ledger.exclusions) == {"x"}
    assert restore(None).disputes == [] and restore({"disputes": [{"bad": 1}]}).disputes == []


def test_a_job_parts_a_disputed_pair_rolls_back_and_excludes_the_common_agent() -> None:
    """The state machine: 2 x 2 on four agents; x and its stage partner disagree at step 12;
    the job stops, plans x in the other stage resuming before step 8, and when x disputes its
    new partner too it is excluded and the job shrinks."""
    async def body(h: Harness) -> None:
        excluding(h)
        await h.running_epoch(1)
        report_all(h, 10)  # every member passed the checkpoint of step 8
        await until(lambda: h.job.checkpoint_step == 8)
        grid = [list(row.agent_ids) for row in h.job.plan.grid]  # type: ignore[union-attr]
        x, partner = grid[0]
        assert h.job.integrity.settle([dispute(x, partner, 16)])
        h.job.poke()
        await h.running_epoch(2)
        rec = h.job.recoveries.items[-1]
        assert "apart" in rec.reason and x in rec.reason
        grid2 = [list(row.agent_ids) for row in h.job.plan.grid]  # type: ignore[union-attr]
        assert not any({x, partner} <= set(row) for row in grid2), grid2
        assert "placed apart" in h.job.plan.algorithm  # type: ignore[union-attr]
        assigned = [h.registry.agents[a].assignments()[-1] for a in h.job.members]
        assert {a.resume_before for a in assigned} == {16 - PAIR_WINDOW + 1}
        assert h.job.checkpoint_step == 4  # 8 is the dispute's onset: not before it
        report_all(h, 5)
        stage = next(i for i, row in enumerate(grid2) if x in row)
        new_partner = next(a for a in grid2[stage] if a != x)
        fresh = 16 + PAIR_WINDOW  # its window holds no step the first dispute judged
        h.job.integrity.settle([dispute(x, new_partner, fresh, reporter=new_partner, epoch=2,
                                        stage=stage)])
        await h.running_epoch(3)
        assert x not in h.job.members and h.registry.states[x] == S.AGENT_STATE_EXCLUDED
        assert h.job.integrity.ledger.excluded(partner) is None
        assigned = [h.registry.agents[a].assignments()[-1] for a in h.job.members]
        assert {a.resume_before for a in assigned} == {16 - PAIR_WINDOW + 1}  # the earlier
        for a in h.job.members:
            h.report(a, WorkerState.TRAINING, step=5)

    run(dispute_job(stages=2, replicas=2), body, agents=4)


def dispute_job(stages: int, replicas: int) -> JobConfig:
    """A scheduled job of `stages` x `replicas` gpt-tiny, checkpoints every 4 steps."""
    cfg = JobConfig(model="gpt-tiny", agents=stages * replicas, stages=stages,
                    replicas=replicas, min_agents=2,
                    train=TrainConfig(global_batch=8, micro_batches=2, steps=20,
                                      checkpoint_every=4),
                    measure_links=True, placement="scheduled", search_seconds=0.5)
    cfg.validate()
    return cfg


def test_a_one_stage_job_trains_the_reporter_beside_a_spare_and_excludes_a_repeat() -> None:
    """The state machine: 1 x 2 on three agents, one a spare. x disputes its partner; the job
    stops, rolls back before the dispute's window and plans x beside the spare; x disputes the
    spare too and is excluded, and the job goes on with the other two."""
    async def body(h: Harness) -> None:
        excluding(h)
        await h.running_epoch(1)
        x, partner = h.job.members
        spare = next(a for a in h.registry.agents if a not in (x, partner))
        report_all(h, 10)
        await until(lambda: h.job.checkpoint_step == 8)
        assert h.job.integrity.separable and h.job.integrity.by_spare
        assert h.job.integrity.settle([dispute(x, partner, 16)])
        h.job.poke()
        await h.running_epoch(2)
        assert "beside a spare agent in place of" in h.job.recoveries.items[-1].reason
        assert set(h.job.members) == {x, spare}, h.job.members
        assigned = [h.registry.agents[a].assignments()[-1] for a in h.job.members]
        assert {a.resume_before for a in assigned} == {16 - PAIR_WINDOW + 1}
        report_all(h, 5)
        h.job.integrity.settle([dispute(x, spare, 16 + PAIR_WINDOW, reporter=spare, epoch=2)])
        await h.running_epoch(3)
        assert h.registry.states[x] == S.AGENT_STATE_EXCLUDED
        assert set(h.job.members) == {partner, spare}
        assert h.job.integrity.ledger.excluded(partner) is None

    run(dispute_job(stages=1, replicas=2), body, agents=3)


def test_a_restarted_coordinator_keeps_the_jobs_disputes() -> None:
    before = JobIntegrity(FakeRegistry(), SimpleNamespace(step=8))  # type: ignore[arg-type]
    before.separable = True
    assert before.settle([dispute("x", "b", 16)])
    assert before.pending_bound() == 8
    after = JobIntegrity(FakeRegistry(), SimpleNamespace(step=8),  # type: ignore[arg-type]
                         saved=before.to_json())
    assert after.disputes.disputes == before.disputes.disputes
    assert after.pending_bound() == 8
    # stopped before the re-plan it asked for: the restarted coordinator still makes it
    assert "b and x" in after.disputes.replan_reason and "restart" in after.disputes.replan_reason


def test_a_fault_proven_during_an_epoch_is_not_lifted_by_that_epochs_checkpoint() -> None:
    """Seen in a loopback twin of tests/system/test_wan_bad_peer.py: the settling epoch was planned
    with the dispute's bound, step 6; the exclusion it then proved had bound 6 too, and the
    epoch's next checkpoint (written while the recovery waited) lifted it as if that bound had
    been planned; the job then resumed from step 24."""
    registry = FakeRegistry()
    registry.exclude = lambda agent_id, reason: None  # type: ignore[attr-defined]
    integrity = JobIntegrity(registry, SimpleNamespace(step=8))  # type: ignore[arg-type]
    integrity.separable = True
    integrity.settle([dispute("x", "b", 10)])
    integrity.plan_epoch([], 1, separable=True, rows=PARTED)
    assert integrity.planned_bound == 10 - PAIR_WINDOW + 1
    integrity.ledger.record("x", "grad_disagree", 6, "common to two", confirmed=True)
    integrity.checkpointed()  # the epoch's own checkpoint, after the fault
    assert integrity.pending_bound() == 6  # still owed to the next epoch
    integrity.plan_epoch([], 1, separable=True, rows=PARTED)
    integrity.checkpointed()
    assert integrity.pending_bound() == 0


def test_a_dispute_that_comes_while_an_epoch_is_placed_waits_for_the_next_plan() -> None:
    """The placement awaits the search: a dispute heard meanwhile was not asked of it, so the
    plan must not count it as parted (or as impossible to part) when it is not."""
    ledger, d = IntegrityLedger(), Disputes()
    d.feed([dispute("x", "b", 12)], ledger)
    assert d.apart(["x", "b", "c", "y"]).stage == {frozenset((0, 1))}  # the placement asks
    d.feed([dispute("c", "y", 13)], ledger)  # heard while it searched
    d.planned([["x", "c", "y"], ["b"]])  # parts x and b; c and y still together
    states = {(dd.a, dd.b): dd.done for dd in d.disputes}
    assert states == {("b", "x"): "apart", ("c", "y"): "pending"}
    assert "c and y" in d.replan_reason  # the job plans again for them
    d.apart(["x", "b", "c", "y"])
    d.planned([["x", "c", "y"], ["b"]])  # asked, and still together: no placement can
    assert {(dd.a, dd.b): dd.done for dd in d.disputes}[("c", "y")] == "cannot"
    assert d.replan_reason == ""


def test_a_reporters_claim_about_steps_before_the_epoch_rolls_back_no_further_than_it() -> None:
    """A liar that says the disagreement began at step 1 would roll back the whole job; the
    onset is taken no earlier than the first step the epoch trains."""
    ledger, d = IntegrityLedger(), Disputes()
    d.feed([dispute("liar", "b", 2)], ledger, first_step=41)  # the epoch resumed after 40
    assert d.rollback_before == 41


def test_a_replay_of_the_disputed_steps_by_a_new_pair_is_neither_a_dispute_nor_a_verdict() -> None:
    """Seen in CI (tests/system/test_wan_export.py): an honest pair of stage 0 disagreed at step
    14 (one batch's loss spike, a data-driven disagreement); the job rolled back and parted
    them, and the agent that kept its place in stage 0 disputed its new partner at step 14
    again, on the same data, and was excluded as the agent common to two disputes. A replay
    of steps a dispute judged, in its stage, proves nothing about who holds the stage now."""
    ledger, d = IntegrityLedger(), Disputes()
    assert d.feed([dispute("x", "b", 14), dispute("b", "x", 15, reporter="b")], ledger)
    d.planned(PARTED)
    d.rolled_back()
    for step in (14, 15, 15 + PAIR_WINDOW - 1):  # each window still holds a step up to 15
        assert not d.feed([dispute("x", "c", step, epoch=2)], ledger), step
    assert not ledger.exclusions and [(x.a, x.b) for x in d.disputes] == [("b", "x")]
    assert d.replan_reason == "" and d.rollback_before == 0
    # a lasting fault disputes its new partner on fresh steps, and that one confirms
    assert not d.feed([dispute("x", "c", 15 + PAIR_WINDOW, epoch=2)], ledger)
    assert set(ledger.exclusions) == {"x"}


def test_a_replayed_step_in_another_stage_or_of_weights_is_new_evidence() -> None:
    """The replay rule covers only what the same data reproduces: the same stage's gradients.
    x moved to stage 1 computes gradients no earlier epoch sent for those steps, and weights
    put back in step by one checkpoint do not drift apart again by themselves."""
    ledger, d = IntegrityLedger(), Disputes()
    d.feed([dispute("x", "b", 14)], ledger)
    d.planned(PARTED)
    assert not d.feed([dispute("x", "c", 12, epoch=2, stage=1)], ledger)
    assert set(ledger.exclusions) == {"x"}
    ledger, d = IntegrityLedger(), Disputes()
    d.feed([dispute("y", "b", 14)], ledger)
    d.planned(PARTED)
    assert d.feed([dispute("z", "c", 12, epoch=2, kind="weights_disagree")], ledger)


def test_a_records_stage_is_its_reporters() -> None:
    from coordinator.integrity.reports import to_record
    e = SimpleNamespace(suspect_rank=-1, reporter_rank=3, kind="grad_disagree", step=7,
                        detail="", score=4.0)
    rec = to_record("d", 2, e, ["a", "b", "c", "d"], stages=2)  # rank = replica * 2 + stage
    assert (rec.stage, rec.candidates) == (1, ("b", "d"))
    assert to_record("d", 2, e, ["a", "b"], stages=2).stage == -1  # rank 3 is nobody's


def test_how_far_a_dispute_shields_its_steps_is_bounded() -> None:
    """The pair's own later reports extend the steps a replay may not confirm on (a spell of
    honest outliers outlasts the first verdict); a liar in the pair claiming far later steps
    shields its stage for at most a window past the dispute."""
    ledger, d = IntegrityLedger(), Disputes()
    d.feed([dispute("x", "b", 14), dispute("x", "b", 16, reporter="b")], ledger)
    assert d.disputes[0].seen == 16
    d.feed([dispute("x", "b", 90)], ledger)
    assert d.disputes[0].seen == 14 + PAIR_WINDOW
    d.planned(PARTED)
    d.feed([dispute("x", "c", 14 + 2 * PAIR_WINDOW + 1, epoch=2)], ledger)
    assert set(ledger.exclusions) == {"x"}


def link(sender: str, receiver: str, step: int, epoch: int = 1) -> EvidenceRecord:
    return EvidenceRecord(agent_id="", kind="link_disagree", step=step,
                          detail=f"{sender} says it sent 1.0, {receiver} received 10.0",
                          reporter="coordinator", suspect_rank=-1, score=10.0, epoch=epoch,
                          candidates=(sender, receiver), stage=0)


def test_a_links_two_ends_are_parted_as_pipeline_neighbours_and_the_liar_named() -> None:
    """The two ends of a link that disagree are neighbours in one pipeline, never replicas:
    they are kept from being neighbours again, and the end that disagrees with its new
    neighbour too is the confirmed fault."""
    ledger, d = IntegrityLedger(), Disputes()
    assert d.feed([link("liar", "b", 10)], ledger)
    assert "pipeline neighbours" in d.replan_reason
    assert d.apart(["b", "liar", "x"]) == Apart(set(), {frozenset((0, 1))})
    assert "received 10.0" in ledger.evidence("b")[0].detail
    # a plan that keeps them in one pipeline's neighbouring stages has not parted them ...
    d.planned([["liar", "x"], ["b", "c"]])
    assert d.disputes[0].done == "cannot"
    # ... one that puts them in different pipelines has
    d2 = Disputes()
    d2.feed([link("liar", "b", 10)], ledger)
    d2.apart(["b", "liar", "x", "c"])
    d2.planned([["liar", "x"], ["c", "b"]])
    assert d2.disputes[0].done == "apart"
    assert not d2.feed([link("liar", "c", 20, epoch=2)], ledger)
    assert set(ledger.exclusions) == {"liar"}


def test_separate_parts_a_links_ends_from_neighbouring_stages() -> None:
    grid = [[0, 1], [2, 3], [4, 5]]  # pipelines 0-2-4 and 1-3-5
    assert neighbour_pairs(grid) == {frozenset(p) for p in ((0, 2), (2, 4), (1, 3), (3, 5))}
    parted = separate(grid, Apart(set(), {frozenset((2, 4))}))
    assert parted is not None and frozenset((2, 4)) not in neighbour_pairs(parted)
    assert sorted(sum(parted, [])) == list(range(6))
    # replicas of one stage are no link: already apart
    assert separate(grid, Apart(set(), {frozenset((0, 1))})) == grid


def test_a_link_dispute_and_a_replica_dispute_do_not_confirm_each_other() -> None:
    """An honest receiver fed 10x disputes its sender's link, and at R = 2 its gradient copy
    disputes its replica's: two disputes with different partners, of two kinds, name
    nobody."""
    ledger, d = IntegrityLedger(), Disputes()
    d.feed([link("a", "honest", 10)], ledger)
    d.feed([dispute("honest", "r", 12, stage=1)], ledger)
    assert not ledger.exclusions


def test_a_receiver_and_its_owner_disputing_an_average_are_a_pair_of_the_reporters() -> None:
    """`avg_disagree` (agent/worker/replicacheck.py): a receiver whose weights the digest found
    odd and the owner of the average it got another of, at any R. Its record names the pair
    of its reporter and the replica of the reporter's stage it names, nobody alone; a record
    naming a rank of another stage, or reported under another agent's rank, is no pair."""
    from coordinator.integrity.reports import to_record
    members = ["a", "b", "c", "d", "e", "f"]  # 2 stages x 3 replicas: stage 1 is b, d, f
    e = SimpleNamespace(suspect_rank=5, reporter_rank=1, kind="avg_disagree", step=5,
                        detail="", score=1.0)
    rec = to_record("b", 2, e, members, stages=2)
    assert (rec.agent_id, rec.candidates, rec.stage) == ("", ("b", "f"), 1)
    assert to_record("b", 2, SimpleNamespace(**{**vars(e), "suspect_rank": 4}), members,
                     stages=2).candidates == ()  # rank 4 holds stage 0
    assert to_record("d", 2, e, members, stages=2).candidates == ()  # rank 1 is b's
    assert to_record("b", 2, SimpleNamespace(**{**vars(e), "suspect_rank": 1}), members,
                     stages=2).candidates == ()  # itself


def test_an_owner_equivocating_to_a_receiver_again_after_parting_is_excluded() -> None:
    """The owner x sent receiver b another average at step 5: the pair is parted and rolled
    back before step 5 (the exchange's step: the receiver's weights were the others' until
    then), and x's equivocation to its new stage's receiver c names x. Where nothing can
    part them, their weights are put back in step from one checkpoint."""
    ledger, d = IntegrityLedger(), Disputes()
    assert d.feed([dispute("x", "b", 5, kind="avg_disagree", reporter="b")], ledger)
    assert d.rollback_before == 5 and not ledger.exclusions
    d.planned(PARTED)
    d.feed([dispute("x", "c", 9, kind="avg_disagree", epoch=2)], ledger)
    assert set(ledger.exclusions) == {"x"} and ledger.excluded("x").step == 5
    ledger, d = IntegrityLedger(), Disputes()
    assert d.feed([dispute("x", "b", 5, kind="avg_disagree")], ledger, separable=False)
    assert "resume" in d.replan_reason and d.rollback_before == 5
