"""Resuming on another layer split is exact: a job that lost agents and continues on fewer
stages (and later grows back) trains the same model as one that never changed its layout.

Real worker processes over gloo. A 2-stage run (`agent local`, shared checkpoint directory)
dies after its step-4 checkpoint; 1-stage workers, assigned as the coordinator assigns them
after a shrink (`checkpoint_splits` = the old 2-stage cut), resume from both old stages'
step-4 checkpoints and die after step 8; 2-stage workers then resume from the 1-stage step-8
checkpoint (`checkpoint_splits` = [4]). Every loss equals the uninterrupted 2-stage run's
(fp32 rounding: the global gradient norm is summed over other stage boundaries), and the
validation loss at the end too. Without the names of the old split the resumed run starts
from step 0 instead (the cut is what makes the old checkpoints usable at all).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.agent.worker.testlib import (
    assert_close,
    local_job_dir,
    run_local,
    run_workers,
    shrink_to_one_stage,
)

STEPS = 12
FLAGS = ("--model", "gpt-tiny", "--batch", "4", "--micro-batches", "2", "--steps", str(STEPS),
         "--checkpoint-every", "4", "--seed", "5", "--eval-batches", "1", "--timeout", "30")
REL = 1e-5


@pytest.mark.timeout(600)
def test_shrinking_to_one_stage_and_growing_back_continue_exactly(tmp_path: Path) -> None:
    shrunk = shrink_to_one_stage(FLAGS, tmp_path, REL)  # 2 stages, then 1 from their step 4
    full, ckpt = shrunk.full, shrunk.ckpt
    assert len(full.losses) == STEPS

    # two stages again, each cut out of the one stage's step 8
    back = run_workers(FLAGS, 2, ckpt, tmp_path / "back", [4], job_id=shrunk.job_dir.name)
    assert back.rc == 0, back.stderr
    assert [s["step"] for s in back.steps] == [9, 10, 11, 12]
    assert_close(back.losses, full.losses[8:], REL)
    assert back.done is not None and full.done is not None
    assert abs(back.done["val_loss"] - full.done["val_loss"]) <= REL * full.done["val_loss"]


@pytest.mark.timeout(300)
def test_without_the_old_split_the_old_stages_are_not_loaded(tmp_path: Path) -> None:
    """The negative: one stage told nothing of the old cut finds no checkpoint of its own
    layers (stage 0's holds only layers 0-1), says so, and starts from step 0; it never
    loads half a model."""
    ckpt = tmp_path / "ckpt"
    two = run_local(*FLAGS, "--stages", "2", "--replicas", "1", "--checkpoint-dir", str(ckpt),
                    env={"DTFM_FAULT": "1:6"})
    assert two.rc != 0
    one = run_workers(FLAGS, 1, ckpt, tmp_path / "one", None, fault="0:3",
                      job_id=local_job_dir(ckpt).name)
    assert [s["step"] for s in one.steps] == [1, 2], one.stderr
    log = (tmp_path / "one" / "rank0.log").read_text()
    assert "holds layers [0, 2) but this stage now has [0, 4)" in log, log
