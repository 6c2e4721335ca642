"""`agent local` runs are told apart by the fingerprint of their flags, as cluster jobs are.

Every local run used to be job `local`: a second run with another seed or learning rate on the
same --checkpoint-dir "resumed" the first one's last step and printed "done" after training
nothing; with another model it failed on a missing tensor. Now a run's job id (and folder) is
`local-<fingerprint>` (`dtfm.core.fingerprint`): a run with other flags starts from step 0 in
a folder of its own, a rerun with the same flags resumes, and a rerun of a finished run says
there is nothing to train instead of "done".
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pytest

from agent.commands.local import LocalJob, add_arguments
from coordinator.daemon import jobstore
from dtfm.core import fingerprint as core_fingerprint
from tests.agent.worker.testlib import local_job_dir, run_local

FLAGS = ("--model", "gpt-tiny", "--stages", "2", "--replicas", "1", "--batch", "4",
         "--micro-batches", "2", "--steps", "4", "--checkpoint-every", "2", "--seed", "5",
         "--eval-batches", "1", "--timeout", "30")


def _job(*flags: str) -> LocalJob:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return LocalJob(parser.parse_args(list(flags)), io.StringIO())


def test_the_coordinator_and_agent_local_share_one_fingerprint_rule() -> None:
    assert jobstore.fingerprint is core_fingerprint.fingerprint
    # the digest a coordinator's state dir already stores must not change with the move
    assert core_fingerprint.fingerprint({"model": "gpt-tiny", "seed": 0}) == (
        "6a982b3010b34d78")


def test_a_local_job_id_changes_with_what_must_match_to_resume(tmp_path: Path) -> None:
    base = _job(*FLAGS).job_id
    assert base.startswith("local-") and base == _job(*FLAGS).job_id
    for change in (("--seed", "6"), ("--lr", "0.002"), ("--model", "gpt-mini"),
                   ("--layer-splits", "3,1"), ("--replicas", "2"), ("--steps", "5")):
        assert _job(*FLAGS, *change).job_id != base, change
    # where the checkpoints go is not what was trained
    assert _job(*FLAGS, "--checkpoint-dir", str(tmp_path)).job_id == base
    # nor how often it is evaluated (--eval-every): that trains nothing differently
    assert _job(*FLAGS, "--eval-every", "2").job_id == base


@pytest.mark.timeout(300)
def test_another_run_starts_fresh_and_a_finished_one_says_so(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first = run_local(*FLAGS, "--checkpoint-dir", str(ckpt))
    assert first.rc == 0, first.stderr
    assert [s["step"] for s in first.steps] == [1, 2, 3, 4] and first.done is not None
    own = local_job_dir(ckpt)

    # another seed on the same directory: its own folder, all four steps trained
    other = run_local(*FLAGS, "--seed", "6", "--checkpoint-dir", str(ckpt))
    assert other.rc == 0, other.stderr
    assert [s["step"] for s in other.steps] == [1, 2, 3, 4], other.stderr
    assert other.losses != first.losses
    assert f"other local run(s) ({own.name})" in other.stderr, other.stderr
    assert "starts at step 0" in other.stderr
    assert len([p for p in ckpt.iterdir() if p.name.startswith("local-")]) == 2

    # the first run's flags again: nothing to train, said so, never "done"
    again = run_local(*FLAGS, "--checkpoint-dir", str(ckpt))
    assert again.rc == 0, again.stderr
    assert again.steps == [] and again.done is None
    assert again.nothing_to_train == {"nothing_to_train": True, "checkpoint_step": 4,
                                      "checkpoints": str(own)}
    assert "nothing to train" in again.stderr and "--checkpoint-dir" in again.stderr


def test_the_coordinators_fingerprint_ignores_how_often_a_job_evaluates() -> None:
    """A coordinator restarted with another --eval-every adopts its stored job, and the
    fingerprints stored before the flag existed still match."""
    from dataclasses import asdict

    from coordinator.daemon.config import JobConfig
    from coordinator.job.jobsnapshot import job_fingerprint
    from dtfm.core.fingerprint import LATER_AT_DEFAULT, REPORTING_ONLY
    from dtfm.core.spec import TrainConfig

    plain = JobConfig(model="gpt-tiny", agents=2)
    assert job_fingerprint(plain) == job_fingerprint(
        JobConfig(model="gpt-tiny", agents=2, train=TrainConfig(eval_every=5)))
    # as stored before --outer-delay existed: its default leaves the fingerprint alone
    before = {k: v for k, v in asdict(plain.train).items()
              if k not in REPORTING_ONLY and k not in LATER_AT_DEFAULT}
    assert job_fingerprint(plain) == core_fingerprint.fingerprint({
        "model": "gpt-tiny", "agents": 2, "stages": 0, "replicas": 0, "train": before,
        "placement": plain.placement, "layer_split": plain.layer_split, "seed": plain.seed})
    # ... and a job that delays its outer step trains otherwise: another job
    assert job_fingerprint(plain) != job_fingerprint(JobConfig(
        model="gpt-tiny", agents=2, train=TrainConfig(sync_every=4, outer_delay=1))) != \
        job_fingerprint(JobConfig(model="gpt-tiny", agents=2, train=TrainConfig(sync_every=4)))
