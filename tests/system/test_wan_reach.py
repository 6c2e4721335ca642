"""Reachability across emulated hosts (issue 32): the dial-back crosses the WAN.

Host 0 holds the coordinator, host 1 an agent that listens where it advertises, host 2 an
agent that advertises host 3's address (nothing listens there: the simplest "peers cannot dial
it" until the emulator has NAT hosts). The coordinator and the other agent dial each one back
across the emulated links: host 1's agent is reachable from everywhere, host 2's from nowhere.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dtfm.procs import wait_for
from dtfm.wan import WanEmulator
from dtfm.wan.cluster import AGENT_PORT, WanCluster

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")

DELAY = [[0, 10, 10, 10], [10, 0, 20, 20], [10, 20, 0, 20], [10, 20, 20, 0]]


def _verdicts(cluster: WanCluster) -> dict[str, dict[str, Any]] | None:
    status = cluster.status()
    if status is None:
        return None
    agents = status["agents"]
    rows = {a["address"]: a for a in agents if a["state"] == "alive"}
    if len(rows) < 2 or any(len(a["reach"]["dials"]) < 2 for a in rows.values()):
        return None
    return rows


@pytest.mark.timeout(120)
def test_an_agent_advertising_an_address_not_its_own_is_reachable_from_nowhere(
        tmp_path: Path) -> None:
    with WanEmulator(delay_ms=DELAY) as wan:
        cluster = WanCluster(wan, tmp_path, agents=1)
        try:
            cluster.start(timeout=60)
            with open(tmp_path / "hidden.log", "wb") as log:
                wan.popen(2, [sys.executable, "-m", "agent", "start", "--coordinator",
                              cluster.coordinator_address, "--listen",
                              f"{wan.address(2)}:{AGENT_PORT}", "--advertise", wan.address(3),
                              "--device", "cpu", "--no-prewarm", "--state-dir",
                              str(tmp_path / "hidden")],
                          stdout=log, stderr=subprocess.STDOUT, env=cluster.env())
            rows = wait_for(lambda: _verdicts(cluster), 60, f"two verdicts (logs in {tmp_path})",
                            0.5)
        finally:
            cluster.stop()
    open_, hidden = rows[f"{wan.address(1)}:{AGENT_PORT}"], rows[f"{wan.address(3)}:{AGENT_PORT}"]
    assert open_["reach"]["verdict"] == "everywhere", open_["reach"]
    assert hidden["reach"]["verdict"] == "nowhere", hidden["reach"]
    assert {d["dialer"] for d in hidden["reach"]["dials"]} == {"coordinator", open_["id"]}
    assert {d["dialer"] for d in open_["reach"]["dials"]} == {"coordinator", hidden["id"]}
    log = (tmp_path / "hidden.log").read_text(errors="replace")
    assert f"not reachable: peers cannot dial {wan.address(3)}:{AGENT_PORT}" in log, log[-2000:]
