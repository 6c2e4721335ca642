"""A checkpoint the agent asks for while the worker trains (`dtfm.core.requests`): written
after the step asked, reported in the step events that follow (the coordinator moves a
re-planned job there only once every member reports it), and whole: a run resumed from it
trains on to the uninterrupted run's losses.

Real worker processes over gloo, assigned as the coordinator assigns them; regular
checkpoints are off in effect (`--checkpoint-every` beyond the last step but the final one),
so the only one to resume from is the one asked for.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dtfm.core.requests import CheckpointRequests, ask_checkpoint
from tests.agent.worker.testlib import assert_resumed, run_local, run_workers

FLAGS = ("--model", "gpt-tiny", "--batch", "4", "--micro-batches", "2", "--steps", "8",
         "--checkpoint-every", "100", "--seed", "5", "--eval-batches", "1", "--timeout", "30")


@pytest.mark.timeout(600)
def test_a_requested_checkpoint_is_written_reported_and_resumed_from(tmp_path: Path) -> None:
    full = run_local(*FLAGS, "--stages", "2", "--replicas", "1",
                     "--checkpoint-dir", str(tmp_path / "full"))
    assert full.rc == 0, full.stderr

    ckpt = tmp_path / "ckpt"
    # both ranks asked for a checkpoint after step 3; the last stage dies before step 6
    asked = run_workers(FLAGS, 2, ckpt, tmp_path / "asked", fault="1:6", checkpoint_at=3)
    assert [s["step"] for s in asked.steps] == [1, 2, 3, 4, 5], asked.stderr
    assert [s["checkpoint_step"] for s in asked.steps] == [0, 0, 0, 3, 3]
    # rank 0 was in step 6 (its activations sent, its gradients awaited) when rank 1 died;
    # its error event says so: a step its peers may finish and checkpoint without it
    assert asked.failed_at == {0: 6}, asked.stderr

    resumed = run_workers(FLAGS, 2, ckpt, tmp_path / "resumed")
    assert_resumed(resumed, full, after=3, rel=1e-5)
    assert "resumed at step 3" in (tmp_path / "resumed" / "rank0.log").read_text()


def test_the_worker_reads_the_newest_ask_and_only_when_it_changed(tmp_path: Path) -> None:
    path = tmp_path / "r0.requests"
    requests = CheckpointRequests(path)
    assert requests.step() == 0  # nothing asked yet
    ask_checkpoint(path, 7)
    assert requests.step() == 7
    path.write_text("garbage")  # not the agent's atomic write: kept the last good ask
    assert requests.step() == 7
    ask_checkpoint(path, 12)
    assert requests.step() == 12
    path.unlink()
    assert requests.step() == 12
    assert CheckpointRequests(None).step() == 0
