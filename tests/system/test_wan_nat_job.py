"""A job trains across emulated hosts with two of its four agents behind NATs (issue 32).

Agents 1 and 2 sit behind NATs of their own (private 192.168.1.2 each, no inbound
connection gets through). They join by dialling out; the coordinator's dial-back finds them
reachable from nowhere; the 2 x 2 job runs on the dtfm transport: they dial the listening
agents, and between themselves meet at the coordinator's relay on host 0.

With the defaults a user gets: `--transport auto` and link measurement on. The job has its
four agents as soon as they joined, while the dial-back of a NATed agent ends only at its
timeout; the job waits for the verdicts before planning (`Membership.with_verdicts`), so
auto picks dtfm. Links into the NATed agents are measured the other way, and the pair of
them (no direct path either way) punches through both NATs at link measurement and is
measured direct (coordinator/links/punchprobe.py): priced direct where that path is the
faster (relay-far), relayed through the coordinator where the relay is (relay-free). At the
relay, at each epoch, they punch again and keep whichever path timed faster (pathweigh.py):
the relay where the coordinator's host is free (the emulator's default), the direct path
where it is 20 ms and 50 Mbit/s away (both cases below; the pair's direct path is 100 ms
one way beside the free relay and 10 ms beside the far one, so that either choice wins by a
margin load does not erase).

Ports (dtfm/net/front.py, docs/operations.md "Ports and reachability"): while the job trains,
each host's network namespace listens on exactly one TCP port: the coordinator's host on
its gRPC port (the relay shares it), each agent's host on the agent's gRPC port (its
worker's data plane shares it), a NATed agent's too (nobody can reach it, but it still
serves gRPC for the coordinator's dial-back to fail on).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dtfm.net.pathweigh import RELAY_BYTES
from dtfm.wan import WanEmulator
from dtfm.wan.cluster import AGENT_PORT, COORDINATOR_PORT, WanCluster, measurement_wan
from tests.netstat import listening_tcp_ports

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")

RATE = [[0, 100, 100, 100], [100, 0, 100, 100], [100, 100, 0, 100], [100, 100, 100, 0]]


def delays(pair_ms: float) -> list[list[float]]:
    """One-way delays between the agents, the NATed pair's own direct path (agents 1 and 2,
    on hosts 2 and 3) `pair_ms`."""
    return [[0, 10, 5, 10], [10, 0, pair_ms, 5], [5, pair_ms, 0, 10], [10, 5, 10, 0]]


# the world other WAN tests borrow (test_wan_bad_peer, test_wan_relay_agent,
# test_wan_relay_tamper): every pair 5-10 ms apart
DELAY = delays(10.0)
STEPS = 8
JOB = ["--model", "gpt-tiny", "--agents", "4", "--stages", "2", "--replicas", "2",
       "--steps", str(STEPS), "--batch", "8", "--micro-batches", "2", "--seed", "5",
       "--search-seconds", "1", "--eval-batches", "0",
       "--heartbeat-interval", "0.5", "--layer-split", "even"]


# The relay's host: free (the emulator's default coordinator), where the scheduler puts the
# NATed pair next to each other (relayed links priced at nothing) and the pair, punched
# through, finds the relay faster and stays on it; or 20 ms and 50 Mbit/s from everyone, as a
# real one is, where the network-blind rank order (stage 1 = the two NATed agents, the last
# in address order) makes them data-parallel peers and the direct path (10 ms) is the faster
# once punched. With a free relay the pair's direct path is 100 ms one way: a delay no rate
# burst hides, so the relay wins even when the suite's load starves the coordinator that
# forwards (beside two other test processes its relay took 114 ms for the weighing's 256 KiB
# round trip, where the 10 ms direct path took 44 ms).
CASES = {"relay-free": ((0.0, None), [], False, 100.0),
         "relay-far": ((20.0, 50.0), ["--placement", "rank-order"], True, 10.0)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_a_2x2_job_with_two_agents_behind_nats_trains_to_the_end(tmp_path: Path,
                                                                 case: str) -> None:
    relay_link, placement, direct, pair_ms = CASES[case]
    with measurement_wan(delays(pair_ms), RATE, nat=[1, 2], coordinator_link=relay_link) as wan:
        assert wan.address(2) == wan.address(3)  # both believe they are 192.168.1.2
        cluster = WanCluster(wan, tmp_path, agents=4, coordinator_args=[*JOB, *placement])
        listening: dict[str, set[int]] = {}

        def ports_while_training(status: dict) -> None:
            job = status.get("job", {})
            if not listening and job.get("state") == "running" and job.get("step", 0) >= 1:
                assert cluster.coordinator_proc is not None
                procs = {"coordinator": cluster.coordinator_proc} | {
                    f"agent-{i}": p for i, p in enumerate(cluster.agent_procs)}
                listening.update({name: listening_tcp_ports(p.pid)
                                  for name, p in procs.items()})

        try:
            ids = cluster.start(timeout=90)
            status = cluster.wait_job(400, on_status=ports_while_training)
        finally:
            cluster.stop()
        nats = {wan.public_address(2), wan.public_address(3)}  # agents 1 and 2 (host 0: the
        # coordinator)
    job = status["job"]
    assert job["state"] == "done" and job["step"] == STEPS, job
    assert len(set(ids)) == 4
    verdicts = {a["id"]: a["reach"]["verdict"] for a in status["agents"]}
    assert verdicts[ids[1]] == verdicts[ids[2]] == "nowhere", verdicts
    log = (tmp_path / "coordinator.log").read_text(errors="replace")
    assert "dtfm data plane" in log, log[-3000:]
    # every epoch on dtfm: none planned on gloo before the NATed agents' verdicts came in
    assert log.count("dtfm data plane") == job["epoch"], log[-3000:]
    assert "no reachability verdict" not in log, log[-3000:]
    # the NATed pair punched through at link measurement; priced as the data plane then goes
    assert "1 of 1 pairs nobody can dial punched through both ways" in log, log[-3000:]
    assert ("punched pairs are faster through the relay" in log) != direct, log[-3000:]
    workers = [p.read_text(errors="replace") for p in tmp_path.glob("agent-*/work/*.log")]
    assert sum("dtfm via the assignment's peer table" in t for t in workers) >= 4, workers[:1]
    # the two NATed agents met at the relay, then punched a direct connection through both
    # NATs (dtfm/net/punch.py): each saw the other at its NAT's public address
    # and mapped port. They timed both paths (pathweigh.py) and kept the faster: direct, and
    # the relay carried only the two one-byte "got through" frames and the weighing's probes
    # (before hole punching it carried their data-parallel or pipeline traffic); or the
    # relay, which then carried their traffic as well
    nat_workers = "".join(p.read_text(errors="replace")
                          for i in (1, 2) for p in tmp_path.glob(f"agent-{i}/work/*.log"))
    outcome = "hole punched" if direct else "got through"
    punched = re.findall(rf"{outcome} to rank \d+ at ([\d.]+):(\d+)", nat_workers)
    assert len(punched) == 2 * job["epoch"], nat_workers[-3000:]
    assert {host for host, _ in punched} == nats, punched
    assert all(int(port) >= 20000 for _, port in punched)  # the NATs' mapped ports
    weighing = (2 + RELAY_BYTES) * job["epoch"]
    if direct:
        assert job["relay"]["forwarded_bytes"] == weighing, job["relay"]
    else:
        assert "the relay is faster" in nat_workers, nat_workers[-3000:]
        assert job["relay"]["forwarded_bytes"] > weighing + 10_000, job["relay"]
    # one TCP port per daemon, the data plane and the relay included (seen mid-training)
    assert listening == {"coordinator": {COORDINATOR_PORT},
                         **{f"agent-{i}": {AGENT_PORT} for i in range(4)}}, listening
