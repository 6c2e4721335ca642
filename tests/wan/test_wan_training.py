"""A job trains across separate emulated hosts: every agent in its own network namespace,
links with real delay and rate, the coordinator on a host of its own.

Loopback hides what real deployments hit first: a collective backend that binds to whatever
the host name resolves to (127.0.1.1 on Debian) instead of the address peers use. Here each
worker must bind to its agent's advertised address, or the job cannot start.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.wan import WanEmulator
from agent.wan.cluster import WanCluster, measurement_wan

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")

# two "cities" of two agents: 3 ms inside, 40 ms across; 40 / 15 Mbit/s
DELAY = [[0, 3, 40, 40], [3, 0, 40, 40], [40, 40, 0, 3], [40, 40, 3, 0]]
RATE = [[0, 40, 15, 15], [40, 0, 15, 15], [15, 15, 0, 40], [15, 15, 40, 0]]
JOB = ["--model", "gpt-tiny", "--agents", "4", "--stages", "2", "--replicas", "2",
       "--steps", "4", "--batch", "8", "--micro-batches", "2", "--search-seconds", "1"]


@pytest.mark.timeout(420)
def test_a_job_trains_across_emulated_hosts_and_the_plan_keeps_pipelines_in_a_city(
        tmp_path: Path) -> None:
    with measurement_wan(DELAY, RATE) as wan:
        cluster = WanCluster(wan, tmp_path, agents=4)
        ids = cluster.start()
        links = cluster.measure(timeout=120)
        cluster.stop()
        links_path = tmp_path / "links.json"
        links_path.write_text(json.dumps(links))
        got = cluster.train(JOB, "scheduled", links_path, timeout=300)
    city = {ids[0]: 0, ids[1]: 0, ids[2]: 1, ids[3]: 1}
    grid = got["grid"]
    # the slow cross-city links carry only the data-parallel sync: each pipeline in one city
    assert {city[grid[0][k]] for k in range(2)} == {0, 1}
    assert all(city[grid[0][k]] == city[grid[1][k]] for k in range(2)), grid
    assert got["measured_step_s"] > 0 and got["predicted_step_s"] > 0
    assert got["loss"] > 0
    assert got["assignment_to_first_step_s"] is not None
