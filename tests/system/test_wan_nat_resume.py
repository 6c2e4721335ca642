"""A NAT that forgets its mappings mid-epoch does not end the epoch (issue 40): the pipeline's
connection through it is made again and resumed, and the job trains to the end without a
recovery.

Agent 0 is public; agent 1 sits behind a NAT and dials agent 0 for their pipeline pair (2
stages x 1 replica, rank order). Once training runs, the emulated NAT drops every mapping, as
a home router that reboots or a carrier NAT short of table does. Agent 1's next packet (a
frame, or a keepalive probe once its receive has waited 10 s: `sockio.keep_alive`) leaves
from a new public port; agent 0 knows only the old one and answers with a reset, and agent
0's own frames to the old port die at the NAT. Agent 1's worker dials again; agent 0's takes
the new connection in place of the old; the two exchange frame counts and each resends what
the other had not read (`agent/worker/transport/resume.py`). Before, the reset failed the
pair and the coordinator rolled the job back to its last checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dtfm.wan import WanEmulator
from dtfm.wan.cluster import WanCluster, measurement_wan

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")

DELAY = [[0, 10], [10, 0]]
RATE = [[0, 100], [100, 0]]
STEPS, FORGET_AT = 150, 5  # enough steps after the forget even where a step takes 10 ms
JOB = ["--model", "gpt-tiny", "--agents", "2", "--stages", "2", "--replicas", "1",
       "--steps", str(STEPS), "--batch", "8", "--micro-batches", "2", "--seed", "3",
       "--search-seconds", "1", "--no-measure", "--eval-batches", "0",
       "--heartbeat-interval", "0.5", "--layer-split", "even", "--placement", "rank-order"]


@pytest.mark.timeout(400)
def test_a_nat_that_forgets_its_mappings_mid_epoch_costs_no_recovery(tmp_path: Path) -> None:
    with measurement_wan(DELAY, RATE, nat=[1]) as wan:
        cluster = WanCluster(wan, tmp_path, agents=2, coordinator_args=JOB)
        forgot: list[int] = []

        def forget_once(status: dict[str, Any]) -> None:
            job = status.get("job", {})
            if not forgot and job.get("state") == "running" and job.get("step", 0) >= FORGET_AT:
                forgot.append(wan.forget_nat())

        try:
            cluster.start(timeout=90)
            status = cluster.wait_job(300, on_status=forget_once)
        finally:
            cluster.stop()
    job = status["job"]
    assert forgot and forgot[0] >= 1, forgot  # the data-plane flow's mapping, at least
    assert job["state"] == "done" and job["step"] == STEPS, job
    assert job["recoveries"] == [], job["recoveries"]  # the same epoch trained to the end
    assert job["epoch"] == 1, job
    workers = {i: "".join(p.read_text(errors="replace")
                          for p in tmp_path.glob(f"agent-{i}/work/*.log")) for i in (0, 1)}
    assert "dialling again" in workers[1], workers[1][-3000:]
    assert "connected again" in workers[0], workers[0][-3000:]  # the new one replaced the old
