"""A worker that scales the activations it sends, caught from both ends of its link across
emulated hosts (issue 43, item 3): the figures travel in heartbeats from six machines over
links of 5-20 ms, the coordinator judges each link from its two ends against the other
pipelines', excludes the sender, rolls back before the attack and finishes the job without
it. Loopback (tests/system/test_bad_activations.py) shares one clock and one address; here
every report crosses the emulated WAN, as a volunteer's does.

The fault is the product's rehearsal seam (`DTFM_FAULT`, epoch 1 only: rank 0, stage 0 of
replica 0, sends x10 activations from step 8); the held-out attack is the loopback test's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from coordinator.integrity.rollback import newest_before
from dtfm.wan import WanEmulator
from dtfm.wan.cluster import WanCluster, measurement_wan

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")

# two sites of three hosts: 5 ms inside, 20 ms across, 100 Mbit/s
DELAY = [[0 if i == j else 5 if i // 3 == j // 3 else 20 for j in range(6)] for i in range(6)]
RATE = [[0 if i == j else 100 for j in range(6)] for i in range(6)]
ATTACK_AT, STEPS = 8, 30
JOB = ["--model", "gpt-tiny", "--agents", "6", "--min-agents", "2", "--stages", "2",
       "--replicas", "3", "--batch", "6", "--micro-batches", "1", "--steps", str(STEPS),
       "--seed", "3", "--checkpoint-every", "4", "--search-seconds", "1", "--no-measure",
       "--eval-batches", "0", "--heartbeat-interval", "0.5", "--layer-split", "even",
       "--dp-mode", "sharded", "--verify", "full"]


class _BadCluster(WanCluster):
    """Every agent passes the seam on; only the worker given rank 0 in epoch 1 acts on it."""

    def env(self) -> dict[str, str]:
        return {**super().env(), "DTFM_FAULT": f"0:{ATTACK_AT}:act_scale:1"}


@pytest.mark.timeout(600)
def test_scaled_activations_across_hosts_exclude_their_sender_alone(tmp_path: Path) -> None:
    with measurement_wan(DELAY, RATE) as wan:
        cluster = _BadCluster(wan, tmp_path, agents=6, coordinator_args=JOB)
        ids, status = cluster.run_to_end(400)
    job = status["job"]
    assert job["state"] == "done" and job["step"] == STEPS, job
    ranked = [i for i in range(6) if re.search(
        r"epoch 1 rank 0 stage 0 ", (tmp_path / f"agent-{i}.log").read_text(errors="replace"))]
    assert len(ranked) == 1, ranked
    bad = ids[ranked[0]]
    rows = {a["id"]: a for a in status["agents"]}
    excluded = [a for a, r in rows.items() if r["state"] == "excluded"]
    assert excluded == [bad], {a: (r["state"], r.get("exclusion")) for a, r in rows.items()}
    exclusion = rows[bad]["exclusion"]
    assert exclusion["reason"].startswith("act_scaled"), exclusion
    assert ATTACK_AT - 4 <= exclusion["step"] <= ATTACK_AT + 10, exclusion
    first = job["recoveries"][0]
    assert first["resumed_step"] == newest_before(exclusion["step"], 4), (first, exclusion)
    # both ends of the link said what crossed it: the finding says so, and names the
    # receiver that agreed
    assert "both ends agreeing" in str(rows[bad].get("evidence", [])), rows[bad]
