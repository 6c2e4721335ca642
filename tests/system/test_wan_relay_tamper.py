"""Across emulated hosts, a relay agent that flips one bit of a frame it forwards is caught,
named and routed around (issue 43, item 5), on the world of test_wan_relay_agent: three
agents behind NATs of their own, agent 0 reachable from everywhere and serving a relay, which
the coordinator prefers to its own (20 ms and 50 Mbit/s from everyone) for the NATed pairs.
Hole punching is off, so their frames cross the relay.

Agent 0 runs `tests.system.tampering_agent`: its relay flips a bit of the first data frame
it forwards (a seam of the test, not a product flag). The receiving worker refuses the frame
(its pair's MAC fails) and fails its step naming the relay; the coordinator blames agent 0,
not either end, re-plans with every pair at its own relay, and the job trains to the end.
No pair key of the NATed pairs is anywhere the relay agent or a token holder can read.

Its first epoch is test_wan_relay_agent's claim (the NATed pairs meet at the public agent's
relay, which it serves on its gRPC port), asserted here too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtfm.wan import WanEmulator
from dtfm.wan.cluster import AGENT_PORT, WanCluster, measurement_wan
from protos.dtfm.v1 import common_pb2
from tests.system.test_wan_nat_job import DELAY, JOB, RATE, STEPS

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")


def _pair_keys(workdir: Path) -> set[bytes]:
    """The keys of the pairs among the NATed agents 1..3, from their assignment files."""
    found: dict[int, dict[int, common_pb2.Assignment]] = {}  # epoch -> agent -> assignment
    for i in range(4):
        for path in (workdir / f"agent-{i}").rglob("*.assignment.pb"):
            a = common_pb2.Assignment.FromString(path.read_bytes())
            found.setdefault(a.epoch, {})[i] = a
    keys = set()
    for by_agent in found.values():
        ranks = {i: a.rank for i, a in by_agent.items()}
        for i in (1, 2, 3):
            for j in (1, 2, 3):
                if i != j and i in by_agent and j in ranks and by_agent[i].data_plane.pair_keys:
                    keys.add(by_agent[i].data_plane.pair_keys[ranks[j]])
    return keys


@pytest.mark.timeout(600)
def test_a_relay_agent_that_flips_a_bit_is_named_and_routed_around(tmp_path: Path) -> None:
    with measurement_wan(DELAY, RATE, nat=[1, 2, 3], coordinator_link=(20.0, 50.0)) as wan:
        cluster = WanCluster(wan, tmp_path, agents=4,
                             coordinator_args=[*JOB, "--hole-punch", "off"],
                             agent_args=["--relay"],
                             agent_modules={0: "tests.system.tampering_agent"})
        ids, status = cluster.run_to_end(400)
    job = status["job"]
    log = (tmp_path / "coordinator.log").read_text(errors="replace")
    relay_log = (tmp_path / "agent-0.log").read_text(errors="replace")
    assert "tampering relay: flipped a bit" in relay_log, relay_log[-3000:]
    assert job["state"] == "done" and job["step"] == STEPS, (job, log[-4000:])
    relay = f"{wan.address(1)}:{AGENT_PORT}"
    blamed = f"relay tampered: relay agent {ids[0]} at {relay} altered"
    assert blamed in log, log[-4000:]
    assert log.count("relay tampered:") == 1, log[-4000:]  # nobody else is blamed
    assert "frames mac" in log, log[-4000:]
    agents = {a["id"]: a for a in status["agents"]}
    assert agents[ids[0]]["relay_distrusted"].startswith(f"relay agent {ids[0]} at {relay}")
    assert not any(agents[i]["relay_distrusted"] for i in ids[1:])
    # the first epoch met at agent 0's relay; the one after the refusal at the coordinator's
    epochs = [line for line in log.splitlines() if "dial-only pairs meet at relay agents" in line]
    assert len(epochs) == 1 and relay in epochs[0], epochs
    assert "relay: circuit between ranks" in relay_log, relay_log[-3000:]
    for i in (1, 2, 3):  # they offered relays too, but nobody can dial them
        assert "relaying for ranks" not in (tmp_path / f"agent-{i}.log").read_text()
    assert "relay: circuit between ranks" in log, log[-4000:]  # the coordinator's relay
    keys = _pair_keys(tmp_path)
    assert keys, "the NATed agents' assignments hold their pair keys"
    readable = [("the coordinator's log", log.encode()),
                ("the status", json.dumps(status).encode())]
    readable += [(f"agent 0's {p.name}", p.read_bytes())
                 for p in (tmp_path / "agent-0").rglob("*") if p.is_file()]
    readable.append(("agent 0's log", relay_log.encode()))
    leaks = [where for where, raw in readable for k in keys if k in raw or k.hex().encode() in raw]
    assert not leaks, leaks
