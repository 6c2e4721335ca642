"""Weighing a punched path against the relay (dtfm/net/pathweigh.py): both ends
time the same exchange on real sockets and keep whichever path is faster, the direct one
unless the relay wins by more than the slack; both get one answer with the same figures.
A path is slowed by a forwarder that holds every chunk it passes on (the same on every
machine, unlike a loaded core), so which path is slower is never in doubt."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from dtfm.net import dataplane as dp
from dtfm.net.pathweigh import (
    DIRECT_SLACK,
    PROBE_BYTES,
    RELAY_BYTES,
    ROUNDS,
    Weighed,
    choose,
    weigh,
)

JOB = dp.job_digest("job")
HOLD_S = 0.02  # what the slow path's forwarder holds each chunk for


def _forward(src: socket.socket, dst: socket.socket, counted: list[int]) -> None:
    while chunk := src.recv(1 << 16):
        time.sleep(HOLD_S)
        counted[0] += len(chunk)
        dst.sendall(chunk)
    dst.shutdown(socket.SHUT_WR)


def _path(slow: bool) -> tuple[socket.socket, socket.socket, list[int]]:
    """The two ends of a path, and the bytes its forwarder passed (slow ones only)."""
    if not slow:
        a, b = socket.socketpair()
        return a, b, [0]
    a, fa = socket.socketpair()
    fb, b = socket.socketpair()
    counted = [0]
    for src, dst in ((fa, fb), (fb, fa)):
        threading.Thread(target=_forward, args=(src, dst, counted), daemon=True).start()
    return a, b, counted


def _both(slow_relay: bool) -> tuple[Weighed, Weighed, int]:
    r0, r1, relayed = _path(slow_relay)
    d0, d1, _ = _path(not slow_relay)
    got: dict[int, Weighed] = {}
    t = threading.Thread(target=lambda: got.__setitem__(1, weigh(r1, d1, JOB, 3, 1, 0, 10)))
    t.start()
    got[0] = weigh(r0, d0, JOB, 3, 0, 1, 10)
    t.join(10)
    for s in (r0, r1, d0, d1):
        s.close()
    return got[0], got[1], relayed[0]


@pytest.mark.timeout(60)
def test_a_slower_direct_path_leaves_the_pair_on_the_relay() -> None:
    low, high, _ = _both(slow_relay=False)
    assert low == high  # one decision, the same figures at both ends
    assert not low.direct and low.direct_s > low.relay_s * DIRECT_SLACK, low


@pytest.mark.timeout(60)
def test_a_faster_direct_path_is_kept_and_the_relay_carried_exactly_the_probes() -> None:
    low, high, relayed = _both(slow_relay=True)
    assert low == high and low.direct and low.direct_s < low.relay_s, low
    # headers included here (the forwarder passes whole frames): RELAY_BYTES of payload
    assert relayed == RELAY_BYTES + (2 * ROUNDS + 1) * dp.HEADER_BYTES
    assert RELAY_BYTES > ROUNDS * PROBE_BYTES


def test_the_direct_path_wins_ties_and_near_ties() -> None:
    assert choose(1.0, 1.0) and choose(1.0, DIRECT_SLACK)
    assert not choose(1.0, DIRECT_SLACK * 1.01)


@pytest.mark.timeout(30)
def test_a_frame_that_is_not_a_probe_fails_the_weighing() -> None:
    r0, r1 = socket.socketpair()
    d0, d1 = socket.socketpair()
    with r0, r1, d0, d1:
        r1.sendall(dp.Header(JOB, 3, 0, 1, 12345, 0, 4).pack() + b"data")  # a tensor frame
        with pytest.raises(ConnectionError, match="path probe"):
            weigh(r0, d0, JOB, 3, 1, 0, 5)  # rank 1 answers probes: a tensor came instead
