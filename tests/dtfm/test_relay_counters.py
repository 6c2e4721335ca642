"""The relay's counters (issue 32): payload bytes forwarded per job, and bytes refused from
connections that are not members, which must never be forwarded. They reach the job's
status (`coordinator status --json`) and the coordinator's Prometheus series. Real relay,
real meshes on loopback; the job reads the relay it would serve."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest
import torch
from prometheus_client import generate_latest

from coordinator.commands.status import status_to_json
from coordinator.daemon.metrics import coordinator_registry
from dtfm.net import dataplane as dp
from dtfm.net.punch import partner_address
from dtfm.net.relay import Relay
from protos.dtfm.v1 import coordinator_pb2
from tests.agent.worker.test_transport import _intrude
from tests.coordinator.test_metrics import _cluster, _samples
from tests.dtfm.test_relay_keys import EPOCH_SECRET, JOIN_TOKEN, _mesh, _wait_rejected

pytestmark = pytest.mark.timeout(60)


def _send(relay_addr: str, job: str, floats: int) -> None:
    """Rank 0 sends `floats` float32s to rank 1 of `job` through the relay."""
    a, b = _mesh(0, relay_addr, EPOCH_SECRET, job), _mesh(1, relay_addr, EPOCH_SECRET, job)
    try:
        got = torch.zeros(floats)
        recv = b.recv(0, 0, 3, got)
        a.send(1, 0, 3, torch.arange(float(floats))).wait(timedelta(seconds=8))
        recv.wait(timedelta(seconds=8))
        assert torch.equal(got, torch.arange(float(floats)))
    finally:
        a.close()
        b.close()


def test_relay_counts_payload_per_job_and_refuses_non_members() -> None:
    relay = Relay(pair_timeout_s=5)
    relay.admit("job-a", 1, EPOCH_SECRET, world_size=2)
    relay.admit("job-b", 1, EPOCH_SECRET, world_size=2)
    addr = relay.start_in_thread()
    try:
        _send(addr, "job-a", 1000)
        _send(addr, "job-b", 10)
        assert relay.forwarded("job-a") == 4000  # payload only, frame headers not counted
        assert relay.forwarded("job-b") == 40
        assert relay.forwarded("job-c") == 0
        assert relay.forwarded_bytes == 4040
        assert relay.refused_bytes == 0
        # a join-token holder that is no member: its hello and proof are read, then dropped
        _intrude(addr, JOIN_TOKEN, "job-a", target=0)
        _wait_rejected(relay, 1)
        assert relay.refused_bytes == dp.HELLO_BYTES + dp.PROOF_BYTES
        # a job the relay was never told about: dropped after its hello
        _intrude(addr, EPOCH_SECRET, "job-x", target=0)
        _wait_rejected(relay, 2)
        assert relay.refused_bytes == 2 * dp.HELLO_BYTES + dp.PROOF_BYTES
        assert relay.forwarded("job-a") == 4000 and relay.forwarded("job-x") == 0
    finally:
        relay.stop()


def _dial(addr: str, rank: int, target: int) -> socket.socket:
    """A member's circuit to the relay: rank `rank` of job-a's epoch 1, for `target`."""
    s = socket.create_connection(dp.parse_addr(addr), timeout=5)
    hello = dp.new_hello(dp.ROLE_DIAL, "job-a", 1, rank, target)
    s.sendall(hello.pack())
    theirs = dp.Hello.unpack(dp.recv_exact(s, dp.HELLO_BYTES))
    dp.recv_exact(s, dp.PROOF_BYTES)
    s.sendall(dp.proof(dp.derive_key(EPOCH_SECRET, "job-a", 1), hello, theirs))
    return s


def test_relay_refuses_a_frame_naming_another_epoch_and_forwards_none_of_it() -> None:
    relay = Relay(pair_timeout_s=5)
    relay.admit("job-a", 1, EPOCH_SECRET, world_size=2)
    addr = relay.start_in_thread()
    try:
        with _dial(addr, 0, 1) as a, _dial(addr, 1, 0) as b:
            for me, end, peer in ((0, a, 1), (1, b, 0)):  # paired: where the other dialled from
                seen = partner_address(end, dp.job_digest("job-a"), 1, me, peer, 5)
                assert seen == f"127.0.0.1:{(b if end is a else a).getsockname()[1]}"
            # a member (it holds the epoch's key) sends a frame of epoch 2 on its epoch-1
            # circuit: the header is read and refused, its payload never read or forwarded
            a.sendall(dp.Header(dp.job_digest("job-a"), 2, 0, 1, 0, 5, 64).pack())
            a.sendall(bytes(64))
            deadline = time.monotonic() + 10
            while relay.refused_bytes == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert b.recv(1) == b""  # the relay closed the pair, having sent b nothing more
    finally:
        relay.stop()
    assert relay.refused_bytes == dp.HEADER_BYTES
    assert relay.forwarded("job-a") == 0 and relay.forwarded_bytes == 0


def hello_only(addr: str, job: str, epoch: int) -> None:
    """Dial the relay as rank 0 of `job`'s `epoch` for rank 1, and wait to be closed."""
    with socket.create_connection(dp.parse_addr(addr), timeout=5) as s:
        s.sendall(dp.new_hello(dp.ROLE_DIAL, job, epoch, 0, 1).pack())
        while s.recv(4096):
            pass


def test_a_dial_for_a_retired_or_adopted_epoch_is_stale_not_an_intrusion() -> None:
    """Members of an ending epoch still move pairs to the relay (a coordinator restart
    leaves the adopted epoch with no key here): refused after their hello, counted apart.
    A job the relay never heard of stays an intrusion."""
    relay = Relay(pair_timeout_s=5)
    relay.admit("job-a", 1, EPOCH_SECRET, world_size=2)
    relay.retire("job-a", before_epoch=1)  # retires nothing: epoch 1 is served below
    relay.admit("job-z", 3, EPOCH_SECRET, world_size=2)
    relay.retire("job-z", before_epoch=3)
    relay.retire("job-b", before_epoch=5)  # what an adoption of job-b's epoch 4 tells it
    addr = relay.start_in_thread()
    try:
        for job, epoch in (("job-z", 2), ("job-z", 1), ("job-b", 4)):
            hello_only(addr, job, epoch)
        deadline = time.monotonic() + 10
        while relay.stale_dials < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (relay.stale_dials, relay.rejected, relay.refused_bytes) == (3, 0, 0)
        hello_only(addr, "job-b", 5)  # not retired, never admitted
        hello_only(addr, "job-c", 1)
        _wait_rejected(relay, 2)
        assert relay.refused_bytes == 2 * dp.HELLO_BYTES and relay.stale_dials == 3
        _send(addr, "job-a", 10)  # the admitted epoch is served as before
        assert relay.forwarded("job-a") == 40
    finally:
        relay.stop()


def test_status_and_metrics_show_the_relays_counters() -> None:
    registry, job, links = _cluster()
    relay = Relay(pair_timeout_s=5)
    relay.admit(job.job_id, 1, EPOCH_SECRET, world_size=2)
    addr = relay.start_in_thread()
    job.dataplane.relay = relay  # what `coordinator start` serves (DataPlanes.start_relay)
    relay.retire("job-old", before_epoch=2)
    try:
        _send(addr, job.job_id, 250)
        _intrude(addr, JOIN_TOKEN, job.job_id, target=0)
        _wait_rejected(relay, 1)
        hello_only(addr, "job-old", 1)  # a member of an ending epoch: stale, not refused
        deadline = time.monotonic() + 10
        while relay.stale_dials < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        relay.stop()
    status = status_to_json(coordinator_pb2.ClusterStatus(job=job.status()))
    refused = dp.HELLO_BYTES + dp.PROOF_BYTES
    assert status["job"]["relay"] == {"forwarded_bytes": 1000, "refused_bytes": refused}
    samples = _samples(generate_latest(coordinator_registry(registry, job, links)))
    labels = (("job_id", job.job_id), ("model", "gpt-tiny"))
    assert samples[("dtfm_relay_forwarded_bytes_total", labels)] == 1000
    assert samples[("dtfm_relay_refused_bytes_total", ())] == refused
    assert samples[("dtfm_relay_stale_dials_total", ())] == 1


def test_a_job_without_a_relay_reports_zero() -> None:
    registry, job, links = _cluster()
    assert job.dataplane.relay is None
    status = status_to_json(coordinator_pb2.ClusterStatus(job=job.status()))
    assert status["job"]["relay"] == {"forwarded_bytes": 0, "refused_bytes": 0}
