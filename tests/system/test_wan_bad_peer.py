"""Across emulated hosts, a volunteer behind a NAT that scales its gradients by 10 is caught,
excluded, and what it touched rolled back (issue 43), with two replicas per stage (R = 2).

Four agents on four hosts (5-10 ms, 100 Mbit/s), agent 3 behind a NAT of its own, running
`tests.system.bad_agent` (its workers scale every gradient shard they send by 10 from their
10th step; from outside the product). The evidence rides the heartbeats from behind the NAT;
the coordinator settles the R = 2 disagreement by re-planning the pair apart
(coordinator/integrity/dispute.py), which moves agents to the other stage: they fetch its
checkpoint across the WAN from below the rollback's bound. The bad agent disagrees with its
new partner too, is excluded, and the job finishes on the three honest agents from the newest
checkpoint before the first step proven bad. It also checks what loopback hides: evidence
and checkpoints crossing hosts, one of them behind a NAT (R >= 3 on loopback:
tests/system/test_bad_peer_excluded.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from coordinator.integrity.rollback import newest_before
from dtfm.wan import WanEmulator
from dtfm.wan.cluster import WanCluster, measurement_wan
from tests.system.test_wan_nat_job import DELAY, RATE

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")

STEPS = 40  # the second dispute must come on steps the first did not judge
JOB = ["--model", "gpt-tiny", "--agents", "4", "--min-agents", "2", "--stages", "2",
       "--replicas", "2", "--steps", str(STEPS), "--batch", "8", "--micro-batches", "1",
       "--seed", "5", "--search-seconds", "1", "--eval-batches", "0", "--checkpoint-every", "4",
       "--heartbeat-interval", "0.5", "--dp-mode", "sharded", "--verify", "full"]


@pytest.mark.timeout(500)
def test_a_bad_volunteer_behind_a_nat_is_disputed_parted_and_excluded(tmp_path: Path) -> None:
    with measurement_wan(DELAY, RATE, nat=[3]) as wan:
        cluster = WanCluster(wan, tmp_path, agents=4, coordinator_args=JOB,
                             agent_modules={3: "tests.system.bad_agent"})
        ids, status = cluster.run_to_end(400)
    bad = ids[3]
    job = status["job"]
    rows = {a["id"]: a for a in status["agents"]}
    log = (tmp_path / "coordinator.log").read_text(errors="replace")
    assert job["state"] == "done" and job["step"] == STEPS, (job, log[-3000:])
    assert [a for a, r in rows.items() if r["state"] == "excluded"] == [bad], rows
    exclusion = rows[bad]["exclusion"]
    assert "common to two disagreements" in exclusion["reason"], exclusion
    first, second = job["recoveries"][:2]
    assert "apart" in first["reason"] and bad in first["reason"], first
    bound = int(re.search(r"rolling back before step (\d+)", first["reason"]).group(1))
    assert first["resumed_step"] == newest_before(bound, 4) > 0, first
    assert bad in second["reason"] and "excluded" in second["reason"], second
    assert second["resumed_step"] == newest_before(exclusion["step"], 4), (second, exclusion)
    assert bad not in {a for row in status["plan"]["grid"] for a in row}
    # the agents moved to the other stage fetched its checkpoint across the WAN
    fetched = "".join((tmp_path / f"agent-{i}.log").read_text(errors="replace")
                      for i in range(3))
    assert re.search(r"checkpoint: stage \d .*fetching steps", fetched), fetched[-3000:]
