"""A peer whose worker starts late is waited for up to the ceiling, not the start-up budget.

A CI run under load: the liar's worker of tests/system/test_data_port_lie.py waited 60 s (the
start-up budget) for its peer's first message while that peer's agent was still starting its
worker (26 s unloaded, over 60 s loaded), and the epoch failed on a timeout that blamed no one.
Gloo's rendezvous waits out a late joiner up to the ceiling; the dtfm transport has no
rendezvous, so the first connection of an epoch is its join (`peer.Peer.joining`). Real
`Mesh`es on loopback.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from agent.worker.transport import TransportConfig
from agent.worker.transport.mesh import Mesh
from dtfm.rpc import free_port

SECRET, JOB, EPOCH = b"join-token-of-the-test", "job-j", 1
LIMIT = timedelta(seconds=0.5)  # the step's deadline in these tests


def _mesh(rank: int, addr: str, ceiling_s: float) -> Mesh:
    return Mesh(TransportConfig(JOB, EPOCH, SECRET, {0: addr, 1: None},
                                timeout=timedelta(seconds=ceiling_s)), rank)


@pytest.mark.timeout(60)
def test_a_receive_waits_for_a_peer_that_connects_after_its_limit() -> None:
    addr = f"127.0.0.1:{free_port()}"
    m0 = _mesh(0, addr, ceiling_s=30)
    try:
        got = torch.zeros(4)
        work = m0.recv(1, 0, 1, got)
        late: list[Mesh] = []

        def start_late() -> None:  # rank 1's worker is still starting: four of the limits
            time.sleep(2.0)
            late.append(_mesh(1, addr, ceiling_s=30))
            late[0].send(0, 0, 1, torch.full((4,), 7.0))

        starter = threading.Thread(target=start_late)
        starter.start()
        try:
            assert work.wait(LIMIT)
            assert torch.equal(got, torch.full((4,), 7.0))
            assert work.stalled_s > 1.0, work.stalled_s  # said how long the join took
            # joined: a peer merely slow from now on times out at the limit, as ever
            slow = m0.recv(1, 0, 2, torch.zeros(4))
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match=r"timed out after 0.5 s$"):
                slow.wait(LIMIT)
            assert time.monotonic() - t0 < 5
        finally:
            starter.join()
            for m in late:
                m.close()
    finally:
        m0.close()


@pytest.mark.timeout(60)
def test_a_peer_that_never_connects_is_given_up_on_after_the_ceiling() -> None:
    m0 = _mesh(0, f"127.0.0.1:{free_port()}", ceiling_s=3)
    try:
        work = m0.recv(1, 0, 1, torch.zeros(4))
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 did not connect to rank 0 within "):
            work.wait(LIMIT)
        waited = time.monotonic() - t0
        assert 2.5 < waited < 10, waited  # the ceiling (3 s, from the mesh's start), not 0.5 s
        assert not m0.peers[1].joining()
    finally:
        m0.close()
