"""A stage's checkpoint written behind a NAT reaches its mirror (issue 32).

Two agents across the emulated WAN, agent 1 behind a NAT (nobody can dial it). A 2-stage,
1-replica job keeps each stage on two agents: the other stage's agent mirrors it. Agent 0's
stage is pulled by agent 1 as before (it dials out); agent 1's cannot be pulled, so agent 1
pushes it to agent 0 (`Agent.PushCheckpoint`, dtfm/checkpoints/push.py). At the end agent 0
holds intact copies of the NATed agent's stage, up to the job's last step.

With both agents behind NATs nobody can take either copy, and each pushes its stage to the
coordinator instead (coordinator/job/checkpointcopies.py), from where the job fetches a lost
stage when it resumes.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from agent.daemon.statedir import checkpoint_dir
from dtfm.core import checkpoints as ondisk
from dtfm.procs import wait_for
from dtfm.wan import WanEmulator
from dtfm.wan.cluster import WanCluster, measurement_wan
from tests.progress import job_losses

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


# ---- every agent behind a NAT: the coordinator keeps the copy of last resort ----

EVERY = 4
# long enough that the kill lands mid-run on an idle machine too: at 40, an idle CI run trained
# all 40 steps before the coordinator held its copy, and epoch 2 resumed with nothing to train
LONG = 120
ALL_NAT_JOB = ["--model", "gpt-tiny", "--agents", "2", "--min-agents", "1", "--stages", "2",
               "--replicas", "1", "--steps", str(LONG), "--batch", "8", "--micro-batches", "2",
               "--seed", "5", "--search-seconds", "1", "--eval-batches", "0",
               "--checkpoint-every", str(EVERY), "--heartbeat-interval", "0.5",
               "--layer-split", "even"]


def _report_epochs(report: dict[str, Any]) -> set[int]:
    return {p["epoch"] for p in report["points"] if p["loss"]}


@pytest.mark.timeout(300)
def test_with_every_agent_natted_a_killed_stage_resumes_from_the_coordinators_copy(
        tmp_path: Path) -> None:
    """Both agents behind NATs of their own (a small job, but the path of any job where no
    member can be dialled): nobody can dial either, so neither can copy the
    other's stage; each pushes its stage to the coordinator (every agent dials it). Stage 1's
    agent is SIGKILLed once the coordinator holds a step of its stage; the job re-plans onto
    the survivor (1 x 1, --min-agents 1), which fetches the lost stage's layers from the
    coordinator and resumes from that step, losses continuing where they were. Before, the
    stage was kept only where it was written and the job restarted from step 0. At the end
    the coordinator has deleted its copies."""
    state = tmp_path / "coordinator-state"
    state.mkdir()
    with measurement_wan(DELAY, RATE, nat=[0, 1]) as wan:
        cluster = WanCluster(wan, tmp_path, agents=2,
                             coordinator_args=[*ALL_NAT_JOB, "--state-dir", str(state)])
        try:
            ids = cluster.start(timeout=90)
            seen: dict[str, Any] = {}

            def copy_held() -> int:
                s = cluster.status()
                if not s or s["job"]["state"] != "running" or not s["plan"]:
                    return 0
                seen.update(s)
                victim_stage = 1
                held = {c["stage"]: c["step"] for c in s["job"]["coordinator_checkpoints"]}
                return held.get(victim_stage, 0) if held.get(victim_stage, 0) >= 2 * EVERY \
                    else 0

            held = wait_for(copy_held, 150, "the coordinator to hold a step of stage 1 "
                            f"(logs in {tmp_path})", 0.3)
            job_id, grid = seen["job"]["id"], seen["plan"]["grid"]
            survivor, victim = ids.index(grid[0][0]), ids.index(grid[1][0])
            cluster.agent_procs[victim].kill()
            done = cluster.wait_job(200)
            report = cluster.cli("report", "--json", timeout=30)
        finally:
            cluster.stop()
    job = done["job"]
    assert job["state"] == "done" and job["step"] == LONG, job
    first = job["recoveries"][0]
    assert (first["layout_before"], first["layout_after"]) == ("2x1", "1x1"), first
    coordinator_log = (tmp_path / "coordinator.log").read_text(errors="replace")
    assert "pushed to the coordinator by" in coordinator_log, coordinator_log[-3000:]
    agent_log = (tmp_path / f"agent-{survivor}.log").read_text(errors="replace")
    copied = [int(s) for s in re.findall(
        rf"checkpoint: copied stage 1 step (\d+) of job {re.escape(job_id)} from coordinator ",
        agent_log)]
    assert copied and max(copied) >= held, (held, copied, agent_log[-3000:])
    work = tmp_path / f"agent-{survivor}" / "work"
    epoch2 = "".join(p.read_text(errors="replace") for p in work.glob(f"{job_id}-e2-*.log"))
    resumed = [int(s) for s in re.findall(r"rank \d+: resumed at step (\d+) from ", epoch2)]
    assert resumed and resumed[0] >= held, (held, resumed, epoch2[-3000:])
    assert first["resumed_step"] == resumed[0], (first, resumed)
    # the losses go on from where they were: epoch 2's first step is near epoch 1's at the
    # step it resumed from (one batch's noise: ~0.2 here) and well below epoch 1's first (a
    # fresh start's), and steps trained in both epochs agree. From the workers' own files,
    # every step: the heartbeats sample too few under load to be sure they caught an early one.
    before, after = job_losses(tmp_path, job_id, 1), job_losses(tmp_path, job_id, 2)
    at = resumed[0]
    assert 1 in before and at in before and min(after) == at + 1, (at, before, after)
    assert abs(after[at + 1] - before[at]) < 0.4, (at, before, after)
    assert after[at + 1] < before[1] - 0.3, (at, before, after)
    both = sorted(set(before) & set(after))
    for step in both:
        assert after[step] == pytest.approx(before[step], rel=2e-3), (step, before, after)
    assert _report_epochs(report) >= {1, 2}, report  # the coordinator saw both epochs train
    # the job ended: nothing of it is left at the coordinator
    assert not list((state / "checkpoints").glob(f"{ondisk.job_key(job_id)}*")), \
        list((state / "checkpoints").rglob("*"))
    assert "removed the coordinator's copies of job" in coordinator_log
    print(f"\ncoordinator held stage 1 step {held} at the kill; survivor copied {copied}, "
          f"resumed at {resumed[0]}; epoch 1 losses {before}; epoch 2 losses {after}; "
          f"steps in both {both}")
