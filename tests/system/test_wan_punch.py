"""Hole punching across emulated hosts (issue 32): four ranks that listen nowhere meet at a
relay on host 0 and punch direct connections through what stands in front of them: agent 0
behind a stateful firewall (public address, inbound dropped), agents 1 and 2 behind one NAT
(a site: the pair punches by hairpinning through the NAT's public address), agent 3 behind a
NAT of its own. Every pair gets through (the emulator's NATs map endpoint-independently, as
most home routers do) and every message arrives. Whether a pair then leaves the relay is
weighed on the spot (dtfm/net/pathweigh.py): with the relay's host 40 ms and
20 Mbit/s from everyone, every pair goes direct (10 ms, 100 Mbit/s) and the relay forwards
nothing of the messages; with the relay's host free of cost (the emulator's default for the
coordinator), every pair got through yet stays on the relay, which is the faster path.
The real processes run the worker's own mesh (agent/worker/transport/mesh.py) and the relay
(`python -m dtfm.relay`)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from dtfm.procs import terminate_all
from dtfm.wan import WanEmulator
from dtfm.wan.cluster import measurement_wan

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")

REPO = Path(__file__).resolve().parents[2]
WORLD = 4
DELAY = [[0 if i == j else 10 for j in range(WORLD)] for i in range(WORLD)]
RATE = [[0 if i == j else 100 for j in range(WORLD)] for i in range(WORLD)]
RELAY_PORT = 7400


@pytest.mark.timeout(180)
@pytest.mark.parametrize("relay_link, direct", [((40.0, 20.0), True), ((0.0, None), False)],
                         ids=["relay-far", "relay-free"])
def test_ranks_behind_a_firewall_one_site_and_a_nat_punch_through_to_each_other(
        tmp_path: Path, relay_link: tuple[float, float | None], direct: bool) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"punch-secret")
    with measurement_wan(DELAY, RATE, firewall=[0], shared_nat=[[1, 2]], nat=[3],
                         coordinator_link=relay_link) as wan:
        sites = wan.sites
        assert sites.reachability(1) == "firewall" and sites.nat_site(2) == sites.nat_site(3)
        relay_log = open(tmp_path / "relay.log", "w")
        relay = wan.popen(0, [sys.executable, "-m", "dtfm.net.relay", "--port", str(RELAY_PORT),
                              "--secret-file", str(secret)], cwd=REPO, stdout=relay_log,
                          stderr=relay_log)
        ranks = []
        try:
            for r in range(WORLD):
                log = open(tmp_path / f"rank{r}.log", "w")
                ranks.append(wan.popen(r + 1, [
                    sys.executable, "-m", "tests.system.punch_rank", str(r), str(WORLD),
                    f"{wan.address(0)}:{RELAY_PORT}", str(secret), str(tmp_path / f"{r}.json")],
                    cwd=REPO, stdout=log, stderr=log))
            codes = [p.wait(150) for p in ranks]
        finally:
            terminate_all([*ranks, relay], group=False)
    logs = {r: (tmp_path / f"rank{r}.log").read_text(errors="replace") for r in range(WORLD)}
    assert codes == [0] * WORLD, logs
    for r in range(WORLD):
        got = json.loads((tmp_path / f"{r}.json").read_text())
        assert got["received"] == {str(p): [float(p)] for p in range(WORLD) if p != r}, got
        # every pair got through; it left the relay where direct was the faster path
        through = re.findall(r"(?:hole punched|got through) to rank (\d+)", logs[r])
        assert sorted(map(int, through)) == [p for p in range(WORLD) if p != r], logs[r]
        assert got["punched"] == ([p for p in range(WORLD) if p != r] if direct else []), \
            (got, logs[r])
    relay_text = (tmp_path / "relay.log").read_text(errors="replace")
    assert relay_text.count("relay: circuit between ranks") == WORLD * (WORLD - 1) // 2, \
        relay_text
