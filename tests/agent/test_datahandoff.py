"""Data-plane connections accepted on the agent's one port reach the epoch's worker mesh
(dtfm/net/handoff.py, dtfm/net/front.py): the agent's front and handoff run on an event loop
thread, the ranks are real `Mesh`es on real sockets, the accepting rank listens nowhere."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch

from dtfm.net import dataplane as dp
from tests.agent.handoffs import JOB, LoopAgent, closed, dial_hello, mesh, wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def agent() -> Iterator[LoopAgent]:
    a = LoopAgent()
    try:
        yield a
    finally:
        a.close()


def test_a_peer_dialling_the_agents_port_reaches_the_worker_even_before_it_starts(
        agent: LoopAgent) -> None:
    peers: dict[int, str | None] = {0: f"127.0.0.1:{agent.port}", 1: None}
    m1 = mesh(1, peers, None)  # the dialler starts first: the agent holds its connection
    try:
        sent = m1.send(0, 0, 7, torch.arange(1 << 16, dtype=torch.float32))
        wait_for(lambda: agent.front.data_connections == 1, "the front to take the hello")
        m0 = mesh(0, peers, agent.handoff.name)
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
        agent: LoopAgent) -> None:
    peers: dict[int, str | None] = {0: f"127.0.0.1:{agent.port}", 1: None}
    m0 = mesh(0, peers, agent.handoff.name)
    try:
        buf = torch.zeros(16)
        work = m0.recv(1, 0, 5, buf)
        with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as s:
            hello = dp.new_hello(dp.ROLE_DIAL, JOB, 1, 1)
            s.sendall(hello.pack())
            theirs = dp.Hello.unpack(dp.recv_exact(s, dp.HELLO_BYTES))
            try:  # the worker closes on us: a write may already fail
                s.sendall(dp.proof(dp.derive_key(b"not-the-token", JOB, 1), hello, theirs))
                s.sendall(dp.Header(dp.job_digest(JOB), 1, 1, 0, 0, 5, 64).pack())
                s.sendall(torch.full((16,), 666.0).numpy().tobytes())
                dp.recv_exact(s, dp.PROOF_BYTES)  # the worker's own proof, then the close
                assert s.recv(1) == b""
            except (ConnectionError, OSError):
                pass
        wait_for(lambda: m0.rejected == 1, "the worker to refuse the intruder")
        assert not work.is_completed() and torch.count_nonzero(buf) == 0
    finally:
        m0.close()


def test_a_connection_for_its_epoch_that_no_worker_claims_is_closed_after_the_wait() -> None:
    agent = LoopAgent(epoch=9, wait_s=0.5)
    try:
        with dial_hello(agent.port, 9) as s:
            assert closed(s)  # closed, not left hanging
        wait_for(lambda: agent.handoff.dropped == 1, "the handoff to drop it")
        # a relay circuit on an agent that serves no relay is closed at once
        with dial_hello(agent.port, 9, target=2) as s:
            assert closed(s)
    finally:
        agent.close()
