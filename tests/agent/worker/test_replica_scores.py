"""The replica checks' scoring, thresholds and plumbing, in milliseconds (issue 43, items 1,
4, 8 and 9): every attack on a gradient copy is found and names its replica (R >= 3) or is
reported undecided (R = 2); honest copies are not; the weights digest names the odd one out;
the bad-peer rehearsal modes parse; `--verify full` is refused with allreduce; the evidence
reaches the coordinator's records with agents for ranks."""

from __future__ import annotations

import pytest
import torch

from agent.daemon.session import evidence_messages
from agent.daemon.supervisor import WorkerProgress
from agent.worker import digest, gradscore
from agent.worker.badpeer import Contributions, attack, drift_
from agent.worker.fault import Fault
from coordinator.daemon.validate import validate_progress
from coordinator.integrity.reports import EvidenceRecord, IntegrityReports
from dtfm.core.events import IntegrityEvent, StepEvent, encode_event, parse_event
from dtfm.core.limits import MAX_EVIDENCE, MAX_PENDING_EVIDENCE
from dtfm.core.spec import TrainConfig
from dtfm.core.verify import Verify, resolve
from protos.dtfm.v1 import coordinator_pb2

N, BUCKETS = 4096, 3


def honest(replicas: int, seed: int) -> list[list[torch.Tensor]]:
    """Per replica, BUCKETS sparse, heavy-tailed gradient-like copies sharing a common part
    (as gradients of different batches of one model do)."""
    g = torch.Generator().manual_seed(seed)

    def tail() -> torch.Tensor:
        return torch.randn(N, generator=g) * (torch.rand(N, generator=g) < 0.05)

    common = [tail() for _ in range(BUCKETS)]
    return [[c + tail() for c in common] for _ in range(replicas)]


def score(copies: list[list[torch.Tensor]], scorer: gradscore.ShardScorer | None = None
          ) -> list[gradscore.Finding]:
    scorer = scorer or gradscore.ShardScorer(len(copies))
    for b in range(BUCKETS):
        scorer.add(b, [c[b] for c in copies])
    return gradscore.judge(scorer.scores())


def attacked(mode: str, replicas: int, seed: int) -> list[list[torch.Tensor]]:
    copies = honest(replicas, seed)
    gen = torch.Generator().manual_seed(seed)
    copies[1] = [attack(mode, t, gen=gen) for t in copies[1]]
    return copies


@pytest.mark.parametrize("replicas", [3, 4])
def test_honest_copies_are_not_named(replicas: int) -> None:
    for seed in range(20):
        assert score(honest(replicas, seed)) == [], seed


@pytest.mark.parametrize(("mode", "kinds"), [
    ("scale", {"grad_norm"}), ("flip", {"grad_cosine", "grad_norm"}),
    ("noise", {"grad_noise"}), ("zero", {"grad_zero"})])
def test_each_attack_names_its_replica_at_r3(mode: str, kinds: set[str]) -> None:
    for seed in range(5):
        found = score(attacked(mode, 3, seed))
        assert [f.replica for f in found] == [1] and found[0].kind in kinds, (seed, found)


def test_a_replayed_copy_is_stale_at_any_r() -> None:
    scorer = gradscore.ShardScorer(2)
    first = honest(2, 0)
    assert score(first, scorer) == []
    again = honest(2, 1)
    again[0] = first[0]  # replica 0 sends last step's copy
    found = score(again, scorer)
    assert [(f.replica, f.kind) for f in found] == [(0, "grad_stale")], found


def test_centered_clip_bounds_one_bad_copy() -> None:
    copies = [c[0] for c in honest(4, 0)]
    exact = torch.stack(copies).mean(0)
    copies[2] = copies[2] * 1000
    robust = gradscore.centered_clip(copies)
    assert (robust - exact).norm() < 2 * exact.norm()
    assert (torch.stack(copies).mean(0) - exact).norm() > 100 * exact.norm()


def test_the_weights_digest_names_the_odd_one_out() -> None:
    w = [torch.randn(10, 10), torch.randn(5)]
    same = digest.weights_digest(w)
    assert digest.weights_digest([t.clone() for t in w]) == same < 2 ** digest.DIGEST_BITS
    flipped = [t.clone() for t in w]
    flipped[1].view(torch.int32)[3] ^= 1  # one bit of one weight
    assert digest.weights_digest(flipped) != same
    drifted = [t.clone() for t in w]
    drift_(drifted)
    assert digest.weights_digest(drifted) != same
    assert digest.odd_ones([7, 7, 7]) == ([], True)
    assert digest.odd_ones([7, 9, 7, 7]) == ([1], True)
    assert digest.odd_ones([7, 9]) == ([0, 1], False)  # R = 2: undecided
    assert digest.odd_ones([7, 9, 7, 9]) == ([0, 1, 2, 3], False)


def test_the_rehearsal_modes_parse_and_attack_from_their_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTFM_FAULT", "2:3:stale")
    fault = Fault.from_env()
    assert fault is not None and fault.contributions(1) is None
    hand = fault.contributions(2)
    assert isinstance(hand, Contributions)
    t = torch.ones(4)
    for step in (1, 2):
        hand.step = step
        assert hand("b0", t * step).tolist() == [step] * 4  # honest, and remembered
    hand.step = 3
    assert hand("b0", t * 3).tolist() == [2.0] * 4  # step 2's copy again
    monkeypatch.setenv("DTFM_FAULT", "1:5:drift")
    fault = Fault.from_env()
    assert fault is not None and fault.drifts(1, 5) and not fault.drifts(1, 4)
    fault.maybe_fire(1, 5)  # returns: the corruption is in the weights


def test_verify_levels_and_the_allreduce_refusal() -> None:
    assert resolve("auto", "sharded") == Verify.FULL
    assert resolve("", "allreduce") == Verify.DIGEST
    TrainConfig(dp_mode="allreduce").validate(2)  # auto: digest only
    with pytest.raises(ValueError, match="--verify full .* use --dp-mode sharded"):
        TrainConfig(dp_mode="allreduce", verify="full").validate(2)
    with pytest.raises(ValueError, match="--verify must be one of"):
        TrainConfig(verify="paranoid").validate(2)


def test_a_heartbeat_says_through_which_step_its_evidence_is_complete() -> None:
    """`integrity_through`: the coordinator vets a known-good checkpoint from it
    (coordinator/integrity/rollback.py), so it must never claim a step whose records still
    wait, nor one past records that were dropped."""
    progress = WorkerProgress()
    progress.apply(StepEvent(step=3))
    assert progress.evidence_through(MAX_EVIDENCE) == 3  # nothing waits
    for step in (4, 4, 5):
        progress.apply(IntegrityEvent(step=step, kind="grad_norm", suspect_rank=5, rank=1))
    progress.apply(StepEvent(step=5))
    assert progress.evidence_through(3) == 5  # the heartbeat carries all three
    assert progress.evidence_through(1) == 3  # the second record of step 4 still waits
    progress.delivered(3)
    for i in range(MAX_PENDING_EVIDENCE + 1):  # the last one, of step 9, is dropped
        progress.apply(IntegrityEvent(step=6 if i < MAX_PENDING_EVIDENCE else 9,
                                      kind="grad_cosine", suspect_rank=5, rank=1))
    progress.apply(StepEvent(step=12))
    progress.delivered(MAX_PENDING_EVIDENCE)
    assert progress.integrity == [] and progress.evidence_through(MAX_EVIDENCE) == 8


def test_a_digest_in_flight_keeps_the_steps_it_covers_open() -> None:
    """The weights digest of step 10, covering steps 1-10, is judged at step 11's end
    (replicacheck.py): the step event of step 10 says its records are out through step 0
    only, so no heartbeat in between vets a checkpoint of those steps."""
    progress = WorkerProgress()
    progress.apply(StepEvent(step=10, judged_through=0))
    assert progress.evidence_through(MAX_EVIDENCE) == 0
    progress.apply(IntegrityEvent(step=10, kind="weights", suspect_rank=2, rank=0))
    progress.apply(StepEvent(step=11))
    assert progress.evidence_through(0) == 9 and progress.evidence_through(1) == 11


def test_evidence_flows_from_the_worker_event_to_coordinator_records() -> None:
    event = IntegrityEvent(step=7, kind="grad_norm", suspect_rank=5, score=9.5,
                           detail="rank 5's copy ...", rank=1)
    assert parse_event(encode_event(event)) == event
    progress = WorkerProgress()
    for i in range(MAX_EVIDENCE + 3):
        progress.apply(IntegrityEvent(step=i, kind="weights", suspect_rank=5, rank=1))
    # every record waits for a heartbeat to deliver it, oldest first: a fast job's onset is
    # never pushed out by newer records before the coordinator hears it
    assert [e.step for e in progress.integrity] == list(range(MAX_EVIDENCE + 3))
    progress.delivered(MAX_EVIDENCE)
    assert [e.step for e in progress.integrity] == [16, 17, 18]
    for i in range(MAX_PENDING_EVIDENCE + 5):
        progress.apply(IntegrityEvent(step=100 + i, kind="weights", suspect_rank=5, rank=1))
    assert len(progress.integrity) == MAX_PENDING_EVIDENCE and progress.integrity_dropped == 8
    assert progress.integrity[0].step == 16  # the oldest kept
    sent = coordinator_pb2.ProgressReport(
        agent_id="a1", agent_secret="ab" * 32, integrity=evidence_messages(
            [*progress.integrity[:MAX_EVIDENCE - 1],
             IntegrityEvent(kind="grad_norm", score=float("inf"), detail="x" * 10_000,
                            suspect_rank=2)]))
    assert validate_progress(sent) is None  # what an agent sends is always accepted
    assert sent.integrity[-1].score == 1e300 and sent.integrity[-1].suspect_rank == 2
    report = coordinator_pb2.ProgressReport(
        agent_id="a1", agent_secret="ab" * 32, epoch=2, step=9, integrity=[
            coordinator_pb2.IntegrityEvidence(step=7, kind="grad_norm", suspect_rank=5,
                                              score=9.5, detail="d", reporter_rank=1),
            coordinator_pb2.IntegrityEvidence(step=9, kind="weights_disagree",
                                              suspect_rank=-1, score=2, reporter_rank=1)])
    assert validate_progress(report) is None
    reports = IntegrityReports()
    members = ["a0", "a1", "a2", "a3", "a4", "a5"]  # 2 stages x 3 replicas, by rank
    new = reports.record("a1", report, members, stages=2)
    assert new == [  # the reporter, rank 3 of 2 stages, is in stage 1
        EvidenceRecord("a5", "grad_norm", 7, "d", "a1", 5, 9.5, 2, ("a5",), 1),
        EvidenceRecord("", "weights_disagree", 9, "", "a1", -1, 2.0, 2, ("a1", "a3", "a5"), 1)]
    assert reports.record("a1", report, members, stages=2) == []  # repeated heartbeat
    # a record of a step the worker has not reached (a lie about its step, or one that would
    # wipe the coordinator's memory of older disputes) is dropped; the step in progress is not
    ahead = coordinator_pb2.ProgressReport(
        agent_id="a1", agent_secret="ab" * 32, epoch=2, step=9, integrity=[
            coordinator_pb2.IntegrityEvidence(step=10, kind="grad_zero", suspect_rank=5,
                                              reporter_rank=1),
            coordinator_pb2.IntegrityEvidence(step=10**9, kind="grad_zero", suspect_rank=3,
                                              reporter_rank=1)])
    assert [r.step for r in reports.record("a1", ahead, members, stages=2)] == [10]
    too_many = coordinator_pb2.ProgressReport(agent_id="a1", agent_secret="ab" * 32, integrity=[
        coordinator_pb2.IntegrityEvidence(kind="x")] * (MAX_EVIDENCE + 1))
    assert "integrity holds" in (validate_progress(too_many) or "")
