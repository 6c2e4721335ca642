"""Hosts behind a NAT or a stateful firewall on the WAN emulator: real namespaces, real TCP/UDP.

One emulated WAN for the module: host 0 and host 6 are public, hosts 1 and 2 each sit behind a
NAT of their own (both at 192.168.1.2, as behind two home routers), host 3 behind a stateful
firewall, hosts 4 and 5 behind one NAT together. A NATed host dials out and its peer sees the
NAT's public address and a mapped port, the bytes arrive intact (checksums rewritten right);
nobody outside dials it, at its private address or at its NAT's; a firewalled host dials out
and cannot be dialled; delay and rate still hold through a NAT. Skipped (with the reason)
where namespaces cannot be made.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dtfm.wan import WanEmulator, probe
from dtfm.wan.emulator import request

AVAILABLE, REASON = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=REASON or "WAN emulation available")

REPO_ROOT = Path(__file__).resolve().parents[3]
SERVER, NAT_A, NAT_B, WALLED, SITE_1, SITE_2, DIALER = range(7)
RATE_MBPS = 40.0


@pytest.fixture(scope="module")
def wan() -> Iterator[WanEmulator]:
    n = 7
    delay = [[0.0 if i == j else 5.0 for j in range(n)] for i in range(n)]
    delay[NAT_A][SERVER], delay[SERVER][NAT_A] = 30.0, 20.0
    rate: list[list[float | None]] = [[None] * n for _ in range(n)]
    rate[NAT_A][SERVER] = RATE_MBPS
    with WanEmulator(delay_ms=delay, bandwidth_mbps=rate, nat=[NAT_A, NAT_B],
                     firewall=[WALLED], shared_nat=[[SITE_1, SITE_2]], mtu=9000) as emu:
        probe.start_server(emu, SERVER)
        yield emu
    assert emu.stats is not None
    assert emu.stats["dropped_nat_inbound"] > 0 and emu.stats["dropped_firewall"] > 0, emu.stats


def dial(wan: WanEmulator, src: int, targets: list[tuple[str, int]], timeout: float = 1.5
         ) -> list[str]:
    """Try a TCP connection from host ``src`` to each target at once: "connected",
    "timeout", or the error's name, per target."""
    code = textwrap.dedent(f"""
        import socket, threading
        targets = {targets!r}
        out = [""] * len(targets)
        def one(k):
            try:
                socket.create_connection(targets[k], timeout={timeout}).close()
                out[k] = "connected"
            except TimeoutError:
                out[k] = "timeout"
            except OSError as exc:
                out[k] = type(exc).__name__
        threads = [threading.Thread(target=one, args=(k,)) for k in range(len(targets))]
        for t in threads: t.start()
        for t in threads: t.join()
        print(" ".join(out))
    """)
    out = subprocess.run(wan.command(src, [sys.executable, "-c", code]), capture_output=True,
                         text=True, timeout=timeout + 15, check=True)
    return out.stdout.split()


@pytest.mark.timeout(30)
def test_nated_host_dials_out_and_its_peer_sees_the_nat(wan: WanEmulator) -> None:
    assert wan.address(NAT_A).startswith("192.168.1.")
    assert not wan.public_address(NAT_A).startswith("192.168.")
    reply = probe.send_to(wan, NAT_A, SERVER, 4_000_000)
    assert reply["bytes"] == 4_000_000
    assert reply["sha256"] == reply["sent_sha256"], "bytes changed on the way through the NAT"
    seen_addr, seen_port = reply["peer"]
    own_addr, own_port = reply["local"]
    assert own_addr == wan.address(NAT_A)
    assert seen_addr == wan.public_address(NAT_A) != own_addr
    assert seen_port != own_port, "the NAT mapped the port: peers see a port of the NAT's"


@pytest.mark.timeout(30)
def test_same_private_address_behind_two_nats_told_apart(wan: WanEmulator) -> None:
    assert wan.address(NAT_A) == wan.address(NAT_B)
    a = probe.send_to(wan, NAT_A, SERVER, 100_000)
    b = probe.send_to(wan, NAT_B, SERVER, 100_000)
    assert a["local"][0] == b["local"][0]
    assert a["peer"][0] == wan.public_address(NAT_A)
    assert b["peer"][0] == wan.public_address(NAT_B)
    assert a["peer"][0] != b["peer"][0]
    # the forwarder lists its live mappings (host, private and public endpoint)
    live = request(wan.control_socket, {"get": True})["nat_mappings"]
    for host, reply in ((NAT_A, a), (NAT_B, b)):
        assert {"host": host, "proto": "tcp", "private": "{}:{}".format(*reply["local"]),
                "public": "{}:{}".format(*reply["peer"])} in live


@pytest.mark.timeout(60)
def test_nobody_outside_dials_a_nated_host(wan: WanEmulator) -> None:
    probe.start_server(wan, NAT_B)
    # its own (private) address is not routed on the Internet
    assert dial(wan, DIALER, [(wan.address(NAT_B), probe.DEFAULT_PORT)]) != ["connected"]
    # its NAT forwards nothing without a mapping, nor a mapped port to someone it never sent to
    mapped = probe.send_to(wan, NAT_B, SERVER, 1000)["peer"][1]
    public = wan.public_address(NAT_B)
    targets = [(public, port) for port in (probe.DEFAULT_PORT, mapped, mapped + 1)]
    for src in (DIALER, SERVER, NAT_A):
        assert dial(wan, src, targets) == ["timeout"] * len(targets), src
    assert not wan.dialable(DIALER, NAT_B) and not wan.dialable(NAT_A, NAT_B)


@pytest.mark.timeout(30)
def test_udp_replies_pass_and_strangers_are_filtered(wan: WanEmulator) -> None:
    """Endpoint-independent mapping, address-and-port-dependent filtering: the server's answer
    from the port the host sent to comes in; a datagram from its other port does not."""
    server_code = textwrap.dedent(f"""
        import socket
        a, b = (socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2))
        a.bind(({wan.address(SERVER)!r}, 9000))
        b.bind(({wan.address(SERVER)!r}, 9001))
        print("ready", flush=True)
        data, peer = a.recvfrom(100)
        b.sendto(b"stranger", peer)
        a.sendto(f"{{peer[0]}}:{{peer[1]}}".encode(), peer)
    """)
    client_code = textwrap.dedent(f"""
        import socket
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
        s.sendto(b"hi", ({wan.address(SERVER)!r}, 9000))
        got = [s.recvfrom(100)[0].decode()]
        s.settimeout(1.0)
        try:
            got.append(s.recvfrom(100)[0].decode())
        except TimeoutError:
            pass
        print(" ".join(got))
    """)
    server = wan.popen(SERVER, [sys.executable, "-c", server_code], stdout=subprocess.PIPE,
                       text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    out = subprocess.run(wan.command(NAT_A, [sys.executable, "-c", client_code]),
                         capture_output=True, text=True, timeout=20, check=True)
    server.wait(timeout=5)
    got = out.stdout.split()
    assert len(got) == 1, f"a datagram from a port the host never sent to came in: {got}"
    addr, port = got[0].rsplit(":", 1)
    assert addr == wan.public_address(NAT_A) and int(port) >= 20000


@pytest.mark.timeout(30)
def test_firewalled_host_dials_out_but_is_not_dialled(wan: WanEmulator) -> None:
    reply = probe.send_to(wan, WALLED, SERVER, 1_000_000)
    assert reply["sha256"] == reply["sent_sha256"]
    assert reply["peer"] == reply["local"]  # no translation: its address is public
    assert reply["peer"][0] == wan.address(WALLED) == wan.public_address(WALLED)
    probe.start_server(wan, WALLED)
    for src in (SERVER, DIALER, NAT_A):
        assert dial(wan, src, [(wan.address(WALLED), probe.DEFAULT_PORT)]) == ["timeout"], src
    assert not wan.dialable(SERVER, WALLED)


@pytest.mark.timeout(30)
def test_shared_nat_lan_is_direct_and_one_address_outside(wan: WanEmulator) -> None:
    assert wan.address(SITE_1) != wan.address(SITE_2)
    assert wan.public_address(SITE_1) == wan.public_address(SITE_2)
    assert wan.dialable(SITE_1, SITE_2) and wan.dialable(SITE_2, SITE_1)
    probe.start_server(wan, SITE_2)
    lan = probe.send_to(wan, SITE_1, SITE_2, 100_000)
    assert lan["peer"] == lan["local"] and lan["peer"][0] == wan.address(SITE_1)
    one = probe.send_to(wan, SITE_1, SERVER, 1000)["peer"]
    two = probe.send_to(wan, SITE_2, SERVER, 1000)["peer"]
    assert one[0] == two[0] == wan.public_address(SITE_1)
    assert one[1] != two[1]
    assert dial(wan, SERVER, [(wan.public_address(SITE_1), probe.DEFAULT_PORT)]) == ["timeout"]


@pytest.mark.timeout(30)
def test_delay_and_rate_hold_through_the_nat(wan: WanEmulator) -> None:
    rtt = statistics.median(probe.echo_rtts_ms(wan, NAT_A, SERVER, count=10))
    expected = wan.delay_ms[NAT_A][SERVER] + wan.delay_ms[SERVER][NAT_A]
    assert abs(rtt - expected) <= max(0.1 * expected, 3.0), (rtt, expected)
    mbps = probe.bulk_mbps(wan, NAT_A, SERVER, nbytes=5_000_000)
    assert 0.7 * RATE_MBPS <= mbps <= 1.05 * RATE_MBPS, mbps


@pytest.mark.timeout(60)
def test_cli_reports_reachability_and_skips_undialable_pairs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dtfm.wan", "--delay-ms", "5", "--hosts", "3", "--nat", "1",
         "--firewall", "2", "--measure", "--json", "--bulk-seconds", "0.2"],
        capture_output=True, text=True, timeout=50, check=True,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    report: dict[str, Any] = json.loads(out.stdout)
    hosts = report["hosts"]
    assert [h["reachability"] for h in hosts] == ["public", "nat", "firewall"]
    assert hosts[1]["address"].startswith("192.168.1.")
    assert hosts[1]["public_address"] not in (hosts[0]["address"], hosts[2]["address"])
    dialable = {(r["src"], r["dst"]) for r in report["pairs"] if r["dialable"]}
    assert dialable == {(1, 0), (2, 0)}
    for r in report["pairs"]:
        if r["dialable"]:
            assert abs(r["rtt_ms"] - 10.0) <= 3.0, r


@pytest.mark.timeout(90)
def test_agents_behind_nats_at_one_private_address_join_by_id(tmp_path: Path) -> None:
    """The issue's starting point: agents behind two NATs advertise the same private address;
    they still join (they dial out) and the cluster tells them apart by id."""
    from dtfm.wan.cluster import WanCluster, measurement_wan

    with measurement_wan([[0, 5], [5, 0]], [[0, 100], [100, 0]], nat=[0, 1]) as emu:
        assert emu.address(1) == emu.address(2)
        cluster = WanCluster(emu, tmp_path, agents=2)
        try:
            ids = cluster.start(timeout=60, prewarm=False)
            status = cluster.cli("status", "--json")
        finally:
            cluster.stop()
    assert len(set(ids)) == 2
    advertised = {a["id"]: a["address"] for a in status["agents"]}
    assert advertised[ids[0]] == advertised[ids[1]] == f"{emu.address(1)}:7071"
