"""The agent's side of a punch probe (agent/probing/punchprobe.py), where no NAT is needed.

The exchange on the punched connection runs here over a socket pair: each end times its own
round trips and hears the rate the other received, whether the receiver stopped the
transfer (its windows agreed) or the sender ran out of bytes first (the two crossed). Through
a real relay on loopback, an admitted pair gets as far as the punch, which is not tried
between loopback addresses (dtfm/net/punch.py `on_loopback`), so both ends report a failure
with the reason, as a pair behind a symmetric NAT would; a pair the relay did not admit is
refused. The punch itself across NATs: tests/system/test_wan_punch_links.py.
"""

from __future__ import annotations

import asyncio
import os
import resource
import secrets
import socket
import threading

import pytest

from agent.probing.punchprobe import Figures, Link, probe, readable_now
from dtfm.net import dataplane as dp
from dtfm.net.relay import Relay
from protos.dtfm.v1 import coordinator_pb2

JOB = dp.job_digest("linkprobe-test")


def _both(seconds: float, max_bytes: int) -> tuple[Figures, Figures]:
    a, b = socket.socketpair()
    got: dict[int, Figures] = {}
    errors: list[BaseException] = []

    def run(sock: socket.socket, me: int) -> None:
        try:
            sock.settimeout(10)
            got[me] = Link(sock, JOB, me, 1 - me).run(3, seconds, max_bytes)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s, r)) for s, r in ((a, 0), (b, 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    a.close()
    b.close()
    assert not errors, errors
    return got[0], got[1]


@pytest.mark.timeout(60)
def test_each_end_measures_its_own_direction_on_the_punched_connection() -> None:
    for figures in _both(seconds=0.3, max_bytes=1 << 30):
        assert figures.delay_ms >= 0 and figures.rate.gbps > 0


@pytest.mark.timeout(60)
def test_a_transfer_cut_short_by_its_byte_cap_ends_with_an_estimate() -> None:
    for figures in _both(seconds=2.0, max_bytes=64 * 1024):
        assert figures.rate.gbps > 0
        assert figures.rate.estimate_note.startswith("no steady rate: the sender stopped")


def _ticket(relay: Relay, secret: bytes, job: str) -> tuple[coordinator_pb2.MeasureLinksCommand,
                                                             coordinator_pb2.MeasureLinksCommand]:
    cmds = []
    for rank, peer in ((0, "b"), (1, "a")):
        cmds.append(coordinator_pb2.MeasureLinksCommand(
            round_id="r", kind=coordinator_pb2.MEASURE_KIND_PUNCH, probe_seconds=0.3,
            peers=[coordinator_pb2.PeerTarget(agent_id=peer)],
            punch=coordinator_pb2.PunchProbe(relay=f":{relay.port}", job=job, secret=secret,
                                             rank=rank, peer_rank=1 - rank)))
    return cmds[0], cmds[1]


async def _probe_both(relay: Relay, secret: bytes, job: str) -> list:
    a, b = _ticket(relay, secret, job)
    coordinator = "127.0.0.1:1"  # the relay is at the coordinator's host (":PORT")
    return list(await asyncio.gather(probe("a", a, coordinator), probe("b", b, coordinator)))


@pytest.mark.timeout(60)
def test_an_admitted_pair_meets_at_the_relay_and_reports_a_punch_that_did_not_get_through(
) -> None:
    relay = Relay(None, "127.0.0.1", 0)
    secret = secrets.token_bytes(32)
    relay.admit("linkprobe-a-b", 0, secret, 2)
    relay.start_in_thread()
    try:
        samples = asyncio.run(_probe_both(relay, secret, "linkprobe-a-b"))
    finally:
        relay.stop()
    assert [s.peer_id for s in samples] == ["b", "a"]
    for s in samples:
        assert not s.reachable
        assert "did not get through both ways" in s.error, s.error
    assert relay.rejected == 0  # both proved the pseudo-job's key


@pytest.mark.timeout(60)
def test_a_pair_the_relay_did_not_admit_is_refused() -> None:
    relay = Relay(None, "127.0.0.1", 0)
    relay.admit("linkprobe-a-b", 0, secrets.token_bytes(32), 2)
    relay.start_in_thread()
    try:
        # the right pseudo-job, a made-up secret; then a pseudo-job retired (never admitted)
        wrong = asyncio.run(_probe_both(relay, secrets.token_bytes(32), "linkprobe-a-b"))
        gone = asyncio.run(_probe_both(relay, secrets.token_bytes(32), "linkprobe-c-d"))
    finally:
        relay.stop()
    for s in wrong + gone:
        assert not s.reachable and s.error.startswith("no hole punch to"), s.error
    assert relay.rejected == 4 and relay.forwarded("linkprobe-a-b") == 0


def test_a_command_without_its_ticket_is_a_failed_sample() -> None:
    cmd = coordinator_pb2.MeasureLinksCommand(
        kind=coordinator_pb2.MEASURE_KIND_PUNCH, peers=[coordinator_pb2.PeerTarget(agent_id="b")])
    sample = asyncio.run(probe("a", cmd, "127.0.0.1:1"))
    assert not sample.reachable and "different dtfm versions" in sample.error


def test_a_descriptor_past_1024_is_polled_not_selected() -> None:
    """The units run the agent with LimitNOFILE=65536 (deploy/): a busy agent's probe socket can
    be numbered past 1,023, where select(2) raises ValueError and the probe would fail."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the hard open-file limit is {hard}: no descriptor past 1,024 to try")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    a, b = socket.socketpair()
    high = os.dup2(a.fileno(), 1500)
    sock = socket.socket(fileno=high)
    try:
        assert not readable_now(sock)
        b.sendall(b"x")
        assert readable_now(sock)
    finally:
        sock.close()
        a.close()
        b.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
