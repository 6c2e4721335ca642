"""`free_port` draws below the ephemeral range, so no outgoing connection takes the number
between the draw and the bind (CI once lost a rendezvous that way: "Address already in use")."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from dtfm import rpc
from dtfm.rpc import free_port


def test_a_free_port_is_below_the_ephemeral_range_and_clear_of_rendezvous_ports() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if low <= 20000:
        pytest.skip(f"this kernel's ephemeral range starts at {low}: no room below it")
    ports = {free_port() for _ in range(50)}
    assert all(20000 <= p < low and not 29500 <= p < 30500 for p in ports), ports
    assert len(ports) > 40  # drawn at random, not the same few each time
    for port in list(ports)[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free indeed


def test_a_taken_port_is_never_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    held = [socket.socket() for _ in range(3)]
    try:
        for s in held:
            s.bind(("127.0.0.1", 0))
        taken = [s.getsockname()[1] for s in held]
        # a range of exactly the three held ports: nothing below it is bindable, so bind(0)
        monkeypatch.setattr(rpc, "FREE_PORTS_FROM", min(taken))
        monkeypatch.setattr(rpc, "ephemeral_low", lambda: min(taken) + 1)
        assert free_port() not in taken
    finally:
        for s in held:
            s.close()


def test_an_unreadable_range_means_the_usual_one(tmp_path: Path) -> None:
    assert rpc.ephemeral_low(str(tmp_path / "missing")) == 32768
    (tmp_path / "range").write_text("40000\t60999\n")
    assert rpc.ephemeral_low(str(tmp_path / "range")) == 40000
