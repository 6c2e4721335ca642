"""Tests of the WAN emulator (dtfm.wan): real namespaces, real TCP, measured delay and rate.

Between two namespaces with 40 ms one-way and 20 Mbit/s, a TCP echo sees about 80 ms RTT and a
bulk transfer about 20 Mbit/s; an asymmetric 3-host matrix gives each pair d(a,b) + d(b,a); and
no namespace or process is left behind, also when the body raises, on SIGTERM, or when the
owner is killed outright. Skipped (with the reason) where namespaces or TUN cannot be made.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dtfm.wan import WanEmulator, netns, probe

AVAILABLE, REASON = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=REASON or "WAN emulation available")

REPO_ROOT = Path(__file__).resolve().parents[3]


def echo_rtt_ms(wan: WanEmulator, src: int, dst: int, count: int = 10) -> float:
    """The fastest of `count` echoes: a loaded host only adds to a round trip (the emulator
    and the echo wait for a core; a full suite's neighbours once put the median at 91 ms for
    80), so the minimum is what the emulated delay shows, and it must not be early either."""
    return min(probe.echo_rtts_ms(wan, src, dst, count=count))


def assert_rtt(measured: float, expected: float) -> None:
    tolerance = max(0.10 * expected, 3.0)
    assert abs(measured - expected) <= tolerance, (
        f"RTT {measured:.1f} ms, expected {expected:.1f} +- {tolerance:.1f} ms"
    )


def namespace_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes (its parent has not reaped it yet)
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def assert_nothing_left(names: list[str], inodes: list[int], pids: list[int]) -> None:
    assert not set(names) & namespace_names(), "namespaces left behind"
    assert netns.pids_in_namespaces(inodes) == [], "processes left inside the namespaces"
    alive = [pid for pid in pids if pid_alive(pid)]
    assert alive == [], f"processes left behind: {alive}"


@pytest.fixture
def two_hosts() -> Iterator[WanEmulator]:
    wan = WanEmulator(delay_ms=[[0, 40], [40, 0]], bandwidth_mbps=[[0, 20], [20, 0]])
    with wan:
        yield wan
    assert_nothing_left(
        [wan.namespace(i) for i in range(wan.size)],
        wan.namespace_inodes,
        [p for p in [wan.emulator_pid] if p is not None],
    )
    assert wan.stats is not None and wan.stats["forwarded"] > 0, wan.stats


@pytest.mark.timeout(60)
def test_two_hosts_rtt_and_bandwidth(two_hosts: WanEmulator) -> None:
    wan = two_hosts
    assert wan.size == 2
    assert wan.address(0) != wan.address(1)
    server = probe.start_server(wan, 1)
    rtt = echo_rtt_ms(wan, 0, 1, count=15)
    rate = probe.bulk_mbps(wan, 0, 1, nbytes=5_000_000)
    print(f"2 hosts, 40 ms one-way, 20 Mbit/s: echo RTT {rtt:.1f} ms, bulk {rate:.1f} Mbit/s")
    assert_rtt(rtt, 80.0)
    assert abs(rate - 20.0) <= 0.20 * 20.0, f"bulk {rate:.1f} Mbit/s, expected 20 +- 20 %"
    assert server.poll() is None
    assert wan.emulator_running


@pytest.mark.timeout(60)
def test_asymmetric_three_hosts() -> None:
    delay = [[0, 10, 30], [20, 0, 5], [15, 25, 0]]
    with WanEmulator(delay_ms=delay) as wan:
        names = [wan.namespace(i) for i in range(3)]
        inodes = wan.namespace_inodes
        servers = [probe.start_server(wan, i) for i in range(3)]
        measured = {}
        for a, b in [(0, 1), (0, 2), (1, 2), (2, 0)]:
            measured[(a, b)] = rtt = echo_rtt_ms(wan, a, b)
            assert_rtt(rtt, delay[a][b] + delay[b][a])
        print("asymmetric RTTs (ms):", {f"{a}->{b}": round(r, 1) for (a, b), r in measured.items()})
        pids = [p.pid for p in servers] + [wan.emulator_pid or 0]
    assert_nothing_left(names, inodes, pids)


@pytest.mark.timeout(30)
def test_cleanup_when_body_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with WanEmulator(delay_ms=[[0, 5], [5, 0]]) as wan:
            names = [wan.namespace(0), wan.namespace(1)]
            inodes = wan.namespace_inodes
            sleeper = wan.popen(0, ["sleep", "60"])
            # a grandchild the harness did not start directly: found by namespace
            stray = subprocess.Popen(wan.command(1, ["sleep", "60"]))
            assert set(names) <= namespace_names()
            raise RuntimeError("boom")
    assert sleeper.returncode is not None
    stray.wait(timeout=5)
    assert_nothing_left(names, inodes, [sleeper.pid, stray.pid, wan.emulator_pid or 0])


OWNER = textwrap.dedent(
    """
    import json, sys, time
    from dtfm.wan import WanEmulator
    with WanEmulator(delay_ms=[[0, 5], [5, 0]]) as wan:
        p = wan.popen(1, ["sleep", "60"])
        print(json.dumps({"names": [wan.namespace(0), wan.namespace(1)],
                          "inodes": wan.namespace_inodes,
                          "pids": [p.pid, wan.emulator_pid]}), flush=True)
        time.sleep(60)
    """
)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_cleanup_when_owner_is_signalled(sig: signal.Signals) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert owner.stdout is not None
        info = json.loads(owner.stdout.readline())
        owner.send_signal(sig)
        owner.wait(timeout=10)
        # on SIGKILL the emulator notices its owner's pipe closing and cleans up by itself
        assert wait_until(lambda: not set(info["names"]) & namespace_names(), timeout=10)
        assert wait_until(lambda: not netns.pids_in_namespaces(info["inodes"]), timeout=10)
        assert wait_until(lambda: not any(pid_alive(p) for p in info["pids"]), timeout=10)
        assert_nothing_left(info["names"], info["inodes"], info["pids"])
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


@pytest.mark.timeout(30)
def test_sysctls_apply_inside_hosts_only() -> None:
    root_before = Path("/proc/sys/net/ipv4/tcp_wmem").read_text()
    value = "4096 16384 12345678"
    with WanEmulator(delay_ms=[[0, 1], [1, 0]], sysctls={"net.ipv4.tcp_wmem": value}) as wan:
        for i in range(wan.size):
            out = subprocess.run(
                wan.command(i, ["cat", "/proc/sys/net/ipv4/tcp_wmem"]),
                capture_output=True, text=True, check=True,
            )
            assert out.stdout.split() == value.split()
    assert Path("/proc/sys/net/ipv4/tcp_wmem").read_text() == root_before
    with pytest.raises(ValueError, match="net"):
        WanEmulator(delay_ms=[[0, 1], [1, 0]], sysctls={"kernel.pid_max": "1"})


@pytest.mark.timeout(10)
def test_rejects_bad_matrices() -> None:
    with pytest.raises(ValueError, match="square"):
        WanEmulator(delay_ms=[[0, 1, 2], [1, 0]])
    with pytest.raises(ValueError, match=">= 0"):
        WanEmulator(delay_ms=[[0, -1], [1, 0]])
    with pytest.raises(ValueError, match="> 0"):
        WanEmulator(delay_ms=[[0, 1], [1, 0]], bandwidth_mbps=[[0, 0], [5, 0]])
    with pytest.raises(ValueError, match="rows"):
        WanEmulator(delay_ms=[[0, 1], [1, 0]], bandwidth_mbps=[[0]])


@pytest.mark.timeout(60)
def test_cli_measure_reports_every_pair() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dtfm.wan", "--delay-ms", "5", "--hosts", "2",
         "--bandwidth-mbps", "50", "--measure", "--json", "--bulk-seconds", "0.5"],
        capture_output=True, text=True, timeout=50, check=True,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )
    report = json.loads(out.stdout)
    rows = report["pairs"]
    assert {(r["src"], r["dst"]) for r in rows} == {(0, 1), (1, 0)}
    for r in rows:
        assert r["rtt_ms_expected"] == 10.0
        # the least of 10 echoes: a loaded machine's forwarder adds milliseconds to the median
        # (a CI rehearsal read 16.2 ms of 10 while other tests took both cores)
        assert_rtt(r["rtt_ms_min"], 10.0)
        assert r["rtt_ms"] >= r["rtt_ms_min"] >= 10.0 - 3.0
        assert 0 < r["mbps"] <= 50 * 1.05
    names = {h["namespace"] for h in report["hosts"]}
    assert len(names) == 2
    assert not names & namespace_names(), "the CLI left namespaces behind"
