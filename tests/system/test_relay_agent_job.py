"""Two agents nobody can dial meet at a relay agent's relay, not the coordinator's (issue 32:
relays on agents, chosen per pair), with real processes on loopback: three of four agents
start `--reachable no`, the fourth serves a relay (`agent start --relay-port`), and the
coordinator serves none (`--relay-port 0`), so every pair of dial-only ranks that talks
(in a 2 x 2 job any three ranks hold a pipeline or a data-parallel pair) must go through the
agent. The losses equal the same job's on gloo with every agent reachable, bit for bit.

The relay agent keeps the separate-port mode an operator may choose: its relay and its
worker's data plane on ports of their own (`--relay-port`, `--data-port`), not on its gRPC
port (the default, dtfm/net/front.py; test_wan_relay_agent.py runs that one)."""

from __future__ import annotations

import pytest

from dtfm.procs import wait_for
from dtfm.rpc import free_port
from tests.daemons import Daemons
from tests.progress import step_losses
from tests.system.test_relayed_job import STEPS, train_job

pytestmark = pytest.mark.timeout(600)


def test_dial_only_agents_meet_at_a_relay_agent_to_gloos_losses(daemons: Daemons) -> None:
    gloo, *_ = train_job(daemons, "open", [[]] * 4)
    relay_port, data_port = free_port(), free_port()
    unreachable = ["--reachable", "no"]
    relayed, agents, log, messages, address = train_job(
        daemons, "nat", [unreachable] * 3 + [["--relay-port", str(relay_port),
                                              "--data-port", str(data_port)]],
        "--relay-port", "0")
    relay_log = daemons.log(agents[3])
    assert "relayed through relay agents of their job" in messages, messages
    assert "dtfm data plane, 3 of 4 members dial out only" in log, log[-3000:]
    assert "dial-only pairs meet at relay agents" in log, log[-3000:]
    assert f":{relay_port}" in log.split("meet at relay agents", 1)[1].splitlines()[0]
    assert "relaying for ranks" in relay_log, relay_log[-3000:]
    assert "relay: circuit between ranks" in relay_log, relay_log[-3000:]
    # the coordinator's relay is off: every byte status counts is the relay agent's report
    forwarded = wait_for(lambda: daemons.status(address)["job"]["relay"]["forwarded_bytes"],
                         30, "the relay agent's forwarded bytes in coordinator status")
    assert forwarded > 10_000, forwarded
    worker_log = "".join(p.read_text(errors="replace")
                         for p in daemons.tmp.glob("nat-3*/work/*.log"))
    assert f"data plane listens on 127.0.0.1:{data_port}" in worker_log, worker_log[-3000:]
    ref = step_losses(daemons.tmp, gloo["id"], 1)
    got = step_losses(daemons.tmp, relayed["id"], 1)
    assert sorted(ref) == sorted(got) == [0, 1, 2, 3]
    assert all(sorted(steps) == list(range(1, STEPS + 1)) for steps in got.values())
    assert got == ref  # bit for bit: the same floats from the same seed
