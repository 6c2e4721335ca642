"""A direct path that breaks for good mid-epoch moves its pair to the relay, and the epoch
trains to the end (issue 40: "a pair whose direct path fails at run time moves to the relay
for the rest of the epoch, both ends agreed, and says so").

Agent 1 sits behind a NAT and dials agent 0 for their pipeline pair (2 stages x 1 replica);
the coordinator's relay, on host 0, reaches both. Once training runs, the emulated link
between the two agents' hosts is cut both ways (a route gone, a firewall rule that drops):
every packet is dropped, nothing answers with a reset. Each end finds the connection dead
when its data or its keepalive probes go unanswered for `sockio.UNACKED_S`; the dialer's
new direct connections fail, the listener's wait for one ends after `resume.FALLBACK_S`, and
both move the pair to the relay, where they resume. The waits of the step in flight sit the
move out (`work.TransportWork`) instead of failing it. Before, the pair failed and the
coordinator rolled the job back to its last checkpoint.
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
STEPS, CUT_AT = 60, 5
JOB = ["--model", "gpt-tiny", "--agents", "2", "--stages", "2", "--replicas", "1",
       "--steps", str(STEPS), "--batch", "8", "--micro-batches", "2", "--seed", "3",
       "--search-seconds", "1", "--no-measure", "--eval-batches", "0",
       "--heartbeat-interval", "0.5", "--layer-split", "even", "--placement", "rank-order"]


@pytest.mark.timeout(400)
def test_a_direct_path_cut_mid_epoch_moves_the_pair_to_the_relay(tmp_path: Path) -> None:
    with measurement_wan(DELAY, RATE, nat=[1]) as wan:
        cluster = WanCluster(wan, tmp_path, agents=2, coordinator_args=JOB)
        cut: list[int] = []

        def cut_once(status: dict[str, Any]) -> None:
            job = status.get("job", {})
            if not cut and job.get("state") == "running" and job.get("step", 0) >= CUT_AT:
                wan.live.set_link(1, 2, cut=True, both_ways=True)  # agent 0 <-> agent 1
                cut.append(job["step"])

        try:
            cluster.start(timeout=90)
            status = cluster.wait_job(300, on_status=cut_once)
        finally:
            cluster.stop()
    job = status["job"]
    assert cut, "the job never reached the step to cut at"
    assert job["state"] == "done" and job["step"] == STEPS, job
    assert job["recoveries"] == [], job["recoveries"]  # the same epoch trained to the end
    assert job["epoch"] == 1, job
    workers = {i: "".join(p.read_text(errors="replace")
                          for p in tmp_path.glob(f"agent-{i}/work/*.log")) for i in (0, 1)}
    for i in (0, 1):
        assert "the pair moves to the relay" in workers[i], workers[i][-3000:]
        assert "resumed the connection with rank" in workers[i], workers[i][-3000:]
