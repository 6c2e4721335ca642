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

from dtfm.core.layout import layer_ranges
from dtfm.core.presets import get_preset
from dtfm.wan import WanEmulator
from dtfm.wan.cluster import WanCluster, measurement_wan

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")

# two "cities" of two agents, interleaved in address order (hosts 0, 2 in one, 1, 3 in the
# other): 3 ms and 40 Mbit/s inside a city, 40 ms and 15 Mbit/s across. gpt-tiny's gradients
# (0.48 MB a stage) outweigh its activations (66 KB a replica), so the cost model keeps each
# data-parallel group inside a city (0.25 s) and rank order splits them (0.37 s).
DELAY = [[0, 40, 3, 40], [40, 0, 40, 3], [3, 40, 0, 40], [40, 3, 40, 0]]
RATE = [[0, 15, 40, 15], [15, 0, 15, 40], [40, 15, 0, 15], [15, 40, 15, 0]]
JOB = ["--model", "gpt-tiny", "--agents", "4", "--stages", "2", "--replicas", "2",
       "--steps", "4", "--batch", "8", "--micro-batches", "2", "--search-seconds", "1",
       "--layer-split", "even"]


@pytest.mark.timeout(420)
def test_a_job_trains_across_emulated_hosts_with_each_dp_group_in_one_city(
        tmp_path: Path) -> None:
    with measurement_wan(DELAY, RATE) as wan:
        cluster = WanCluster(wan, tmp_path, agents=4)
        ids = cluster.start(prewarm=False)  # measuring only
        links = cluster.measure(timeout=120)
        cluster.stop()
        links_path = tmp_path / "links.json"
        links_path.write_text(json.dumps(links))
        got = cluster.train(JOB, "scheduled", links_path, timeout=300)
    city = {ids[0]: 0, ids[1]: 1, ids[2]: 0, ids[3]: 1}
    assert [{city[a] for a in row} for row in got["grid"]] in ([{0}, {1}], [{1}, {0}]), got
    assert got["cost"] < 0.3
    assert got["measured_step_s"] > 0 and got["predicted_step_s"] > 0
    assert got["loss"] > 0
    assert got["assignment_to_first_step_s"] is not None
    # the workers' own counters, as the coordinator reports them: in a group of two, each rank
    # sends the shards it does not own and the averages of the one it owns, its whole fp32
    # gradient: 2 x 4 bytes per parameter, summed over the stages
    params = sum(get_preset("gpt-tiny").stage_params(b, e) for b, e in layer_ranges(4, 2))
    assert got["dp_bytes_per_step"] == pytest.approx(2 * 4 * params, rel=1e-3)
    assert got["pp_bytes_per_step"] > 0


# three agents, one data-parallel group: 0 and 1 are 60 ms apart, 2 is 8 ms from both. A shard
# owned by 0 or 1 crosses 60 ms twice, one owned by 2 crosses 8 ms twice, so the coordinator
# gives agent 2 the largest share of every bucket and the shards cross the hosts unevenly.
SHARE_DELAY = [[0, 60, 8], [60, 0, 8], [8, 8, 0]]
SHARE_RATE = [[0, 20, 20], [20, 0, 20], [20, 20, 0]]
SHARE_JOB = ["--model", "gpt-tiny", "--agents", "3", "--stages", "1", "--replicas", "3",
             "--steps", "3", "--batch", "6", "--micro-batches", "2", "--search-seconds", "1"]


@pytest.mark.timeout(420)
def test_uneven_data_parallel_shares_train_across_emulated_hosts(tmp_path: Path) -> None:
    with measurement_wan(SHARE_DELAY, SHARE_RATE) as wan:
        cluster = WanCluster(wan, tmp_path, agents=3)
        ids = cluster.start(prewarm=False)  # measuring only
        links = cluster.measure(timeout=120)
        cluster.stop()
        links_path = tmp_path / "links.json"
        links_path.write_text(json.dumps(links))
        got = cluster.train(SHARE_JOB, "rank-order", links_path, timeout=300, prewarm=False)
    (row,), (shares,) = got["grid"], got["dp_shares"]
    owner = dict(zip(row, shares, strict=True))
    assert sum(shares) == pytest.approx(1.0)
    assert owner[ids[2]] > max(owner[ids[0]], owner[ids[1]]) + 0.1, owner
    assert got["loss"] > 0 and got["measured_step_s"] > 0
