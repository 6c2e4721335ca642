"""A 3 x 3 job of nine loopback agents: measured, placed by the scheduled search with the
job's default limit, and trained to its first step.

Nine devices in three sites, three stages of three: the instance on which `coordinator plan`
once searched for minutes (nearly every child of the genetic phase a duplicate, skipped
uncounted); its 280 placements are now enumerated. The job plans on a clustered matrix given
with `--links` (the agents' ids are written into their state directories first), so the
placement is the issue's and does not hang on what nine probing agents measure on one busy
machine. Kept small: gpt-tiny, two steps, no checkpoints or eval.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from tests.coordinator.scheduler.reference import clustered_net
from tests.daemons import Daemons, wait_for

pytestmark = pytest.mark.timeout(300)
AGENTS = 9


def test_nine_agents_in_three_stages_of_three_reach_the_first_step(daemons: Daemons) -> None:
    ids = [f"site{i % 3}-agent-{i}" for i in range(AGENTS)]
    for i, agent_id in enumerate(ids):
        state = daemons.tmp / f"agent-{i}"
        state.mkdir(mode=0o700)
        (state / "agent-id").write_text(agent_id + "\n")
    delay, bw = clustered_net(AGENTS, 3, np.random.default_rng(9))
    links = daemons.tmp / "links.json"
    links.write_text(json.dumps({"agents": ids, "delay_ms": delay.tolist(),
                                 "bandwidth_gbps": bw.tolist()}))
    _, address = daemons.coordinator(
        "--model", "gpt-tiny", "--agents", str(AGENTS), "--stages", "3", "--replicas", "3",
        "--steps", "2", "--batch", "6", "--micro-batches", "2", "--checkpoint-every", "0",
        "--eval-batches", "0", "--links", str(links))  # default restarts: a port may be taken
    for i in range(AGENTS):
        daemons.agent(address, f"agent-{i}")

    def first_step() -> dict[str, Any] | None:
        status = daemons.status(address)
        job = status["job"]
        assert job["state"] != "failed", job["message"]
        return status if job["step"] >= 1 else None

    status = wait_for(first_step, 240, "the 3 x 3 job's first step", interval=1.0)
    plan = status["plan"]
    assert (plan["stages"], plan["replicas"]) == (3, 3)
    assert plan["placement"] == "scheduled" and "hybrid-ga" in plan["algorithm"]
    members = [a for row in plan["grid"] for a in row]
    alive = {a["id"] for a in status["agents"] if a["state"] == "alive"}
    assert sorted(members) == sorted(ids) and set(members) <= alive
