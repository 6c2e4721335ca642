"""Crash after a checkpoint, resume, and the remaining steps equal an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.daemon.supervisor import WorkerProgress
from dtfm.core.events import DoneEvent
from tests.agent.worker.testlib import assert_resumed, local_job_dir, run_local, run_workers

FLAGS = ("--model", "gpt-tiny", "--stages", "2", "--replicas", "1", "--batch", "4",
         "--micro-batches", "2", "--steps", "8", "--checkpoint-every", "4", "--seed", "5",
         "--eval-batches", "1", "--timeout", "30")


@pytest.mark.timeout(150)
def test_resume_continues_exactly(tmp_path: Path) -> None:
    full = run_local(*FLAGS, "--checkpoint-dir", str(tmp_path / "full"))
    assert full.rc == 0, full.stderr
    assert len(full.losses) == 8

    ckpt = tmp_path / "crashy"
    # Rank 1 (the last stage) dies before step 6: the step-4 checkpoint is on disk, step 5 is
    # done but not checkpointed, so resume must redo step 5 from the step-4 state and data.
    crashed = run_local(*FLAGS, "--checkpoint-dir", str(ckpt), env={"DTFM_FAULT": "1:6"})
    assert crashed.rc != 0
    assert [s["step"] for s in crashed.steps] == [1, 2, 3, 4, 5]
    for stage in (0, 1):  # kept per job id; agent local's is local-<fingerprint of its flags>
        names = sorted(p.name for p in (local_job_dir(ckpt) / f"stage-{stage}").iterdir())
        # complete files only, no temp leftovers
        assert names == ["step-00000004.manifest.json", "step-00000004.pt",
                         "step-00000004.safetensors"], names

    assert_resumed(run_local(*FLAGS, "--checkpoint-dir", str(ckpt)), full, after=4)


@pytest.mark.timeout(150)
def test_resuming_at_the_last_step_reports_that_step_done(tmp_path: Path) -> None:
    """A job that failed after its last step's checkpoint (a peer lost in the teardown)
    resumes there with nothing left to train: its workers write no step event, and their done
    event carries the step the weights are at, so the agent's heartbeat and the coordinator's
    status read "done at step 8", not "done at step 0"."""
    ckpt = tmp_path / "ckpt"
    first = run_local(*FLAGS, "--checkpoint-dir", str(ckpt))
    assert first.rc == 0, first.stderr
    again = run_workers(FLAGS, 2, ckpt,
                        tmp_path / "again", job_id=local_job_dir(ckpt).name)
    assert again.rc == 0, again.stderr
    assert again.steps == [] and again.done is not None, again.stderr
    assert (again.done["step"], again.done["resumed_step"]) == (8, 8), again.done
    progress = WorkerProgress()  # the agent folds the workers' own done event in
    progress.apply(DoneEvent(**again.done))
    assert (progress.step, progress.resumed_step) == (8, 8)
