"""Hole punching's decisions that need no NAT (the punch itself is pinned across emulated
NATs by tests/system/test_wan_nat_job.py): both ends agree on the path from the same two
bytes, a peer seen at a loopback address is not punched, and the peer table carries the
switch."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta
from pathlib import Path

import pytest

from agent.worker.transport.config import TransportConfig
from dtfm.net import dataplane as dp
from dtfm.net.punch import agree, on_loopback, partner_address

JOB = dp.job_digest("job")


def _both(ok_a: bool, ok_b: bool) -> tuple[bool, bool]:
    """Run `agree` on both ends of a circuit (a socketpair stands in for the relay)."""
    a, b = socket.socketpair()
    got: dict[str, bool] = {}
    t = threading.Thread(target=lambda: got.__setitem__("b", agree(b, JOB, 1, 1, 0, ok_b, 5)))
    t.start()
    got["a"] = agree(a, JOB, 1, 0, 1, ok_a, 5)
    t.join(5)
    a.close()
    b.close()
    return got["a"], got["b"]


@pytest.mark.timeout(30)
def test_both_ends_take_the_direct_path_only_when_both_got_through() -> None:
    assert _both(True, True) == (True, True)
    assert _both(True, False) == (False, False)
    assert _both(False, True) == (False, False)
    assert _both(False, False) == (False, False)


@pytest.mark.timeout(30)
def test_a_circuit_must_start_with_the_relays_observed_address() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.sendall(dp.control_frame(JOB, 1, 1, 0, dp.OBSERVED_TAG, b"203.0.113.7:20001"))
        assert partner_address(a, JOB, 1, 0, 1, 5) == "203.0.113.7:20001"
        b.sendall(dp.Header(JOB, 1, 1, 0, 12345, 0, 4).pack() + b"data")  # a tensor frame
        with pytest.raises(ConnectionError, match="observed address"):
            partner_address(a, JOB, 1, 0, 1, 5)
        b.sendall(dp.control_frame(JOB, 2, 1, 0, dp.OBSERVED_TAG, b"x:1"))  # another epoch
        with pytest.raises(dp.FrameError):
            partner_address(a, JOB, 1, 0, 1, 5)


def test_peers_seen_at_loopback_are_not_punched() -> None:
    assert on_loopback("127.0.0.1:4000") and on_loopback("[::1]:4000")
    assert not on_loopback("203.0.113.7:20001") and not on_loopback("192.168.1.2:5")
    assert not on_loopback("relay.example:70")  # a name, not an address: tried


def test_the_peer_table_carries_the_switch(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"s")
    cfg = TransportConfig("job", 1, b"s", {0: None, 1: None}, relay="h:1", hole_punch=True,
                          timeout=timedelta(seconds=9))
    back = TransportConfig.from_env({"DTFM_TRANSPORT": cfg.to_env(str(secret))})
    assert back.hole_punch is True
    assert TransportConfig.from_env({"DTFM_TRANSPORT": TransportConfig(
        "job", 1, b"s", {0: None}, relay="h:1").to_env(str(secret))}).hole_punch is False
