"""A direct connection that dies before its first frame is dialled again, and the listener
takes the new one (issue 40).

On a loaded WAN world the firewalled rank dialled its reachable neighbour, whose worker had
not claimed its epoch at its agent yet: the agent parked the connection, the dialer's
handshake gave up after 10 s ("receive from rank 6 failed: timed out") and the listener, once
its worker started, found a dead connection ("dropped a connection before reading any frame:
peer closed the connection mid-message"). The epoch died at step 0.

Real sockets on loopback. A raw listener (the fault seam: it plays rank 0 and passes the real
handshake, or breaks off where told) serves rank 1's real `Mesh`; a raw dialer does the same
against a real listening `Mesh`.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch

from agent.worker.transport import TransportConfig, redial, resume
from agent.worker.transport.mesh import Mesh
from dtfm.net import dataplane as dp
from dtfm.rpc import free_port
from tests.agent.handoffs import LoopAgent
from tests.agent.handoffs import mesh as handoff_mesh

SECRET, JOB, EPOCH = b"join-token-of-the-test", "job-a", 1
KEY = dp.derive_key(SECRET, JOB, EPOCH)
WAIT = timedelta(seconds=30)


def _frame(src: int, dst: int, tag: int, t: torch.Tensor) -> bytes:
    data = t.numpy().tobytes()
    return dp.Header(dp.job_digest(JOB), EPOCH, src, dst, 0, tag, len(data)).pack() + data


def _read_frame(sock: socket.socket) -> tuple[int, torch.Tensor]:
    h = dp.Header.unpack(dp.recv_exact(sock, dp.HEADER_BYTES))
    return h.tag, torch.frombuffer(bytearray(dp.recv_exact(sock, h.length)), dtype=torch.float32)


def _serve(conn: socket.socket, how: str, got: list[torch.Tensor]) -> None:
    """One connection dialled to the raw rank 0, treated as `how` says."""
    conn.settimeout(20)
    if how == "close at once":
        return
    if how == "close after the hello":  # what a refusing or evicting agent front does
        dp.recv_exact(conn, dp.HELLO_BYTES)
        return
    if how == "silent":  # parked at an agent whose worker has not started: until it gives up
        while conn.recv(4096):
            pass
        return
    dp.handshake(conn, KEY, JOB, EPOCH, dp.ROLE_ACCEPT, 0)
    if how == "close after the handshake":
        return
    resume.exchange(conn, resume.State(0, 0, 0), 20)
    conn.sendall(_frame(0, 1, 8, torch.full((4,), 2.0)))  # "serve": a frame each way
    tag, t = _read_frame(conn)
    assert tag == 7
    got.append(t)
    conn.recv(1)  # until the mesh closes


@contextmanager
def _raw_rank0(script: list[str]) -> Iterator[tuple[str, list[torch.Tensor], list[str]]]:
    """A listener that treats its successive connections as `script` says; yields its
    address, the tensors rank 1 sent it and what it did so far."""
    lsock = socket.create_server(("127.0.0.1", 0))
    addr = f"127.0.0.1:{lsock.getsockname()[1]}"
    got: list[torch.Tensor] = []
    done: list[str] = []

    def run() -> None:
        for how in script:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            with conn:
                try:
                    _serve(conn, how, got)
                except OSError:
                    pass
            done.append(how)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield addr, got, done
    finally:
        lsock.close()


def _dialer(addr: str) -> Mesh:
    return Mesh(TransportConfig(JOB, EPOCH, SECRET, {0: addr, 1: None},
                                timeout=timedelta(seconds=60)), 1)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("first", [["close at once"], ["close after the hello"],
                                   ["close after the handshake"],
                                   ["close at once", "close after the hello"]])
def test_a_connection_that_dies_before_its_first_frame_is_dialled_again(
        first: list[str]) -> None:
    with _raw_rank0([*first, "serve"]) as (addr, got, done):
        m1 = _dialer(addr)
        try:
            buf = torch.zeros(4)
            m1.recv(0, 0, 8, buf).wait(WAIT)  # posted first: rank 1 sends nothing before
            assert torch.equal(buf, torch.full((4,), 2.0))
            m1.send(0, 0, 7, torch.full((4,), 3.0)).wait(WAIT)
            deadline = time.monotonic() + 10
            while not got and time.monotonic() < deadline:
                time.sleep(0.01)
            assert got and torch.equal(got[0], torch.full((4,), 3.0))
            assert done == first
        finally:
            m1.close()


@pytest.mark.timeout(90)
def test_a_listener_slower_than_one_handshake_is_waited_for_by_dialling_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's failure: the listener's agent parks the connection while its worker starts,
    longer than the dialer's handshake may take; the dialer tries again instead of failing its
    receives with "timed out"."""
    monkeypatch.setattr(redial, "FIRST_HANDSHAKE_S", 0.5)  # 10 s in production
    with _raw_rank0(["silent", "silent", "serve"]) as (addr, got, done):
        m1 = _dialer(addr)
        try:
            buf = torch.zeros(4)
            m1.recv(0, 0, 8, buf).wait(WAIT)
            assert torch.equal(buf, torch.full((4,), 2.0))
            assert done == ["silent", "silent"]
        finally:
            m1.close()


def _raw_rank1(addr: str) -> socket.socket:
    sock = socket.create_connection(dp.parse_addr(addr), timeout=10)
    dp.handshake(sock, KEY, JOB, EPOCH, dp.ROLE_DIAL, 1)
    resume.exchange(sock, resume.State(0, 0, 0), 10)
    return sock


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first_closes", [False, True])
def test_the_listener_takes_a_new_connection_in_place_of_one_no_frame_crossed(
        first_closes: bool) -> None:
    addr = f"127.0.0.1:{free_port()}"
    m0 = Mesh(TransportConfig(JOB, EPOCH, SECRET, {0: addr, 1: None},
                              timeout=timedelta(seconds=60)), 0)
    try:
        buf = torch.zeros(4)
        work = m0.recv(1, 0, 7, buf)
        first = _raw_rank1(addr)  # the dialer gives up on this one (its end timed out)
        time.sleep(0.3)  # attached
        if first_closes:
            first.close()
            time.sleep(0.3)  # the listener has seen it go
        with _raw_rank1(addr) as second:
            second.sendall(_frame(1, 0, 7, torch.full((4,), 5.0)))
            work.wait(WAIT)
            assert torch.equal(buf, torch.full((4,), 5.0))
        first.close()
    finally:
        m0.close()


@pytest.mark.timeout(90)
def test_a_dial_parked_at_the_agent_past_one_handshake_reaches_the_worker_that_starts_late(
        ) -> None:
    """The issue's failure end to end: the real front and hand-off park rank 1's dial while
    rank 0's worker has not started; rank 1's first handshake gives up, the agent sweeps the
    abandoned connection, and the redial reaches the worker once it claims its epoch."""
    with contextlib.ExitStack() as stack:  # closes rank 0, rank 1, then the agent
        agent = LoopAgent(epoch=1)
        stack.callback(agent.close)
        peers: dict[int, str | None] = {0: f"127.0.0.1:{agent.port}", 1: None}
        m1 = handoff_mesh(1, peers, None)
        stack.callback(m1.close)
        sent = m1.send(0, 0, 7, torch.arange(64, dtype=torch.float32))
        # rank 0's worker is still starting, past the first try's handshake (10 s): the
        # dialer's receives used to fail here with "timed out"
        time.sleep(redial.FIRST_HANDSHAKE_S + 1.5)
        m0 = handoff_mesh(0, peers, agent.handoff.name)
        stack.callback(m0.close)
        back = torch.zeros(8)
        for work in (m1.recv(0, 0, 8, back), m0.send(1, 0, 8, torch.ones(8)), sent,
                     m0.recv(1, 0, 7, got := torch.zeros(64))):  # a frame each way
            work.wait(WAIT)
        assert got.tolist() == list(range(64)) and back.tolist() == [1.0] * 8
        assert agent.handoff.abandoned + agent.handoff.handed >= 2  # the early tries


@pytest.mark.timeout(60)
def test_a_rank_nobody_listens_for_is_named_with_its_address() -> None:
    """What a user reads when a peer's port is closed: which rank, at which address."""
    addr = f"127.0.0.1:{free_port()}"  # nothing listens there
    m1 = Mesh(TransportConfig(JOB, EPOCH, SECRET, {0: addr, 1: None},
                              timeout=timedelta(seconds=2)), 1)
    try:
        with pytest.raises(Exception) as got:
            m1.recv(0, 0, 8, torch.zeros(4)).wait(WAIT)
        assert f"rank 1 cannot reach rank 0 at {addr}: " in str(got.value)
    finally:
        m1.close()
