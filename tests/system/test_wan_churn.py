"""Churn across emulated hosts with no shared storage: each agent keeps its checkpoints in its
own state directory, on its own host.

A job of 2 stages x 1 replica runs on two of three agents; the third is a spare. A stage with
one replica is held twice: by its own agent and by a mirror on the other stage's agent. When
the agent of stage 1 is SIGKILLed, the job resumes on the survivor and the spare, and the
spare, which holds nothing, copies its stage's checkpoint from the survivor over the emulated
WAN before its worker starts. Loopback would hide a copy that works only between processes of
one host (a peer address that is not the advertised one, a bind to 127.0.0.1).

The kill waits for a lagging mirror: the survivor's copy of stage 1 (refreshed every few
seconds) holds a step that the survivor's own stage 0 has since checkpointed past twice, so a
stage that kept only its newest two steps would share no step with that copy. The job must
still resume from the copy's step, not from step 0 (before the coordinator asked the agents to
keep checkpoints back to the oldest mirrored step, it restarted from step 0: "starting from
step 0 although stage 1 (layers 2-3) hold step 8 intact").
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from dtfm.procs import wait_for
from dtfm.wan import WanEmulator
from dtfm.wan.cluster import AGENT_PORT, WanCluster, measurement_wan

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")

# agents on hosts 1..3 (the coordinator is host 0, with free links): 5 to 20 ms one way,
# 40-100 Mbit/s, asymmetric, so every copy crosses a link with real delay and rate
DELAY = [[0, 5, 20], [6, 0, 12], [18, 10, 0]]
RATE = [[0, 100, 40], [80, 0, 60], [50, 70, 0]]
EVERY = 5  # ~0.6 s of steps here: several checkpoints per mirror pass (5 s)
STEPS = 120
JOB = ["--model", "gpt-tiny", "--agents", "2", "--min-agents", "1", "--stages", "2",
       "--replicas", "1", "--steps", str(STEPS), "--batch", "4", "--micro-batches", "2",
       "--checkpoint-every", str(EVERY), "--search-seconds", "1", "--no-measure",
       "--eval-batches", "0", "--heartbeat-interval", "0.5"]
MIRROR_SETTLE_S = 2.0  # a mirror pass (two copies of 1.4 MiB) is over well within this
# (with --mirror-interval 5)
MANIFEST = re.compile(r"^step-(\d{8})\.manifest\.json$")


def _steps(state_dir: Path, stage: int) -> set[int]:
    """The steps of `stage` an agent's state directory holds (a manifest is written last)."""
    return {int(m.group(1)) for p in state_dir.glob(f"checkpoints/*/stage-{stage}/*")
            if (m := MANIFEST.match(p.name))}


@pytest.mark.timeout(240)
def test_a_spare_on_another_host_resumes_a_killed_stage_from_a_copied_checkpoint(
        tmp_path: Path) -> None:
    state = [tmp_path / f"agent-{i}" for i in range(3)]  # WanCluster's --state-dir per agent
    with measurement_wan(DELAY, RATE) as wan:
        # mirrors poll every 5 s (the default is 1 s), so the survivor's copy lags its own
        # stage by several checkpoints: the case the floor exists for
        cluster = WanCluster(wan, tmp_path, agents=3, coordinator_args=JOB,
                             agent_args=["--mirror-interval", "5"])
        try:
            ids = cluster.start(timeout=90)
            running = wait_for(lambda: (s := cluster.status()) and s["job"]["state"] == "running"
                               and s["plan"] and s, 120, f"the job to start (logs in {tmp_path})",
                               0.5)
            job_id, grid = running["job"]["id"], running["plan"]["grid"]
            assert [len(row) for row in grid] == [1, 1], grid
            survivor, victim = ids.index(grid[0][0]), ids.index(grid[1][0])
            spare = ({0, 1, 2} - {survivor, victim}).pop()
            survivor_address = f"{wan.address(survivor + 1)}:{AGENT_PORT}"

            seen = {"step": 0, "since": 0.0}

            def mirror_lags() -> int:
                """The step the survivor's mirror of stage 1 holds once its pass is over (the
                same newest step for MIRROR_SETTLE_S) while the survivor's own stage 0 has
                checkpointed twice since; 0 before that."""
                mirrored = max(_steps(state[survivor], 1), default=0)
                own = max(_steps(state[survivor], 0), default=0)
                if mirrored != seen["step"]:
                    seen.update(step=mirrored, since=time.monotonic())
                settled = time.monotonic() - seen["since"] >= MIRROR_SETTLE_S
                return mirrored if (mirrored >= EVERY and settled
                                    and own >= mirrored + 2 * EVERY) else 0

            held = wait_for(mirror_lags, 150, "the survivor's mirror of stage 1 to lag two "
                            f"checkpoints behind its own stage 0 (logs in {tmp_path})", 0.02)
            assert not list(state[spare].glob("checkpoints/*/*/*.pt")), "the spare holds some"
            cluster.agent_procs[victim].kill()
            killed_at = time.monotonic()

            done = cluster.wait_job(180)
            took = time.monotonic() - killed_at
            plan = done["plan"]
        finally:
            cluster.stop()

    job = done["job"]
    assert job["state"] == "done" and job["step"] == STEPS, job
    assert job["recoveries"], job
    first = job["recoveries"][0]
    assert first["layout_before"] == "2x1" and first["layout_after"] == "2x1", first
    assert plan["epoch"] == 2 and ids[victim] not in str(plan["grid"]), plan
    spare_stage = next(s for s, row in enumerate(plan["grid"]) if ids[spare] in row)

    # both workers of the new epoch resumed from one step: the mirror's, or a newer one, not 0
    epoch2 = "".join(p.read_text(errors="replace") for i in (survivor, spare)
                     for p in (state[i] / "work").glob(f"{job_id}-e2-*.log"))
    resumed = {int(s) for s in re.findall(r"rank \d+: resumed at step (\d+) from ", epoch2)}
    assert len(resumed) == 1 and (step := resumed.pop()) >= held > 0, (
        f"the mirror held step {held} of stage 1 at the kill; the workers resumed from "
        f"{sorted(resumed) or 'step 0'}: "
        f"{re.findall(r'rank .*(?:resumed at|starting from) step .*', epoch2)}")
    assert first["resumed_step"] == step, (first, step)  # the workers report it

    # the spare copied that step of its stage from the survivor's host, into its own state
    # directory, and its worker read it there
    log = (tmp_path / f"agent-{spare}.log").read_text(errors="replace")
    copied = [int(s) for s in re.findall(
        rf"checkpoint: copied stage {spare_stage} step (\d+) of job {re.escape(job_id)} "
        rf"from {re.escape(survivor_address)} \(", log)]
    assert step in copied, (step, copied, log[-3000:])
    worker_logs = "".join(p.read_text(errors="replace")
                          for p in (state[spare] / "work").glob(f"{job_id}-e2-*.log"))
    assert re.search(rf"resumed at step {step} from stage {spare_stage} \(layers \d+-\d+\) "
                     rf"in {re.escape(str(state[spare]))}/checkpoints/", worker_logs), \
        worker_logs[-3000:]
    print(f"\nkilled with the mirror of stage 1 at step {held}; resumed from {step} (status: "
          f"after {first['resumed_step']}, lost {first['steps_lost']} steps, stalled "
          f"{first['stalled_s']:.1f} s); the spare took stage {spare_stage}, copied steps "
          f"{copied}; kill to done {took:.1f} s")
