"""Link measurement with agents behind NATs, across emulated hosts (issue 32).

One agent listens where it advertises; two sit behind NATs of their own (the emulator's kernel
NAT: private, unroutable addresses, only flows they open come back), both believing they are
the same private address. The coordinator's measurement must leave nobody out: links into a
NAT'd agent come from its own probe the other way (it dials out), and the pair of NAT'd agents,
which can dial neither way, is priced through the relay (the coordinator), from each one's
probe of the coordinator. `coordinator links --measure --json` shows which is which.
Hole punching is off here (`--hole-punch off`): with it on, the pair would punch through both
NATs at measurement and be priced direct (tests/system/test_wan_punch_links.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dtfm.wan import WanEmulator
from dtfm.wan.cluster import WanCluster, measurement_wan

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")
DELAY = [[0, 10, 20], [10, 0, 30], [20, 30, 0]]
RATE = [[0, 200, 200], [200, 0, 200], [200, 200, 0]]


def _measure(tmp_path: Path) -> tuple[list[str], dict[str, Any]]:
    with measurement_wan(DELAY, RATE, nat=[1, 2]) as wan:
        assert wan.address(2) == wan.address(3)  # one private address behind both NATs
        cluster = WanCluster(wan, tmp_path, agents=3, coordinator_args=["--hole-punch", "off"])
        try:
            ids = cluster.start(timeout=90, prewarm=False)
            return ids, cluster.measure(timeout=120)
        finally:
            cluster.stop()


@pytest.mark.timeout(300)
def test_links_to_and_between_nat_agents_are_taken_the_other_way_or_relayed(
        tmp_path: Path) -> None:
    ids, links = _measure(tmp_path)
    open_, nat1, nat2 = ids
    assert links["unreachable"] == [] and links["excluded"] == [], links
    notes = links["estimated"]
    for hidden in (nat1, nat2):
        assert notes[f"{open_}->{hidden}"].startswith(
            f"measured the other way ({hidden}->{open_})"), notes
        assert f"{hidden}->{open_}" not in notes  # probed as it is: the NAT'd end dials out
    assert sorted(links["relayed"]) == sorted([f"{nat1}->{nat2}", f"{nat2}->{nat1}"])
    assert notes[f"{nat1}->{nat2}"].startswith("relayed via the coordinator"), notes
    row = {a: i for i, a in enumerate(links["agents"])}
    delay, rate = links["delay_ms"], links["bandwidth_gbps"]
    # the reverse's figures: the emulated 10 ms and 200 Mbit/s, read from the other end
    assert delay[row[open_]][row[nat1]] == delay[row[nat1]][row[open_]]
    assert 5 < delay[row[open_]][row[nat1]] < 25
    assert 0.05 < rate[row[open_]][row[nat1]] <= 0.25
    # the coordinator has free links to everyone: both hops are short, and fast
    assert 0 < delay[row[nat1]][row[nat2]] < 15
    assert rate[row[nat1]][row[nat2]] > 0


@pytest.mark.timeout(300)
def test_links_into_nat_agents_are_measured_the_other_way(tmp_path: Path) -> None:
    ids, links = _measure(tmp_path)
    open_, nat1, nat2 = ids
    notes = links["estimated"]
    for hidden in (nat1, nat2):
        assert notes[f"{open_}->{hidden}"].startswith(
            f"measured the other way ({hidden}->{open_})"), notes
    row = {a: i for i, a in enumerate(links["agents"])}
    assert links["delay_ms"][row[open_]][row[nat2]] == links["delay_ms"][row[nat2]][row[open_]]
    assert links["excluded"] == [] or set(links["excluded"]) <= {nat1, nat2}, links
