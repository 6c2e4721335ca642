"""A pair whose direct path fails twice trains over the relay (issue 40: "each recovery
rescheduled the same placement and the same paths"), with real processes on loopback.

Two agents, one pipeline of two stages, every port open: the job runs on gloo. The fault seam
(`DTFM_FAULT=1:1:direct`, agent/worker/fault.py) fails rank 1 with its peer error ("receive
from rank 0 failed") before step 1 wherever its path to rank 0 is direct, and lets it train
where the pair meets at a relay. The first failure is noted; the second relays the pair (the
coordinator writes one dtfm peer table for both, the pair at its relay); that epoch trains to
the end. Without the recovery's memory the job reschedules the same gloo world until its
restarts run out.
"""

from __future__ import annotations

import pytest

from tests.daemons import Daemons, wait_for

pytestmark = pytest.mark.timeout(600)

JOB = ["--model", "gpt-tiny", "--agents", "2", "--stages", "2", "--replicas", "1",
       "--steps", "3", "--batch", "4", "--micro-batches", "2", "--seed", "3",
       "--search-seconds", "1", "--no-measure", "--eval-batches", "0",
       "--layer-split", "even", "--max-restarts", "3"]


def test_a_pair_whose_direct_path_fails_twice_trains_over_the_relay(daemons: Daemons) -> None:
    coordinator, address = daemons.coordinator(*JOB)
    env = daemons.env(DTFM_FAULT="1:1:direct")
    for i in range(2):
        daemons.agent(address, f"pair-{i}", env=env)

    def ended() -> dict | None:
        job = daemons.status(address)["job"]
        return job if job["state"] in ("done", "failed") else None

    job = wait_for(ended, 500, "the job to end", interval=0.5)
    log = daemons.log(coordinator)
    assert job["state"] == "done", (job["message"], log[-4000:])
    assert job["epoch"] == 3, job  # noted, relayed, trained
    assert "failed 2 times on the direct path; relaying it" in log, log[-4000:]
    assert "whatever their verdicts (their direct path failed twice)" in log, log[-4000:]
    assert "relay: circuit between ranks" in log, log[-4000:]
