"""`--pipeline-delay 1` across emulated hosts, two of them behind NATs of their own.

A 2 x 2 job, 1F1B, local steps (H = 4, the outer step one round late) whose pipelines do not
flush between the steps of a round: each rank posts the next step's receives a step ahead,
sends its squared norm as its gradients complete and reads the table a step later, on the
dtfm transport (punched through, or relayed, between the NATed hosts). The job trains to its
end with the same losses as the same job on one machine's loopback (`agent local`: the rule
itself is pinned there, tests/agent/worker/test_delayed.py), and the status says what the
plan runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dtfm.wan import WanEmulator
from dtfm.wan.cluster import WanCluster, measurement_wan
from tests.agent.worker.testlib import assert_close, run_local
from tests.progress import step_events
from tests.system.test_wan_nat_job import DELAY, RATE
from tests.system.test_wan_outer_delay import JOB as OUTER_JOB

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")

STEPS = 8
# the delayed-outer-step job (same NATed stage, same seed), at H = 4 with 1F1B and no flushes
JOB = [*OUTER_JOB[:OUTER_JOB.index("--sync-every")], "--sync-every", "4", "--outer-delay", "1",
       "--placement", "rank-order", "--checkpoint-every", "0", "--schedule", "1f1b",
       "--pipeline-delay", "1", "--warmup-steps", "1"]  # the warm-up's steps flush
COORDINATOR_ONLY = ("--agents", "--search-seconds", "--heartbeat-interval", "--layer-split",
                    "--placement")


@pytest.mark.timeout(600)
def test_steps_that_do_not_flush_train_across_natted_hosts_as_on_loopback(
        tmp_path: Path) -> None:
    with measurement_wan(DELAY, RATE, nat=[1, 2], coordinator_link=(20.0, 50.0)) as wan:
        _, status = WanCluster(wan, tmp_path, agents=4, coordinator_args=JOB).run_to_end(400)
    job = status["job"]
    assert job["state"] == "done" and job["step"] == STEPS, job
    assert job["epoch"] == 1 and not job["recoveries"], job
    assert status["plan"]["pipeline_delay"] == 1, status["plan"]
    events = step_events(tmp_path, job["id"], 1)
    assert sorted(events) == [0, 1, 2, 3], sorted(events)
    for rank, evs in events.items():
        assert [e.step for e in evs] == list(range(1, STEPS + 1)), rank
    local = run_local(*[x for i, f in enumerate(JOB[::2]) if f not in COORDINATOR_ONLY
                        for x in JOB[2 * i:2 * i + 2]], "--timeout", "120")
    assert local.rc == 0, local.stderr
    assert_close([e.loss for e in events[1]], local.losses, 1e-5)
