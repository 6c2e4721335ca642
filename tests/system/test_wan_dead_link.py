"""One link dies for good between two live agents, across emulated hosts: the job finishes on
the links that work.

Four agents train 2 stages x 2 replicas. Mid-run the link between the two pipeline neighbours
of replica 1 is cut both ways (the emulator drops every packet between those two hosts), while
both still reach the coordinator and the other two agents: a route failure between two
networks, or a firewall between two sites. Their workers time out on each other; the
recovery re-measures the links the peer errors blame, finds the one that carries nothing, and
plans around it: the two ends of the dead link end up in different stages and different
replicas, where no worker connects them. Before, the coordinator restarted the same placement
(its stored links said nothing had changed) until its restarts ran out.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.links.failure import connected_pairs
from dtfm.procs import wait_for
from dtfm.wan import WanEmulator
from dtfm.wan.cluster import WanCluster, measurement_wan

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")

DELAY = [[0, 5, 5, 5], [5, 0, 5, 5], [5, 5, 0, 5], [5, 5, 5, 0]]
RATE = [[0, 100, 100, 100], [100, 0, 100, 100], [100, 100, 0, 100], [100, 100, 100, 0]]
STEPS = 20
CUT_AT = 6  # after the first checkpoint (every 5)
JOB = ["--model", "gpt-tiny", "--agents", "4", "--stages", "2", "--replicas", "2",
       "--steps", str(STEPS), "--batch", "8", "--micro-batches", "2", "--search-seconds", "1",
       "--layer-split", "even", "--checkpoint-every", "5", "--eval-batches", "0",
       "--heartbeat-interval", "0.5", "--max-restarts", "2"]


@pytest.mark.timeout(300)
def test_a_dead_link_between_pipeline_neighbours_is_planned_around(tmp_path: Path) -> None:
    with measurement_wan(DELAY, RATE) as wan:
        cluster = WanCluster(wan, tmp_path, agents=4, coordinator_args=JOB)
        try:
            ids = cluster.start(timeout=90)
            status = wait_for(lambda: (s := cluster.status()) and s["job"]["step"] >= CUT_AT
                              and s, 180, f"step {CUT_AT} (logs in {tmp_path})", 0.5)
            grid = status["plan"]["grid"]
            a, b = grid[0][1], grid[1][1]  # replica 1's pipeline neighbours
            wan.set_link(ids.index(a) + 1, ids.index(b) + 1, cut=True, both_ways=True)
            print(f"\nstep {status['job']['step']}: cut {a} <-> {b} (grid {grid})")
            done = cluster.wait_job(200)
        finally:
            cluster.stop()
    job, plan = done["job"], done["plan"]
    assert job["state"] == "done" and job["step"] == STEPS, (job["message"], tmp_path)
    assert job["recoveries"], job
    assert frozenset((a, b)) not in connected_pairs(plan["grid"]), plan["grid"]
    assert {x for row in plan["grid"] for x in row} == set(ids)  # nobody left out
    log = (tmp_path / "coordinator.log").read_text(errors="replace")
    assert "peer errors blame" in log and "around dead link(s)" in log, log[-3000:]
    print(f"done at epoch {plan['epoch']} on {plan['grid']}; recoveries: "
          f"{[(r['reason'][:80], r['stalled_s']) for r in job['recoveries']]}")
