"""The coordinator answers link probes as the relay: an agent measures its link to it with the
very code it measures peers with (agent/probing/linkprobe.py), over real gRPC on loopback."""

from __future__ import annotations

import asyncio

import pytest

from agent.probing.linkprobe import measure_peer
from coordinator.links import relayprobe
from coordinator.links.relayed import RELAY
from dtfm import rpc
from protos.dtfm.v1 import coordinator_pb2

pytestmark = pytest.mark.timeout(60)
SECURITY = rpc.Security(token="relay-probe-test-token")


async def _probe(token: str) -> tuple[object, ...]:
    server, port, _ = await rpc.start_server("127.0.0.1:0", SECURITY, relayprobe.register,
                                             "test coordinator")
    try:
        address = f"127.0.0.1:{port}"
        async with rpc.open_channel(address, rpc.Security(token=token)) as channel:
            sample = await measure_peer("n2", coordinator_pb2.PeerTarget(
                agent_id=RELAY, address=address), channel, ping_count=3, probe_seconds=0.3)
        return (sample,)
    finally:
        await server.stop(0)


def test_an_agent_measures_its_link_to_the_relay_like_a_peer_s() -> None:
    (sample,) = asyncio.run(_probe(SECURITY.token))
    assert sample.reachable, sample.error
    assert sample.peer_id == RELAY
    assert sample.delay_ms > 0 and sample.bandwidth_gbps > 0


def test_the_relay_answers_no_probe_without_the_join_token() -> None:
    (sample,) = asyncio.run(_probe("not-the-token"))
    assert not sample.reachable
    assert "token" in sample.error.lower() or "unauthenticated" in sample.error.lower(), \
        sample.error
