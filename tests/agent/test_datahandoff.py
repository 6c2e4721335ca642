"""Data-plane connections accepted on the agent's one port reach the epoch's worker mesh
(agent/datahandoff.py, dtfm/front.py): the agent's front and handoff run on an event loop
thread, the ranks are real `Mesh`es on real sockets, the accepting rank listens nowhere."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch

from agent.datahandoff import DataHandoff
from agent.server import data_router
from agent.worker.transport import TransportConfig
from agent.worker.transport.mesh import Mesh
from dtfm.core import dataplane as dp
from dtfm.front import Front

pytestmark = pytest.mark.timeout(60)
SECRET = b"join-token-of-the-handoff-test"


class _Agent:
    """A front and a handoff on their own loop, as the agent daemon holds them."""

    def __init__(self, wait_s: float = 20.0) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.handoff = DataHandoff(wait_s=wait_s)
        self.front = Front(data_router(self.handoff, None))
        self.call(self.handoff.start())
        self.port = self.call(self.front.start("127.0.0.1", 0, "no-grpc-here"))

    def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def close(self) -> None:
        self.call(self.front.aclose())
        self.call(self.handoff.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def agent() -> Iterator[_Agent]:
    a = _Agent()
    try:
        yield a
    finally:
        a.close()


def _mesh(rank: int, peers: dict[int, str | None], handoff: str | None,
          epoch: int = 1) -> Mesh:
    return Mesh(TransportConfig("job-a", epoch, SECRET, peers, handoff=handoff,
                                timeout=timedelta(seconds=20)), rank)


def _wait(cond: Any, what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _closed(s: socket.socket) -> bool:
    """Whether the other end closed `s` (an unread hello makes the kernel reset instead)."""
    s.settimeout(10)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_peer_dialling_the_agents_port_reaches_the_worker_even_before_it_starts(
        agent: _Agent) -> None:
    peers: dict[int, str | None] = {0: f"127.0.0.1:{agent.port}", 1: None}
    m1 = _mesh(1, peers, None)  # the dialler starts first: the agent holds its connection
    try:
        sent = m1.send(0, 0, 7, torch.arange(1 << 16, dtype=torch.float32))
        _wait(lambda: agent.front.data_connections == 1, "the front to take the hello")
        m0 = _mesh(0, peers, agent.handoff.name)
        try:
            got = torch.zeros(1 << 16)
            m0.recv(1, 0, 7, got).wait(timedelta(seconds=10))
            sent.wait(timedelta(seconds=10))
            assert torch.equal(got, torch.arange(1 << 16, dtype=torch.float32))
            back = torch.zeros(4)
            m0.send(1, 0, 8, torch.ones(4)).wait(timedelta(seconds=10))
            m1.recv(0, 0, 8, back).wait(timedelta(seconds=10))
            assert torch.equal(back, torch.ones(4))
            assert agent.handoff.handed == 1 and m0.rejected == 0
        finally:
            m0.close()
    finally:
        m1.close()


def test_a_peer_without_the_key_is_dropped_by_the_worker_before_any_frame(
        agent: _Agent) -> None:
    peers: dict[int, str | None] = {0: f"127.0.0.1:{agent.port}", 1: None}
    m0 = _mesh(0, peers, agent.handoff.name)
    try:
        buf = torch.zeros(16)
        work = m0.recv(1, 0, 5, buf)
        with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as s:
            hello = dp.new_hello(dp.ROLE_DIAL, "job-a", 1, 1)
            s.sendall(hello.pack())
            theirs = dp.Hello.unpack(dp.recv_exact(s, dp.HELLO_BYTES))
            try:  # the worker closes on us: a write may already fail
                s.sendall(dp.proof(dp.derive_key(b"not-the-token", "job-a", 1), hello, theirs))
                s.sendall(dp.Header(dp.job_digest("job-a"), 1, 1, 0, 0, 5, 64).pack())
                s.sendall(torch.full((16,), 666.0).numpy().tobytes())
                dp.recv_exact(s, dp.PROOF_BYTES)  # the worker's own proof, then the close
                assert s.recv(1) == b""
            except (ConnectionError, OSError):
                pass
        _wait(lambda: m0.rejected == 1, "the worker to refuse the intruder")
        assert not work.is_completed() and torch.count_nonzero(buf) == 0
    finally:
        m0.close()


def test_a_connection_for_an_epoch_no_worker_claims_is_closed_after_the_wait() -> None:
    agent = _Agent(wait_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as s:
            s.sendall(dp.new_hello(dp.ROLE_DIAL, "job-a", 9, 1).pack())
            assert _closed(s)  # closed, not left hanging
        _wait(lambda: agent.handoff.dropped == 1, "the handoff to drop it")
        # a relay circuit on an agent that serves no relay is closed at once
        with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as s:
            s.sendall(dp.new_hello(dp.ROLE_DIAL, "job-a", 9, 1, 2).pack())
            assert _closed(s)
    finally:
        agent.close()
