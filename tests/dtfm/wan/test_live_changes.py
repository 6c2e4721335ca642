"""Live changes to a running emulated WAN: a link's delay and rate, a host's compute factor.

The forwarder's control requests are checked without namespaces (what a request changes, what
it refuses and why); across real namespaces a changed link shows in measured TCP round trips and
goodput at once, `python -m dtfm.wan set` does the same from another process, and a compute
factor lands in the file workers read before every step. Namespace tests skip with the reason
where namespaces or TUN devices cannot be made.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dtfm.wan import WanEmulator, probe
from dtfm.wan.emulator import Forwarder, Spec

AVAILABLE, REASON = WanEmulator.available()
needs_wan = pytest.mark.skipif(not AVAILABLE, reason=REASON or "WAN emulation available")
REPO_ROOT = Path(__file__).resolve().parents[3]


def _forwarder(tmp_path: Path | None = None) -> Forwarder:
    spec = Spec.from_json({
        "hosts": [{"namespace": f"x{i}", "address": f"10.9.0.{i + 1}"} for i in range(3)],
        "delay_ms": [[0, 10, 20], [10, 0, 30], [20, 30, 0]],
        "bandwidth_mbps": [[None, 100, 100], [100, None, None], [100, None, None]],
        "compute_dir": str(tmp_path) if tmp_path else None,
    })
    return Forwarder(spec, [-1, -2, -3])  # control requests never touch the TUN fds


def test_control_changes_one_direction_and_keeps_what_it_is_not_told() -> None:
    fwd = _forwarder()
    answer = fwd.control({"links": [{"src": 0, "dst": 1, "delay_ms": 110}]})
    assert answer["ok"] and answer["links_changed"] == 1
    assert answer["delay_ms"][0][1] == pytest.approx(110.0)
    assert answer["delay_ms"][1][0] == pytest.approx(10.0)  # the other direction is its own
    assert answer["bandwidth_mbps"][0][1] == pytest.approx(100.0)  # rate not given: kept
    answer = fwd.control({"links": [{"src": 1, "dst": 2, "bandwidth_mbps": 2.5},
                                    {"src": 0, "dst": 2, "bandwidth_mbps": None}]})
    assert answer["bandwidth_mbps"][1][2] == pytest.approx(2.5)
    assert answer["bandwidth_mbps"][0][2] is None  # null lifts the limit
    assert answer["delay_ms"][1][2] == pytest.approx(30.0)


@pytest.mark.parametrize("request_, says", [
    ({"links": [{"src": 0, "dst": 0, "delay_ms": 5}]}, "no link to itself"),
    ({"links": [{"src": 0, "dst": 7, "delay_ms": 5}]}, "out of range"),
    ({"links": [{"src": 0, "dst": 1, "delay_ms": -1}]}, "delay_ms must be"),
    ({"links": [{"src": 0, "dst": 1, "bandwidth_mbps": 0}]}, "bandwidth_mbps must be"),
    ({"compute": {"1": 0.5}}, "factor >= 1"),
    ({"compute": {"1": 2}}, "no compute_dir"),
    ({"route": []}, "unknown request key"),
    ({"forget_nat": True}, "no NAT: there is nothing to forget"),
])
def test_control_refuses_bad_requests_and_changes_nothing(request_: dict, says: str) -> None:
    fwd = _forwarder()
    before = fwd.current()
    answer = fwd.control(request_)
    assert says in answer["error"]
    assert fwd.current() == before


def test_compute_factor_is_written_where_workers_read_it(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.worker.slowdown import ENV_SLOWDOWN_FILE, compute_slowdown

    fwd = _forwarder(tmp_path)
    monkeypatch.setenv(ENV_SLOWDOWN_FILE, str(tmp_path / "2"))
    monkeypatch.setenv("DTFM_COMPUTE_SLOWDOWN", "1.5")
    assert compute_slowdown() == 1.5  # no file yet: the start-up factor
    assert fwd.control({"compute": {"2": 3}})["compute"] == {"2": 3.0}
    assert compute_slowdown() == 3.0
    fwd.control({"compute": {"2": 1}})
    assert compute_slowdown() == 1.0


def _rtt(wan: WanEmulator, src: int, dst: int) -> float:
    """The fastest of 8 echoes: the emulated delay is a floor that load only adds to (a
    loaded full suite read a median of 25.5 ms for 20 ms), so the minimum is the figure to
    hold to it, from both sides."""
    return float(min(probe.echo_rtts_ms(wan, src, dst, count=8)))


@needs_wan
def test_link_changes_apply_while_it_runs() -> None:
    with WanEmulator(delay_ms=[[0, 20], [20, 0]], bandwidth_mbps=[[0, 40], [40, 0]]) as wan:
        probe.start_server(wan, 1)
        assert _rtt(wan, 0, 1) == pytest.approx(40.0, abs=max(4.0, 0.1 * 40))
        wan.set_link(0, 1, delay_ms=80.0, bandwidth_mbps=4.0, both_ways=True)
        assert wan.delay_ms[1][0] == 80.0 and wan.bandwidth_mbps[0][1] == 4.0
        assert _rtt(wan, 0, 1) == pytest.approx(160.0, abs=16.0)
        mbps = probe.bulk_mbps(wan, 0, 1, 2_000_000)
        assert 3.0 <= mbps <= 4.4, f"goodput {mbps:.1f} Mbit/s after the rate fell to 4"
        # from another process, as a benchmark script would
        out = subprocess.run(
            [sys.executable, "-m", "dtfm.wan", "set", "--control", wan.control_socket,
             "--link", "0:1", "--both-ways", "--delay-ms", "10"],
            capture_output=True, text=True, cwd=REPO_ROOT, timeout=30)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["delay_ms"][0][1] == pytest.approx(10.0)
        assert _rtt(wan, 0, 1) == pytest.approx(20.0, abs=4.0)
        wan.live.set_compute(1, 2.0)
        assert Path(wan.live.compute_file(1)).read_text().strip() == "2.0"
        assert wan.live.compute == {1: 2.0}


def test_set_command_says_what_is_wrong(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "dtfm.wan", "set", "--control",
                          str(tmp_path / "none.sock"), "--link", "0:1", "--delay-ms", "5"],
                         capture_output=True, text=True, cwd=REPO_ROOT, timeout=30)
    assert out.returncode == 1
    assert "no emulator listens" in out.stderr


def test_a_cut_link_drops_its_direction_only_until_healed() -> None:
    fwd = _forwarder()
    answer = fwd.control({"links": [{"src": 0, "dst": 1, "cut": True}]})
    assert answer["cut"] == [[0, 1]] and fwd.cut[0][1] and not fwd.cut[1][0]
    assert answer["delay_ms"][0][1] == pytest.approx(10.0)  # delay and rate kept for a heal
    assert "cut must be true or false" in fwd.control(
        {"links": [{"src": 0, "dst": 1, "cut": "yes"}]})["error"]
    assert fwd.control({"links": [{"src": 0, "dst": 1, "cut": False}]})["cut"] == []


@needs_wan
def test_a_cut_link_carries_nothing_while_both_hosts_reach_the_third() -> None:
    """A route failure between two sites: 1 and 2 cannot talk, both still reach 0."""
    with WanEmulator(delay_ms=[[0, 5, 5], [5, 0, 5], [5, 5, 0]]) as wan:
        for host in (0, 2):
            probe.start_server(wan, host)
        wan.set_link(1, 2, cut=True, both_ways=True)
        assert wan.live.cut == {(1, 2), (2, 1)}
        with pytest.raises((RuntimeError, subprocess.TimeoutExpired)):
            probe.echo_rtts_ms(wan, 1, 2, count=1, timeout=5)
        assert _rtt(wan, 1, 0) == pytest.approx(10.0, abs=4.0)
        assert _rtt(wan, 2, 0) == pytest.approx(10.0, abs=4.0)
        wan.set_link(1, 2, cut=False, both_ways=True)
        assert _rtt(wan, 1, 2) == pytest.approx(10.0, abs=4.0)
