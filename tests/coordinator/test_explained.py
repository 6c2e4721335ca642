"""A gradient fault against an agent whose pipeline neighbour sent it wrong numbers waits for
the links' verdict and is dropped as explained; one no wrong link explains is confirmed
(coordinator/integrity/explained.py), through the job's integrity (exclusion.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from coordinator.integrity.exclusion import JobIntegrity
from coordinator.integrity.explained import RELEASE_STEPS, HeldConfirmations
from coordinator.integrity.ledger import IntegrityLedger
from coordinator.integrity.linkwitness import LinkWitness
from coordinator.integrity.reports import EvidenceRecord
from protos.dtfm.v1 import common_pb2, coordinator_pb2
from tests.coordinator.test_job_states import FakeRegistry
from tests.coordinator.test_link_witness import honest

AGENTS = [f"a{r}" for r in range(6)]  # 2 stages x 3 replicas, by rank


def grad_norm(agent: str, step: int) -> EvidenceRecord:
    return EvidenceRecord(agent, "grad_norm", step, "its norm is 9x the median copy's", "a4",
                          AGENTS.index(agent), 9.0, 1, (agent,), 0)


def window_report(rank: int, step: int, figures: list[float]) -> coordinator_pb2.ProgressReport:
    """Rank `rank`'s heartbeat carrying its link window of `step` (epoch 1)."""
    return coordinator_pb2.ProgressReport(
        agent_id=AGENTS[rank], epoch=1, step=step, link_windows=[coordinator_pb2.LinkWindow(
            step=step, **dict(zip(("act_out", "act_in", "grad_out", "grad_in"), figures,
                                  strict=True)))])


def held() -> tuple[HeldConfirmations, LinkWitness, IntegrityLedger]:
    links = LinkWitness()
    links.plan(1, 2, 3)
    ranks = {a: r for r, a in enumerate(AGENTS)}
    return HeldConfirmations(links, ranks.get), links, IntegrityLedger()


def windows(links: LinkWitness, step: int, figures: dict[int, list[float]]) -> list:
    for r, f in figures.items():
        links.add(1, r, step, f)
    return links.judge()


def test_a_fault_a_wrong_link_upstream_explains_is_dropped() -> None:
    h, links, ledger = held()
    assert h.defer(grad_norm("a2", 8), 8, ["a4", "a0"])  # rank 2: stage 0 of replica 1
    h.release(ledger, 9)
    assert not ledger.evidence("a2")  # still waiting: the window of step 8 is not judged
    f = honest(2, 3)
    f[3][2] = f[2][3] = 0.1  # rank 3 sends rank 2 gradients 10x
    assert [x.suspects for x in windows(links, 10, f)] == [(3,)]
    h.release(ledger, 10)
    (piece,) = ledger.evidence("a2")
    assert not piece.confirmed and "not confirmed: rank 3 sent wrong pipeline messages" in \
        piece.detail
    assert not ledger.exclusions


def test_an_owners_share_a_wrong_link_upstream_explains_is_dropped_too() -> None:
    """A neighbour's x10 gradients inflate an honest owner's own copy, and so its share of its
    averages (agent/worker/avgaudit.py), as they inflate its copies' norms."""
    h, links, ledger = held()
    share = EvidenceRecord("a2", "avg_share", 8, "its own copy's share was 2.9", "a4", 2, 2.9,
                           1, ("a2",), 0)
    assert h.defer(share, 8, ["a4", "a0"])
    f = honest(2, 3)
    f[3][2] = f[2][3] = 0.1  # rank 3 sends rank 2 gradients 10x
    windows(links, 10, f)
    h.release(ledger, 10)
    (piece,) = ledger.evidence("a2")
    assert not piece.confirmed and not ledger.exclusions


def test_a_fault_no_link_explains_is_confirmed_once_its_steps_are_judged() -> None:
    h, links, ledger = held()
    h.defer(grad_norm("a2", 8), 7, ["a4", "a0"])
    windows(links, 10, honest(2, 3))
    h.release(ledger, 10)
    assert ledger.excluded("a2") is not None and ledger.excluded("a2").step == 7


def test_the_checkpoint_before_a_waiting_fault_is_kept() -> None:
    integrity = JobIntegrity(FakeRegistry(), SimpleNamespace(step=0))  # type: ignore[arg-type]
    integrity.checkpoint_every = 4
    integrity.plan_epoch([common_pb2.Assignment(epoch=1, stages=2, replicas=3, rank=r)
                          for r in range(6)], 1, members=AGENTS)
    members = [(60, 60)] * 6  # every member at step 60, its evidence delivered through it
    assert integrity.keep_floor(0, members) == 48  # known-good: 10 steps behind, 4 apart
    integrity.defer(grad_norm("a2", 30), 27, ["a4", "a0"])
    assert integrity.keep_floor(0, members) == 24  # the newest checkpoint before step 27


def test_unjudged_links_hold_a_fault_no_longer_than_the_release_steps() -> None:
    h, _, ledger = held()
    h.defer(grad_norm("a2", 8), 8, ["a4", "a0"])
    h.release(ledger, 8 + RELEASE_STEPS - 1)
    assert not ledger.exclusions
    h.release(ledger, 8 + RELEASE_STEPS)
    assert ledger.excluded("a2") is not None


def test_only_what_a_wrong_input_can_cause_waits_and_only_in_a_pipeline() -> None:
    h, links, _ = held()
    stale = EvidenceRecord("a2", "grad_stale", 8, "", "a4", 2, 1.0, 1, ("a2",), 0)
    assert not h.defer(stale, 8, [])
    links.plan(1, 1, 6)  # one stage: no links
    assert not h.defer(grad_norm("a2", 8), 8, [])


def test_the_jobs_integrity_takes_link_windows_and_excludes_the_root_sender() -> None:
    registry = FakeRegistry()
    registry.exclude = lambda agent_id, reason: None  # type: ignore[attr-defined]
    integrity = JobIntegrity(registry, SimpleNamespace(step=0))  # type: ignore[arg-type]
    assignments = [common_pb2.Assignment(epoch=1, stages=2, replicas=3, rank=r)
                   for r in range(6)]
    integrity.plan_epoch(assignments, 1, members=AGENTS)
    integrity.defer(grad_norm("a3", 8), 8, ["a5", "a1"])
    f = honest(2, 3)
    f[2][0] = f[3][1] = 10.0  # rank 2 sends rank 3 activations 10x
    for rank, figures in f.items():
        assert not integrity.witness(AGENTS[rank], window_report(rank, 10, figures))
    assert set(integrity.ledger.exclusions) == {"a2"}
    assert integrity.ledger.exclusions["a2"].step == 6  # the window's first step
    assert not integrity.ledger.evidence("a3")[0].confirmed


def test_a_middle_stages_wrong_gain_explains_the_stage_before_it_and_is_confirmed() -> None:
    """Three stages: rank 1 (stage 1 of replica 0) sends back 6x the gradient it received.
    Its gain names it, confirmed; rank 0, whose gradient copies that spoiled, is explained."""
    agents = [f"a{r}" for r in range(9)]  # 3 stages x 3 replicas, by rank
    links = LinkWitness()
    links.plan(1, 3, 3)
    h, ledger = HeldConfirmations(links, {a: r for r, a in enumerate(agents)}.get), \
        IntegrityLedger()
    rec = EvidenceRecord("a0", "grad_norm", 8, "its norm is 6x the median copy's", "a3", 0,
                         6.0, 1, ("a0",), 0)
    assert h.defer(rec, 8, ["a3", "a6"])
    f = honest(3, 3)
    f[1][2] = f[0][3] = 0.06  # rank 1 -> rank 0, while rank 2 sent rank 1 the usual 0.01
    found = windows(links, 10, f)
    assert [(x.kind, x.suspects, x.confirmed) for x in found] == [
        ("actgrad_scaled", (1,), True)]
    h.release(ledger, 10)
    (piece,) = ledger.evidence("a0")
    assert not piece.confirmed and "rank 1 sent wrong pipeline messages" in piece.detail


def test_a_link_whose_ends_disagree_opens_a_dispute_and_explains_both_ends() -> None:
    """Rank 2 (stage 0 of replica 1) reports honest figures and sends 10x (`act_lie`): the
    link's ends disagree. Nobody is excluded for it or for what followed (rank 3's spoiled
    gradient copies are held and dropped as explained, and so are rank 2's own: either end may
    have spoiled them); the job re-plans to part the two, a dispute of pipeline neighbours."""
    registry = FakeRegistry()
    registry.exclude = lambda agent_id, reason: None  # type: ignore[attr-defined]
    integrity = JobIntegrity(registry, SimpleNamespace(step=0))  # type: ignore[arg-type]
    assignments = [common_pb2.Assignment(epoch=1, stages=2, replicas=3, rank=r)
                   for r in range(6)]
    integrity.plan_epoch(assignments, 1, separable=True, members=AGENTS)
    for agent in ("a3", "a2"):
        integrity.defer(grad_norm(agent, 8), 8, ["a5", "a1"])
    f = honest(2, 3)
    f[3][1] = 10.0  # rank 3 received 10x what rank 2 says it sent
    f[3][2] = f[2][3] = 0.1  # and sent back what followed from it, both ends agreeing
    replans = []
    for rank, figures in f.items():
        replans.append(integrity.witness(AGENTS[rank], window_report(rank, 10, figures)))
    assert replans[-1] and not any(replans[:-1])  # the last window completes it
    assert not integrity.ledger.exclusions
    assert "pipeline neighbours" in integrity.disputes.replan_reason
    assert integrity.disputes.apart(AGENTS).neighbours == {frozenset((2, 3))}
    for agent in ("a2", "a3"):
        kinds = {(e.kind, e.confirmed) for e in integrity.ledger.evidence(agent)}
        assert ("link_disagree", False) in kinds and ("grad_norm", True) not in kinds, kinds
    assert "disagreed about what crossed it" in str(
        [e.detail for e in integrity.ledger.evidence("a3")])


def norm_differs(agent: str, step: int, reporter: str = "a0", stage: int = 0
                 ) -> EvidenceRecord:
    """`agent`'s pipeline partner's replicas (of `stage`) name it for the norm it sent
    (normtable.py)."""
    return EvidenceRecord(agent, "norm_differs", step, "rank 1 sent its pipeline another "
                          "squared norm", reporter, 1, 1.0, 1, (agent,), stage)


def test_a_norm_that_differs_waits_for_every_members_records_through_its_digest() -> None:
    """Named at step 12 by the digest of step 20, delivered with a report of step 20: it waits
    while any member's records are short of step 20 (its own stage's dispute may be on its
    way), then, with nothing to explain it, confirms at step 12."""
    said: list[str] = []
    ranks = {a: r for r, a in enumerate(AGENTS)}
    h, ledger = HeldConfirmations(LinkWitness(), ranks.get, lambda rec: said[0] if said
                                  else ""), IntegrityLedger()
    assert h.defer(norm_differs("a1", 12), 12, ["a0", "a2"])
    h.release(ledger, 20, vetted=18)
    assert not ledger.evidence("a1") and h.earliest() == 12
    h.release(ledger, 21, vetted=20)
    (piece,) = ledger.evidence("a1")
    assert piece.confirmed and "its own stage disputes no average it got" in piece.detail
    assert ledger.excluded("a1") is not None
    said.append("its own stage disputes the average it got from a5 at step 12")
    ledger = IntegrityLedger()
    assert h.defer(norm_differs("a3", 12), 12, ["a0", "a2"])
    h.release(ledger, 20, vetted=20)
    (piece,) = ledger.evidence("a3")
    assert not piece.confirmed and "not confirmed: its own stage disputes" in piece.detail
    # an agent of no rank in the epoch: evidence, never an unheld confirmation
    assert h.defer(norm_differs("zz", 13), 13, ["a0", "a2"]) and h.earliest() == 0


def jobs_integrity() -> JobIntegrity:
    registry = FakeRegistry()
    registry.exclude = lambda agent_id, reason: None  # type: ignore[attr-defined]
    integrity = JobIntegrity(registry, SimpleNamespace(step=0))  # type: ignore[arg-type]
    integrity.plan_epoch([common_pb2.Assignment(epoch=1, stages=2, replicas=3, rank=r)
                          for r in range(6)], 1, separable=True,
                         rows=[AGENTS[0::2], AGENTS[1::2]], members=AGENTS)
    return integrity


@pytest.mark.parametrize("disputed", [True, False])
def test_the_jobs_integrity_explains_a_norm_by_its_stages_dispute(disputed: bool) -> None:
    """`JobIntegrity`'s own-stage explanation, through the corroboration path: the receiver a1
    and its owner a5 dispute an average at step 12, so the norm a1 sent at step 12 is no lie
    of a1's; without the dispute, reporters of two other stages (two witnesses: a pipeline
    of three stages or more) confirm it once every member's records have arrived (vetted)."""
    from coordinator.integrity.corroborate import Corroboration
    from tests.coordinator.test_integrity_disputes import dispute
    integrity = jobs_integrity()
    if disputed:
        assert integrity.settle([dispute("a1", "a5", 12, kind="avg_disagree", reporter="a1")])
    Corroboration().feed([norm_differs("a1", 12, "a0", 0), norm_differs("a1", 12, "a2", 2)],
                         integrity.ledger, defer=integrity.defer)
    assert not integrity.ledger.exclusions  # waiting (or evidence)
    integrity.held.release(integrity.ledger, 21, 21)
    if disputed:
        assert not integrity.ledger.exclusions
        assert any("not confirmed: its own stage disputes the average it got from a5" in
                   p.detail for p in integrity.ledger.evidence("a1"))
    else:
        assert set(integrity.ledger.exclusions) == {"a1"}
        assert integrity.ledger.exclusions["a1"].step == 12


def test_a_norm_that_differs_needs_witnesses_of_two_stages() -> None:
    """What the replicas of one stage report about a rank of their pipeline comes from one
    table, the odd replica's own row, which a liar writes as it likes: records of one stage
    (however many reporters) stay evidence; a second stage's records (another witness)
    confirm."""
    from coordinator.integrity.corroborate import Corroboration
    c = Corroboration()
    one_stage = [norm_differs("a1", 12, r, 0) for r in ("a0", "a2", "a4")]
    assert not any(c.weigh(r)[0] for r in one_stage)
    assert c.weigh(norm_differs("a1", 12, "a3", 2)) == (True, 12)
