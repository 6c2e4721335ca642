"""A data port another agent answers at is refused at join, across emulated hosts (issue 41).

Host 0 holds the coordinator, host 1 an honest agent on the usual port and a second agent
that advertises that same port as its data port (tests/system/lying_agent.py: a test seam),
host 2 a peer. The coordinator dials the liar's data address across the emulated links, the
honest agent answers there by its own id, and the liar's port is refused: its status line
and its own log say whose port it is. The liar is still reachable (its gRPC port is its
own), so only the false port is refused, and the honest agent keeps its own.
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

DELAY = [[0, 20, 20], [20, 0, 30], [20, 30, 0]]
LIAR_PORT = AGENT_PORT + 1


def _rows(cluster: WanCluster) -> dict[str, dict[str, Any]] | None:
    status = cluster.status()  # None while the coordinator does not answer
    rows = {a["address"]: a for a in status["agents"] if a["state"] == "alive"} if status else {}
    liar = rows.get(f"{cluster.wan.address(1)}:{LIAR_PORT}")
    # the refusal shows while the gRPC port's own check still runs ("checking whether peers
    # can dial", verdict unknown): wait for both
    settled = liar is not None and liar["reach"]["verdict"] != "unknown"
    return rows if settled and "is not used" in liar["reach"]["summary"] else None


@pytest.mark.timeout(120)
def test_a_data_port_held_by_another_agent_is_refused_across_the_wan(tmp_path: Path) -> None:
    with WanEmulator(delay_ms=DELAY) as wan:
        cluster = WanCluster(wan, tmp_path, agents=2, agent_args=["--no-prewarm"])
        try:
            honest, _ = cluster.start(timeout=60)
            with open(tmp_path / "liar.log", "wb") as log:
                cluster.procs.append(wan.popen(1, [
                    sys.executable, "-m", "tests.system.lying_agent", str(AGENT_PORT), "start",
                    "--coordinator", cluster.coordinator_address, "--listen",
                    f"{wan.address(1)}:{LIAR_PORT}", "--device", "cpu", "--no-prewarm",
                    "--state-dir", str(tmp_path / "liar")],
                    stdout=log, stderr=subprocess.STDOUT, env=cluster.env()))
            rows = wait_for(lambda: _rows(cluster), 60,
                            f"the liar's data port refused (logs in {tmp_path})", 0.5)
            liar_id = (tmp_path / "liar" / "agent-id").read_text().strip()
            refusal = (f"agent {liar_id}'s data port {AGENT_PORT} is not used: "
                       f"{wan.address(1)}:{AGENT_PORT} is agent {honest}'s")
            wait_for(lambda: refusal in (tmp_path / "liar.log").read_text(errors="replace"),
                     30, "the liar's own log to say so")
        finally:
            cluster.stop()
    liar = rows[f"{wan.address(1)}:{LIAR_PORT}"]
    assert refusal in liar["reach"]["summary"], liar["reach"]
    assert liar["reach"]["verdict"] == "everywhere", liar["reach"]  # its gRPC port is its own
    assert "is not used" not in rows[f"{wan.address(1)}:{AGENT_PORT}"]["reach"]["summary"]
    log = (tmp_path / "coordinator.log").read_text(errors="replace")
    assert refusal in log, log[-3000:]
