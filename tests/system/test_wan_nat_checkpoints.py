"""A stage's checkpoint written behind a NAT reaches its mirror (issue 32).

Two agents across the emulated WAN, agent 1 behind a NAT (nobody can dial it). A 2-stage,
1-replica job keeps each stage on two agents: the other stage's agent mirrors it. Agent 0's
stage is pulled by agent 1 as before (it dials out); agent 1's cannot be pulled, so agent 1
pushes it to agent 0 (`Agent.PushCheckpoint`, agent/checkpointpush.py). At the end agent 0
holds intact copies of the NATed agent's stage, up to the job's last step.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agent.statedir import checkpoint_dir
from dtfm.core import checkpoints as ondisk
from dtfm.wan import WanEmulator
from dtfm.wan.cluster import WanCluster, measurement_wan

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")

DELAY = [[0, 10], [10, 0]]
RATE = [[0, 100], [100, 0]]
STEPS = 8
JOB = ["--model", "gpt-tiny", "--agents", "2", "--stages", "2", "--replicas", "1",
       "--steps", str(STEPS), "--batch", "8", "--micro-batches", "2", "--seed", "5",
       "--search-seconds", "1", "--eval-batches", "0", "--checkpoint-every", "2",
       "--heartbeat-interval", "0.5", "--layer-split", "even"]


def _held(state: Path, job_id: str, stage: int) -> list[int]:
    root = ondisk.job_dir(checkpoint_dir(state), job_id)
    return [s for s in ondisk.steps_available(root, stage)
            if ondisk.verify(root, stage, s, job_id=job_id) is None]


@pytest.mark.timeout(400)
def test_a_natted_agents_stage_is_pushed_to_its_mirror(tmp_path: Path) -> None:
    with measurement_wan(DELAY, RATE, nat=[1]) as wan:
        cluster = WanCluster(wan, tmp_path, agents=2, coordinator_args=JOB)
        try:
            ids = cluster.start(timeout=90)
            status = cluster.wait_job(300)
            job_id = status["job"]["id"]
            # the NATed agent's stage
            stage = next(s for s, row in enumerate(status["plan"]["grid"]) if ids[1] in row)
            deadline = time.monotonic() + 30  # the last step's push follows the job's end
            while STEPS not in _held(tmp_path / "agent-0", job_id, stage) \
                    and time.monotonic() < deadline:
                time.sleep(0.5)
        finally:
            cluster.stop()
    job = status["job"]
    assert job["state"] == "done" and job["step"] == STEPS, job
    log0 = (tmp_path / "agent-0.log").read_text(errors="replace")
    log1 = (tmp_path / "agent-1.log").read_text(errors="replace")
    assert "pushed here by" in log0, log0[-3000:]
    assert "checkpoint: pushing stage" in log1 and "cannot push" not in log1, log1[-3000:]
    assert STEPS in _held(tmp_path / "agent-0", job_id, stage), (stage, log0[-2000:])
