"""A peer that breaks off or lies in a frame fails this rank's receives at once (issue 41, 6-7).

Real sockets on loopback: rank 0 is a real `Mesh` that listens; rank 1 is a raw socket that
passes the job-key handshake as a member would and then misbehaves on the wire.

- It disconnects in the middle of a tensor: the receive being filled fails at once, as a lost
  connection naming rank 1 (it used to be out of `posted` and wait out the group's timeout).
- It sends a header claiming 2^50 bytes, for a receive of 16 bytes or for none at all: nothing
  of that size is allocated (that raised MemoryError and killed the reader, so every later
  receive from it hung); the posted receive fails at once, and later receives still hear when
  the peer goes.
- Any error inside the reader fails the peer's waiting receives, naming it.

A direct connection that merely breaks is waited on for `resume.GRACE_S`, for its dialer to
connect again and resume it (`test_connection_resume.py`); here the grace is cut to 1 s, so
"at once" means once that short grace is over, well inside the group's timeout.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch

from agent.worker.transport import TransportConfig, resume
from agent.worker.transport.mesh import Mesh
from agent.worker.transport.peer import Peer
from agent.worker.transport.work import TransportWork
from dtfm.net import dataplane as dp
from dtfm.rpc import free_port

SECRET, JOB, EPOCH = b"join-token-of-the-test", "job-a", 1
WAIT = timedelta(seconds=20)  # well under the mesh's own timeout, well over "at once"


@contextlib.contextmanager
def _rank0_and_raw_rank1() -> Iterator[tuple[Mesh, socket.socket]]:
    """A listening rank 0, and a raw socket that has passed the handshake as rank 1."""
    addr = f"127.0.0.1:{free_port()}"
    m0 = Mesh(TransportConfig(JOB, EPOCH, SECRET, {0: addr, 1: None},
                              timeout=timedelta(seconds=120)), 0)
    raw = socket.create_connection(dp.parse_addr(addr), timeout=10)
    try:
        dp.handshake(raw, dp.derive_key(SECRET, JOB, EPOCH), JOB, EPOCH, dp.ROLE_DIAL, 1)
        resume.exchange(raw, resume.State(0, 0, 0), 10)
        yield m0, raw
    finally:
        raw.close()
        m0.close()


@pytest.fixture(autouse=True)
def _short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resume, "GRACE_S", 1.0)


def _header(tag: int, length: int) -> bytes:
    return dp.Header(dp.job_digest(JOB), EPOCH, 1, 0, 0, tag, length).pack()


def _fails_at_once(work: TransportWork, match: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=match) as info:
        work.wait(WAIT)
    assert "timed out" not in str(info.value), info.value
    assert time.monotonic() - t0 < 5, f"took {time.monotonic() - t0:.1f} s: {info.value}"


@pytest.mark.timeout(60)
def test_a_peer_gone_mid_tensor_fails_the_receive_at_once_naming_it() -> None:
    with _rank0_and_raw_rank1() as (m0, raw):
        buf = torch.zeros(1024)
        work = m0.recv(1, 0, 5, buf)
        raw.sendall(_header(5, 4096) + b"\x01" * 100)  # a quarter of the payload, then gone
        time.sleep(0.2)  # the reader has taken the receive and is inside its payload
        raw.close()
        _fails_at_once(work, "connection to rank 1 lost")


@pytest.mark.timeout(60)
def test_a_huge_claimed_length_for_a_posted_receive_allocates_nothing() -> None:
    with _rank0_and_raw_rank1() as (m0, raw):
        posted = m0.recv(1, 0, 9, torch.zeros(4))
        later = m0.recv(1, 0, 10, torch.zeros(4))
        raw.sendall(_header(9, 1 << 50))
        _fails_at_once(posted, "rank 1 sent 1125899906842624 bytes .* for a receive of 16")
        raw.close()  # the reader is alive: the peer's going still reaches the next receive
        _fails_at_once(later, "connection to rank 1 lost")


@pytest.mark.timeout(60)
def test_a_huge_frame_nobody_posted_waits_within_the_mailbox_limit() -> None:
    with _rank0_and_raw_rank1() as (m0, raw):
        raw.sendall(_header(7, 1 << 50))  # claims 1 PiB; nothing posted for tag 7
        time.sleep(0.5)
        assert m0.peers[1].unclaimed == 0
        later = m0.recv(1, 0, 8, torch.zeros(4))
        raw.close()
        _fails_at_once(later, "connection to rank 1 lost")
        after = m0.recv(1, 0, 11, torch.zeros(4))  # the peer is known gone: no wait at all
        _fails_at_once(after, "rank 1")


@pytest.mark.timeout(60)
def test_any_error_in_a_reader_fails_its_peers_waiting_receives(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(t: torch.Tensor) -> memoryview:
        raise KeyError("a bug in the reader")

    with _rank0_and_raw_rank1() as (m0, raw):
        first = m0.recv(1, 0, 5, torch.zeros(4))
        second = m0.recv(1, 0, 6, torch.zeros(4))
        monkeypatch.setattr(sys.modules[Peer.__module__], "byte_view", broken)
        raw.sendall(_header(5, 16) + b"\x00" * 16)
        _fails_at_once(first, r"reading from rank 1 failed \(KeyError")
        _fails_at_once(second, "reading from rank 1 failed")
