"""The coordinator's relay holds one key per admitted epoch (issue 32): only members holding
that epoch's secret get a circuit, only between the epoch's ranks, and retired or evicted
epochs are refused. Real sockets and meshes on loopback, no mocks."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

from agent.worker.transport import TransportConfig
from agent.worker.transport.mesh import Mesh
from dtfm.net import dataplane as dp
from dtfm.net.relay import Relay
from dtfm.procs import wait_for
from tests.agent.worker.test_transport import _intrude

EPOCH_SECRET = b"fresh-bytes-of-epoch-1"
JOIN_TOKEN = b"the-cluster-join-token"


def _mesh(rank: int, relay: str, secret: bytes, job: str = "job-a") -> Mesh:
    cfg = TransportConfig(job, 1, secret, {0: None, 1: None}, relay=relay,
                          timeout=timedelta(seconds=8))
    return Mesh(cfg, rank)


def _wait_rejected(relay: Relay, n: int) -> None:
    deadline = time.monotonic() + 10
    while relay.rejected < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert relay.rejected == n


@pytest.mark.timeout(60)
def test_admitted_epoch_relays_and_the_join_token_does_not() -> None:
    relay = Relay(pair_timeout_s=5)  # no fallback secret: admitted epochs only
    relay.admit("job-a", 1, EPOCH_SECRET, world_size=2)
    addr = relay.start_in_thread()
    try:
        _intrude(addr, JOIN_TOKEN, "job-a", target=0)  # holds the token, not the epoch's key
        _wait_rejected(relay, 1)
        _intrude(addr, EPOCH_SECRET, "job-b", target=0)  # a job the relay does not know
        _wait_rejected(relay, 2)
        a, b = _mesh(0, addr, EPOCH_SECRET), _mesh(1, addr, EPOCH_SECRET)
        try:
            got = torch.zeros(100)
            recv = b.recv(0, 0, 3, got)
            a.send(1, 0, 3, torch.arange(100.0)).wait(timedelta(seconds=8))
            recv.wait(timedelta(seconds=8))
            assert torch.equal(got, torch.arange(100.0))
            assert relay.forwarded_bytes == 400
        finally:
            a.close()
            b.close()
    finally:
        relay.stop()


@pytest.mark.timeout(60)
def test_relay_refuses_ranks_outside_the_epoch_and_retired_epochs() -> None:
    relay = Relay(pair_timeout_s=5)
    relay.admit("job-a", 1, EPOCH_SECRET, world_size=2)
    addr = relay.start_in_thread()
    try:
        # holds the key, but claims rank 1 -> target 5 of a 2-rank epoch
        _intrude(addr, EPOCH_SECRET, "job-a", target=5)
        _wait_rejected(relay, 1)
        relay.retire("job-a", before_epoch=2)
        assert relay.epochs() == []
        _intrude(addr, EPOCH_SECRET, "job-a", target=0)  # refused after its hello, as a
        wait_for(lambda: relay.stale_dials == 1, 10, "the dial of a retired epoch")  # stale one
        assert relay.rejected == 1 and relay.forwarded_bytes == 0
    finally:
        relay.stop()


def test_relay_holds_at_most_max_keys_and_retires_per_job() -> None:
    relay = Relay(max_keys=3)
    for epoch in range(1, 5):
        relay.admit("job-a", epoch, EPOCH_SECRET, world_size=4)
    assert [e for _, e in relay.epochs()] == [2, 3, 4]  # the oldest was dropped
    relay.admit("job-b", 1, EPOCH_SECRET, world_size=2)
    relay.retire("job-a", before_epoch=4)
    assert relay.epochs() == [(dp.job_digest("job-a"), 4), (dp.job_digest("job-b"), 1)]
    relay.retire("job-b")
    assert relay.epochs() == [(dp.job_digest("job-a"), 4)]
    with pytest.raises(ValueError, match="world_size"):
        relay.admit("job-a", 5, EPOCH_SECRET, world_size=0)
    with pytest.raises(ValueError, match="secret"):
        relay.admit("job-a", 5, b"", world_size=2)
