"""Local steps (--sync-every H > 1): the outer Nesterov step, and real runs that sync.

The step is pinned against numbers worked out by hand and against torch's own SGD; the runs
are `agent local` jobs over gloo: 1 x 2 and 2 x 2 with H = 4 learn, every replica of a stage
holds the same parameters right after each sync point, and a run resumed from a checkpoint
continues with the losses of an uninterrupted one.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from agent.worker.outer import outer_step_
from dtfm.core.rounds import newest_checkpoint, requested_checkpoint, round_of, sync_due
from tests.agent.worker.testlib import (
    assert_resumed,
    local_job_dir,
    run_local,
    step_events,
)


def test_outer_step_matches_a_hand_computed_nesterov_step() -> None:
    anchor = torch.tensor([1.0, -2.0])
    momentum = torch.zeros(2)
    # round 1: m = 0.9 * 0 + d = [0.5, -1]; anchor -= 0.7 * (d + 0.9 m) = 0.7 * 1.9 d
    outer_step_(anchor, torch.tensor([0.5, -1.0]), momentum, lr=0.7, mu=0.9)
    assert torch.allclose(momentum, torch.tensor([0.5, -1.0]))
    assert torch.allclose(anchor, torch.tensor([1.0 - 0.665, -2.0 + 1.33]))
    # round 2, d = [0.1, 0.2]: m = [0.45 + 0.1, -0.9 + 0.2] = [0.55, -0.7];
    # anchor -= 0.7 * ([0.1, 0.2] + 0.9 * [0.55, -0.7]) = 0.7 * [0.595, -0.43]
    outer_step_(anchor, torch.tensor([0.1, 0.2]), momentum, lr=0.7, mu=0.9)
    assert torch.allclose(momentum, torch.tensor([0.55, -0.7]))
    assert torch.allclose(anchor, torch.tensor([0.335 - 0.4165, -0.67 + 0.301]))


def test_outer_step_is_torch_sgd_with_nesterov_momentum() -> None:
    torch.manual_seed(0)
    start = torch.randn(5)
    ours, momentum = start.clone(), torch.zeros(5)
    theirs = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([theirs], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(4):
        delta = torch.randn(5)
        outer_step_(ours, delta, momentum, lr=0.7, mu=0.9)
        theirs.grad = delta.clone()
        sgd.step()
    assert torch.allclose(ours, theirs.detach(), atol=1e-6)


def test_rounds_end_every_h_steps_and_at_the_last_step() -> None:
    assert [s for s in range(1, 11) if sync_due(s, 4, 10)] == [4, 8, 10]
    assert [round_of(s, 4) for s in (1, 4, 5, 8, 10)] == [1, 1, 2, 2, 3]


def test_checkpoints_due_inside_a_round_are_written_at_its_end() -> None:
    # every 6 with H = 4: due after 6, 12, 18, 24 -> written after 8, 12, 20, 24
    assert [newest_checkpoint(s, 6, 4) for s in (5, 7, 8, 11, 12, 19, 20, 24)] == \
        [0, 0, 8, 8, 12, 12, 20, 24]
    # synchronous: every multiple, at once (the coordinator's old rule)
    assert [newest_checkpoint(s, 5) for s in range(1, 16)] == [s // 5 * 5 for s in range(1, 16)]
    # H larger than the interval: one checkpoint per round
    assert [newest_checkpoint(s, 2, 8) for s in (7, 8, 15, 16)] == [0, 8, 8, 16]
    assert newest_checkpoint(9, 0, 4) == 0


def test_a_requested_checkpoint_lies_ahead_at_a_round_end_and_before_the_regular_one() -> None:
    # (known, last, lead, checkpoint_every, sync_every, total)
    assert requested_checkpoint(20, 23, 2, 10, 1, 100) == 25
    assert requested_checkpoint(20, 27, 2, 10, 1, 100) == 29
    assert requested_checkpoint(20, 28, 2, 10, 1, 100) == 0  # the regular 30 is as soon
    assert requested_checkpoint(20, 30, 2, 10, 1, 100) == 0  # 30 is being written
    assert requested_checkpoint(30, 31, 2, 10, 1, 100) == 33
    assert requested_checkpoint(20, 23, 2, 10, 1, 25) == 0  # the job's last step comes first
    assert requested_checkpoint(0, 9, 2, 24, 4, 100) == 12  # local steps: a round's end
    assert requested_checkpoint(0, 21, 2, 24, 4, 100) == 0  # the regular 24 is as soon
    assert requested_checkpoint(0, 5, 2, 0, 1, 100) == 0  # checkpoints off


COMMON = ("--model", "gpt-tiny", "--batch", "8", "--micro-batches", "2", "--steps", "12",
          "--seed", "3", "--eval-batches", "1", "--timeout", "60", "--sync-every", "4")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stages", [1, 2], ids=["1x2", "2x2"])
def test_local_steps_train_and_replicas_agree_after_each_sync(tmp_path: Path,
                                                              stages: int) -> None:
    run = run_local(*COMMON, "--stages", str(stages), "--replicas", "2",
                    "--workdir", str(tmp_path))
    assert run.rc == 0, run.stderr
    assert [s["step"] for s in run.steps] == list(range(1, 13))
    assert run.losses[-1] < run.losses[0] - 0.3, run.losses
    events = step_events(tmp_path)
    assert len(events) == 2 * stages
    for stage in range(stages):
        replicas = [events[r * stages + stage] for r in (0, 1)]
        for step in range(12):
            a, b = (ev[step] for ev in replicas)
            synced = (step + 1) % 4 == 0
            assert a["sync_round"] == b["sync_round"] == math.ceil((step + 1) / 4)
            if not synced:  # inner steps exchange nothing with the other replica
                assert a["dp_bytes"] == b["dp_bytes"] == 0
                assert a["param_checksum"] is None or math.isnan(float(a["param_checksum"]))
                continue
            assert float(a["dp_bytes"]) > 0
            assert float(a["drift"]) > 0 and float(b["drift"]) > 0
            # the same bits on both replicas right after the sync point
            assert a["param_checksum"] == b["param_checksum"], (stage, step)
        # between syncs the replicas train on different data and drift apart
        assert replicas[0][1]["loss"] != replicas[1][1]["loss"] or stages > 1


RESUME = ("--model", "gpt-tiny", "--stages", "2", "--replicas", "2", "--batch", "8",
          "--micro-batches", "2", "--steps", "12", "--seed", "5", "--eval-batches", "1",
          "--timeout", "60", "--sync-every", "4", "--checkpoint-every", "6")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("delay", ["0", "1", "2bw"], ids=["waiting", "outer-delay", "no-flush"])
def test_local_steps_resume_from_a_sync_point_exactly(tmp_path: Path, delay: str) -> None:
    """With --outer-delay 1 too: the checkpoint's sync point flushed the exchange in flight;
    and with --pipeline-delay 1, whose sync points flush the pipeline and its updates."""
    flags = (*RESUME, "--outer-delay", delay) if delay != "2bw" else (
        *RESUME, "--outer-delay", "1", "--schedule", "1f1b", "--pipeline-delay", "1",
        "--warmup-steps", "1")  # the warm-up's steps flush
    full = run_local(*flags, "--checkpoint-dir", str(tmp_path / "full"))
    assert full.rc == 0, full.stderr
    # the checkpoint asked for after step 6 waits for the end of the round, step 8
    ckpt = tmp_path / "crashy"
    crashed = run_local(*flags, "--checkpoint-dir", str(ckpt), env={"DTFM_FAULT": "1:10"})
    assert crashed.rc != 0
    # without flushes a step is reported when its update is applied: step 9's, at step 11
    reported = 8 if delay == "2bw" else 9
    assert [s["step"] for s in crashed.steps] == list(range(1, reported + 1))
    for stage in (0, 1):
        names = sorted(p.name for p in (local_job_dir(ckpt) / f"stage-{stage}").iterdir())
        # step 8's files only (the manifest, the .pt, the weights): no step 6 or temp files
        assert names and all(n.startswith("step-00000008.") for n in names), names
        assert "step-00000008.manifest.json" in names and "step-00000008.pt" in names, names
    state = torch.load(local_job_dir(ckpt) / "stage-0" / "step-00000008.pt", weights_only=True)
    assert state["outer"]["every"] == 4 and state["outer"]["rounds"] == 2
    assert any(float(m.abs().sum()) > 0 for m in state["outer"]["momentum"].values())

    assert_resumed(run_local(*flags, "--checkpoint-dir", str(ckpt)), full, after=8)
