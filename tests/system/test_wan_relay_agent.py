"""Across emulated hosts, three agents behind NATs of their own meet at a relay agent, not
the coordinator (issue 32: relays on agents): the coordinator serves no relay
(`--relay-port 0`), every agent offers one on its one port (`--relay`: the relay shares
the agent's gRPC port, dtfm/net/front.py), and only agent 0, found
reachable from everywhere, is used. In a 2 x 2 job any three ranks hold a pair that talks,
so the NATed agents' circuits open at agent 0's relay, dialled at its advertised address
from behind their NATs."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtfm.wan import WanEmulator
from dtfm.wan.cluster import AGENT_PORT, WanCluster, measurement_wan
from tests.system.test_wan_nat_job import DELAY, JOB, RATE, STEPS

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")


@pytest.mark.timeout(600)
def test_three_natted_agents_meet_at_the_public_agents_relay(tmp_path: Path) -> None:
    with measurement_wan(DELAY, RATE, nat=[1, 2, 3]) as wan:
        cluster = WanCluster(wan, tmp_path, agents=4,
                             coordinator_args=[*JOB, "--relay-port", "0"],
                             agent_args=["--relay"])
        ids, status = cluster.run_to_end(400)
    job = status["job"]
    assert job["state"] == "done" and job["step"] == STEPS, job
    verdicts = {a["id"]: a["reach"]["verdict"] for a in status["agents"]}
    assert verdicts[ids[0]] == "everywhere", verdicts
    log = (tmp_path / "coordinator.log").read_text(errors="replace")
    assert "dial-only pairs meet at relay agents" in log, log[-3000:]
    assert f"{wan.address(1)}:{AGENT_PORT}" in log, log[-3000:]  # its gRPC port
    relay_log = (tmp_path / "agent-0.log").read_text(errors="replace")
    assert "relay: circuit between ranks" in relay_log, relay_log[-3000:]
    for i in (1, 2, 3):  # they offered relays too, but nobody can dial them
        assert "relaying for ranks" not in (tmp_path / f"agent-{i}.log").read_text()
