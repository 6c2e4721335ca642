"""Local steps (--sync-every 4) across emulated hosts: a 2 x 2 job trains, a worker dies
mid-round, the coordinator restarts the job from the last sync point's checkpoint, and the
steps after it repeat the losses of an uninterrupted run, bit for bit. And an agent that dies
for good is replaced by a spare on another host, which holds nothing: it copies its stage's
checkpoint of the last sync point, outer momentum included, over the emulated links.

Each agent keeps its checkpoints in its own state directory, on its own host; the replicas of
a stage exchange pseudo-gradients across the emulated links (sharded, as the job's gradients
would travel). The fault (`DTFM_FAULT`, epoch 1 only) kills stage 1 of replica 1 before step
10: the round of steps 9..12 is lost, and the restarted job resumes after step 8.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from dtfm.procs import wait_for
from dtfm.wan import WanEmulator
from dtfm.wan.cluster import AGENT_PORT, WanCluster, measurement_wan
from tests.progress import step_losses

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
# agents keep their spare worker (the "spare" below is a spare agent, not this): it forks
# each epoch's worker, one torch import per agent instead of one per worker start
AGENT_ARGS: list[str] = []
FAULT = "3:10:exit:1"  # rank 3 (stage 1, replica 1) exits before step 10, in epoch 1 only


class _FaultyCluster(WanCluster):
    """A cluster whose agents pass the fault seam to their workers."""

    fault = ""

    def env(self) -> dict[str, str]:
        return {**super().env(), **({"DTFM_FAULT": self.fault} if self.fault else {})}


def _run(wan: WanEmulator, workdir: Path, fault: str) -> tuple[dict[str, Any], Path]:
    cluster = _FaultyCluster(wan, workdir, agents=4, coordinator_args=JOB, agent_args=AGENT_ARGS)
    cluster.fault = fault
    _, status = cluster.run_to_end(300)
    return status, workdir


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

    ref = step_losses(tmp_path / "full", full["job"]["id"], 1)
    first = step_losses(tmp_path / "crashy", crashed["job"]["id"], 1)
    again = step_losses(tmp_path / "crashy", crashed["job"]["id"], 2)
    assert sorted(ref) == sorted(again) == [0, 1, 2, 3]
    assert all(sorted(steps) == list(range(1, STEPS + 1)) for steps in ref.values())
    assert ref[1][STEPS] < ref[1][1] - 0.3  # it learns
    for rank in (1, 3):  # the last stage of each replica reports its replica's loss
        assert [first[rank][s] for s in range(1, 10) if s in first[rank]] == \
            [ref[rank][s] for s in range(1, 10) if s in first[rank]]
        assert sorted(again[rank]) == list(range(9, STEPS + 1))
        assert [again[rank][s] for s in range(9, STEPS + 1)] == \
            [ref[rank][s] for s in range(9, STEPS + 1)], rank


# five hosts: the 2 x 2 job and a spare, which is far from everyone (so its copy crosses a
# long link: 25-40 ms one way, 20-30 Mbit/s)
SPARE_DELAY = [[*row, 30] for row in DELAY] + [[25, 40, 30, 35, 0]]
SPARE_RATE = [[*row, 25] for row in RATE] + [[20, 30, 25, 30, 0]]
SPARE_STEPS = 40
SPARE_JOB = [*JOB[:JOB.index("--steps")], "--steps", str(SPARE_STEPS),
             *JOB[JOB.index("--steps") + 2:]]


@pytest.mark.timeout(420)
def test_a_spare_on_another_host_takes_a_dead_replica_with_the_outer_state(
        tmp_path: Path) -> None:
    state = [tmp_path / f"agent-{i}" for i in range(5)]  # WanCluster's --state-dir per agent
    with measurement_wan(SPARE_DELAY, SPARE_RATE) as wan:
        cluster = WanCluster(wan, tmp_path, agents=5, coordinator_args=SPARE_JOB,
                             agent_args=AGENT_ARGS)
        try:
            ids = cluster.start(timeout=90)
            running = wait_for(
                lambda: (s := cluster.status()) and s["job"]["step"] >= 10
                and s, 240, f"training to pass step 10 (logs in {tmp_path})", 0.3)
            job_id, grid = running["job"]["id"], running["plan"]["grid"]
            members = {a for row in grid for a in row}
            spare = next(i for i, a in enumerate(ids) if a not in members)
            victim = ids.index(grid[1][1])
            peer = ids.index(grid[1][0])  # the other replica of stage 1 holds its checkpoints
            assert not list(state[spare].glob("checkpoints/*/*/*.pt")), "the spare holds some"
            cluster.agent_procs[victim].kill()
            done = cluster.wait_job(300)
        finally:
            cluster.stop()

    job = done["job"]
    assert job["state"] == "done" and job["step"] == SPARE_STEPS, job
    first = job["recoveries"][0]
    assert first["layout_before"] == first["layout_after"] == "2x2", first
    step = first["resumed_step"]
    assert step >= 8 and step % 4 == 0, first  # a sync point, not step 0
    assert ids[spare] in str(done["plan"]["grid"]) and ids[victim] not in str(done["plan"]["grid"])
    spare_stage = next(s for s, row in enumerate(done["plan"]["grid"]) if ids[spare] in row)

    # the spare copied that step of its stage over the emulated WAN, from a host that held it
    log = (tmp_path / f"agent-{spare}.log").read_text(errors="replace")
    sources = re.findall(rf"checkpoint: copied stage {spare_stage} step {step} of job "
                         rf"{re.escape(job_id)} from ([\d.]+):{AGENT_PORT} \(", log)
    # every member but the victim held checkpoints; the spare may be any of the five hosts
    holders = {wan.address(i + 1) for i in range(5) if i not in (victim, spare)}
    assert sources and set(sources) <= holders, (sources, holders, log[-3000:])
    if spare_stage == 1:
        assert sources == [wan.address(peer + 1)], sources
    # ... and its worker resumed from it with the outer momentum of that round, not a zero one
    worker = "".join(p.read_text(errors="replace")
                     for p in (state[spare] / "work").glob(f"{job_id}-e2-*.log"))
    resumed = re.search(rf"resumed at step {step} from stage {spare_stage} \(layers \d+-\d+\) "
                        rf"in {re.escape(str(state[spare]))}/checkpoints/\S+, with the outer "
                        rf"momentum of round {step // 4} \(norm ([\d.e+-]+)\)", worker)
    assert resumed and float(resumed.group(1)) > 0, worker[-3000:]
    print(f"\nkilled {ids[victim]} after step 10; the spare took stage {spare_stage} at step "
          f"{step} (lost {first['steps_lost']} steps, stalled {first['stalled_s']:.1f} s), "
          f"copied from {sources}, outer momentum norm {resumed.group(1)}")
