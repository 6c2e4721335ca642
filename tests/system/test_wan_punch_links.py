"""A pair nobody can dial is measured direct through a hole punch, across emulated hosts.

Agents 1 and 2 sit behind NATs of their own (private, unroutable addresses; only flows they
open come back), 5 ms and 100 Mbit/s from each other; the coordinator's host, where the
relay runs, is 20 ms and 50 Mbit/s from everyone. Neither NATed agent can dial the other, so
before, `coordinator links --measure` priced the pair through the relay: 40 ms, the two
hops. With hole punching on (the default) both agents meet at the coordinator's relay as a
pseudo-job admitted for the probe, punch through both NATs and measure the direct
connection (agent/probing/punchprobe.py, coordinator/links/punchprobe.py): the pair is reported
punched at about its own 5 ms, not relayed. With `--hole-punch off` it is relayed, as
before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dtfm.wan import WanEmulator
from dtfm.wan.cluster import WanCluster, measurement_wan

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")
DELAY = [[0, 10, 10], [10, 0, 5], [10, 5, 0]]
RATE = [[0, 100, 100], [100, 0, 100], [100, 100, 0]]
RELAY_LINK = (20.0, 50.0)


def _figures(links: dict[str, Any], a: str, b: str) -> tuple[float, float]:
    row = {x: i for i, x in enumerate(links["agents"])}
    return links["delay_ms"][row[a]][row[b]], links["bandwidth_gbps"][row[a]][row[b]]


@pytest.mark.timeout(300)
def test_a_nat_pair_is_measured_direct_through_a_hole_punch_and_relayed_without(
        tmp_path: Path) -> None:
    got: dict[str, tuple[list[str], dict[str, Any]]] = {}
    with measurement_wan(DELAY, RATE, nat=[1, 2], coordinator_link=RELAY_LINK) as wan:
        for punch in ("on", "off"):
            cluster = WanCluster(wan, tmp_path / punch, agents=3,
                                 coordinator_args=["--hole-punch", punch])
            try:
                ids = cluster.start(timeout=90, prewarm=False)
                got[punch] = ids, cluster.measure(timeout=120)
            finally:
                cluster.stop()
    ids, links = got["on"]
    _, nat1, nat2 = ids
    pair = sorted([f"{nat1}->{nat2}", f"{nat2}->{nat1}"])
    assert links["unreachable"] == [] and links["excluded"] == [], links
    assert sorted(links["punched"]) == pair and links["relayed"] == [], links
    assert links["estimated"][f"{nat1}->{nat2}"].startswith("punched: measured on a direct")
    for a, b in ((nat1, nat2), (nat2, nat1)):
        delay, gbps = _figures(links, a, b)
        assert 3 < delay < 15, links  # the pair's own 5 ms, not the relay's two 20 ms hops
        assert 0.05 < gbps <= 0.12, links  # its own 100 Mbit/s, not the relay's 50
    log = (tmp_path / "on" / "coordinator.log").read_text(errors="replace")
    assert "1 of 1 pairs nobody can dial punched through both ways" in log, log[-3000:]

    ids, links = got["off"]
    _, nat1, nat2 = ids
    assert links["unreachable"] == [] and links["punched"] == [], links
    assert sorted(links["relayed"]) == sorted([f"{nat1}->{nat2}", f"{nat2}->{nat1}"])
    assert links["estimated"][f"{nat1}->{nat2}"].startswith("relayed via the coordinator")
    assert _figures(links, nat1, nat2)[0] > 30  # both hops to the coordinator: about 40 ms
