"""Local steps (--sync-every 4) across emulated hosts: a 2 x 2 job trains, a worker dies
mid-round, the coordinator restarts the job from the last sync point's checkpoint, and the
steps after it repeat the losses of an uninterrupted run, bit for bit.

Each agent keeps its checkpoints in its own state directory, on its own host; the replicas of
a stage exchange pseudo-gradients across the emulated links (sharded, as the job's gradients
would travel). The fault (`DTFM_FAULT`, epoch 1 only) kills stage 1 of replica 1 before step
10: the round of steps 9..12 is lost, and the restarted job resumes after step 8.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dtfm.wan import WanEmulator
from dtfm.wan.cluster import WanCluster, measurement_wan

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")

DELAY = [[0, 20, 3, 20], [20, 0, 20, 3], [3, 20, 0, 20], [20, 3, 20, 0]]
RATE = [[0, 30, 80, 30], [30, 0, 30, 80], [80, 30, 0, 30], [30, 80, 30, 0]]
STEPS = 16
JOB = ["--model", "gpt-tiny", "--agents", "4", "--stages", "2", "--replicas", "2",
       "--steps", str(STEPS), "--batch", "8", "--micro-batches", "2", "--seed", "7",
       "--sync-every", "4", "--checkpoint-every", "4", "--search-seconds", "1",
       "--no-measure", "--eval-batches", "1", "--heartbeat-interval", "0.5",
       "--layer-split", "even"]  # a split measured per run would change the bits
FAULT = "3:10:exit:1"  # rank 3 (stage 1, replica 1) exits before step 10, in epoch 1 only


class _FaultyCluster(WanCluster):
    """A cluster whose agents pass the fault seam to their workers."""

    fault = ""

    def env(self) -> dict[str, str]:
        return {**super().env(), **({"DTFM_FAULT": self.fault} if self.fault else {})}


def _run(wan: WanEmulator, workdir: Path, fault: str) -> tuple[dict[str, Any], Path]:
    cluster = _FaultyCluster(wan, workdir, agents=4, coordinator_args=JOB)
    cluster.fault = fault
    try:
        cluster.start(timeout=90)
        status = cluster.wait_job(300)
    finally:
        cluster.stop()
    return status, workdir


def _losses(workdir: Path, job_id: str, epoch: int) -> dict[int, dict[int, float]]:
    """rank -> step -> loss, from every agent's progress files of one epoch."""
    out: dict[int, dict[int, float]] = {}
    for path in workdir.glob(f"agent-*/work/{job_id}-e{epoch}-r*.progress.jsonl"):
        rank = int(path.name.rsplit("-r", 1)[1].split(".")[0])
        for line in path.read_text().splitlines():
            ev = json.loads(line)
            if ev.get("event") == "step":
                out.setdefault(rank, {})[ev["step"]] = ev["loss"]
    return out


@pytest.mark.timeout(600)
def test_local_steps_resume_across_emulated_hosts_to_the_uninterrupted_losses(
        tmp_path: Path) -> None:
    with measurement_wan(DELAY, RATE) as wan:
        full, _ = _run(wan, tmp_path / "full", "")
        crashed, _ = _run(wan, tmp_path / "crashy", FAULT)
    for status in (full, crashed):
        assert status["job"]["state"] == "done", status["job"]  # the steps: from the files
    assert not full["job"]["recoveries"]
    recovery = crashed["job"]["recoveries"][0]
    assert recovery["resumed_step"] == 8, recovery  # the last sync point before the fault
    assert crashed["plan"]["epoch"] == 2 and len(crashed["plan"]["grid"]) == 2

    ref = _losses(tmp_path / "full", full["job"]["id"], 1)
    first = _losses(tmp_path / "crashy", crashed["job"]["id"], 1)
    again = _losses(tmp_path / "crashy", crashed["job"]["id"], 2)
    assert sorted(ref) == sorted(again) == [0, 1, 2, 3]
    assert all(sorted(steps) == list(range(1, STEPS + 1)) for steps in ref.values())
    assert ref[1][STEPS] < ref[1][1] - 0.3  # it learns
    for rank in (1, 3):  # the last stage of each replica reports its replica's loss
        assert [first[rank][s] for s in range(1, 10) if s in first[rank]] == \
            [ref[rank][s] for s in range(1, 10) if s in first[rank]]
        assert sorted(again[rank]) == list(range(9, STEPS + 1))
        assert [again[rank][s] for s in range(9, STEPS + 1)] == \
            [ref[rank][s] for s in range(9, STEPS + 1)], rank
