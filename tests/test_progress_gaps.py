"""The record a recovered job leaves in its progress files (tests/progress.py), and the one
gap in it that is no lost report: a rank cut off in a step its peers finished.

The case is test_wan_nat8's failure on a fresh clone of main: the relay died while rank 7
(NAT'd, every pair relayed) was in step 6's norm exchange. Its peers had its part and finished
step 6 (rank 3 checkpointed it); rank 7 never got theirs and failed in step 6. Epoch 2
resumed after step 6, so no run of rank 7 reports step 6's loss, and the test's
(step, rank) comparison with the all-reachable run failed on "(6, 7)". Synthetic files with
that run's shape, in milliseconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dtfm.core.events import DoneEvent, ErrorEvent, ProgressEvent, StepEvent, encode_event
from dtfm.core.events import parse_event as parse
from tests.progress import assert_same_losses, cut_off, step_losses

JOB, RANKS, STEPS = "job-7cdbecac", 8, 12


def _loss(step: int) -> float:
    return 5.5 - step / 10


def _write(tmp: Path, epoch: int, rank: int, events: list[ProgressEvent]) -> None:
    work = tmp / f"agent-{rank}" / "work"
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"{JOB}-e{epoch}-r{rank}.progress.jsonl"
    path.write_text("".join(encode_event(ev) + "\n" for ev in events))


def _steps(rank: int, steps: range, resumed: int) -> list[ProgressEvent]:
    return [StepEvent(step=s, loss=_loss(s), rank=rank, resumed_step=resumed) for s in steps]


def _recovered(tmp: Path, failed_in: int = 6, resumed: int = 6,
               error_step: bool = True) -> None:
    """Epoch 1 to step `failed_in`, rank 7 cut off in it (its error event at that step, or
    with `error_step=False` an error event of a worker that names no step), epoch 2
    resumed after `resumed` to the end."""
    cut = "rank 7: exchange the gradient norm and loss with [4, 5, 6, 7] failed"
    for rank in range(RANKS):
        last = failed_in - 1 if rank == 7 else failed_in
        _write(tmp, 1, rank, [*_steps(rank, range(1, last + 1), 0), ErrorEvent(
            message=cut if rank == 7 else "peer closed the connection", rank=rank,
            kind="peer", phase="train", step=(last + 1 if error_step else 0))])
        _write(tmp, 2, rank, [*_steps(rank, range(resumed + 1, STEPS + 1), resumed),
                              DoneEvent(rank=rank, step=STEPS, resumed_step=resumed)])


def _flat(tmp: Path) -> dict[tuple[int, int], float]:
    return {(s, r): loss for r, steps in step_losses(tmp, JOB).items()
            for s, loss in steps.items()}


REF = {(s, r): _loss(s) for s in range(1, STEPS + 1) for r in range(RANKS)}


def test_a_rank_cut_off_in_the_step_its_peers_checkpointed_is_the_only_gap(
        tmp_path: Path) -> None:
    _recovered(tmp_path)
    got = _flat(tmp_path)
    assert set(REF) - set(got) == {(6, 7)}  # what test_wan_nat8 saw
    cut = cut_off(tmp_path, JOB)
    assert list(cut) == [(6, 7)] and "epoch 2 resumed after step 6" in cut[(6, 7)], cut
    assert_same_losses(got, REF, cut)


def test_a_missing_loss_nothing_explains_still_fails(tmp_path: Path) -> None:
    # no step in the error event (a worker of before): the gap is not explained
    _recovered(tmp_path, error_step=False)
    with pytest.raises(AssertionError, match=r"missing.*\(6, 7\)"):
        assert_same_losses(_flat(tmp_path), REF, cut_off(tmp_path, JOB))


def test_a_step_the_next_epoch_trained_again_is_no_excuse(tmp_path: Path) -> None:
    # rank 7 failed in step 6 but epoch 2 resumed after step 3: step 6 ran again, and a
    # missing loss of it would be a lost report
    _recovered(tmp_path, resumed=3)
    (tmp_path / "agent-7" / "work" / f"{JOB}-e2-r7.progress.jsonl").write_text("".join(
        encode_event(ev) + "\n" for ev in _steps(7, range(4, STEPS + 1), 3) if ev.step != 6))
    assert cut_off(tmp_path, JOB) == {}
    with pytest.raises(AssertionError, match=r"missing.*\(6, 7\)"):
        assert_same_losses(_flat(tmp_path), REF, {})


def test_a_different_loss_fails(tmp_path: Path) -> None:
    _recovered(tmp_path)
    got = _flat(tmp_path)
    got[(7, 0)] += 1e-6
    with pytest.raises(AssertionError, match="differ"):
        assert_same_losses(got, REF, cut_off(tmp_path, JOB))


def test_the_error_events_step_round_trips_and_defaults_to_0() -> None:
    ev = ErrorEvent(message="x", rank=7, kind="peer", phase="train", step=6)
    assert parse(encode_event(ev)) == ev
    old = parse('{"event": "error", "message": "x", "rank": 7, "kind": "peer"}')
    assert isinstance(old, ErrorEvent) and old.step == 0


def test_a_line_being_written_is_skipped_not_raised(tmp_path: Path) -> None:
    # test_wan_nat8 polls these files while 8 workers append to them: a read may end inside
    # a line (a write crossing a page), and a poll that raised would fail the test
    _recovered(tmp_path)
    path = tmp_path / "agent-0" / "work" / f"{JOB}-e2-r0.progress.jsonl"
    path.write_text(path.read_text() + encode_event(StepEvent(step=13, loss=1.0))[:40])
    assert max(step_losses(tmp_path, JOB)[0]) == STEPS
