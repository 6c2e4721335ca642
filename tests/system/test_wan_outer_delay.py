"""`--outer-delay 1` across emulated hosts, with the stage whose replicas exchange behind NATs.

A 2 x 2 job with local steps (H = 2) and the outer step one round late. Agents 1 and 2 sit
behind NATs of their own; rank-order placement makes them the two replicas of stage 1, so
that stage's pseudo-gradients travel between two NATed hosts on the dtfm transport (punched
through, or relayed), launched at one sync point, moved on by the poll between inner steps
(`GradAverager.progress`, the transport's `is_completed`) and collected at the next. The job
trains to its end, the replicas of every stage hold the same anchor at every sync point, the
first sync point collects nothing and the last flushes two exchanges.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dtfm.wan import WanEmulator
from dtfm.wan.cluster import WanCluster, measurement_wan
from tests.progress import step_events
from tests.system.test_wan_nat_job import DELAY, RATE

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")

STEPS = 8
JOB = ["--model", "gpt-tiny", "--agents", "4", "--stages", "2", "--replicas", "2",
       "--steps", str(STEPS), "--batch", "8", "--micro-batches", "2", "--seed", "5",
       "--search-seconds", "1", "--eval-batches", "0", "--heartbeat-interval", "0.5",
       "--layer-split", "even", "--sync-every", "2", "--outer-delay", "1",
       "--placement", "rank-order", "--checkpoint-every", "0"]


@pytest.mark.timeout(600)
def test_a_delayed_outer_step_between_natted_replicas_trains_with_equal_anchors(
        tmp_path: Path) -> None:
    with measurement_wan(DELAY, RATE, nat=[1, 2], coordinator_link=(20.0, 50.0)) as wan:
        cluster = WanCluster(wan, tmp_path, agents=4, coordinator_args=JOB)
        try:
            ids = cluster.start(timeout=90)
            status = cluster.wait_job(400)
        finally:
            cluster.stop()
    job = status["job"]
    assert job["state"] == "done" and job["step"] == STEPS, job
    assert job["epoch"] == 1 and not job["recoveries"], job
    grid = status["plan"]["grid"]
    assert sorted(grid[1]) == sorted([ids[1], ids[2]]), grid  # the NATed pair: stage 1
    log = (tmp_path / "coordinator.log").read_text(errors="replace")
    assert "dtfm data plane" in log, log[-3000:]
    events = step_events(tmp_path, job["id"], 1)
    assert sorted(events) == [0, 1, 2, 3], sorted(events)
    for stage in (0, 1):  # ranks: replica * stages + stage
        a, b = events[stage], events[2 + stage]
        assert [e.step for e in a] == [e.step for e in b] == list(range(1, STEPS + 1))
        synced = [(x, y) for x, y in zip(a, b, strict=True) if x.step % 2 == 0]
        for x, y in synced:  # the anchors: the same bits on both replicas, across the WAN
            assert x.param_checksum == y.param_checksum, (stage, x.step)
        sent = [x.dp_bytes for x, _ in synced]
        # step 2 only launches; 4 and 6 collect one exchange; 8 collects and flushes one more
        assert sent[0] == 0 and sent[1] > 0 and sent[1] == sent[2], sent
        assert sent[3] == 2 * sent[1], sent
    losses = [e.loss for e in events[1]]
    assert losses[-1] < losses[0], losses
