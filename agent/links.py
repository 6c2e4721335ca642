"""Measures this agent's links to peers: latency by Ping, bandwidth by a streamed probe.

Latency is half the median round trip of several pings, after one warm-up ping that pays for
the connection set-up. Bandwidth is the rate at which the receiver saw the last two thirds of
a payload arrive (the first third pays for TCP slow start and window growth), with the payload
grown until the transfer lasts long enough to trust (about `probe_seconds`) or hits the cap.
A peer that does not answer becomes an unreachable sample,
never an exception.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import AsyncIterator

import grpc

from protos import rpc
from protos.dtfm.v1 import agent_pb2, agent_pb2_grpc, common_pb2, coordinator_pb2

log = logging.getLogger(__name__)

CHUNK_BYTES = 128 * 1024  # fine enough to time a 5 Mbit/s link to a few percent
FIRST_PROBE_BYTES = 1024 * 1024
MIN_CHUNKS = 32
MAX_PROBES = 6
CONVERGED = 0.15  # two probes within 15 % of each other: the windows are open
PING_TIMEOUT_S = 5.0
PING_SPACING_S = 0.01


async def _payload(total: int) -> AsyncIterator[agent_pb2.ProbeChunk]:
    # at least MIN_CHUNKS chunks, so the receiver's arrival times resolve a slow link too
    step = max(4096, min(CHUNK_BYTES, total // MIN_CHUNKS))
    chunk = b"\0" * step
    sent = 0
    while sent < total:
        size = min(step, total - sent)
        yield agent_pb2.ProbeChunk(payload=chunk if size == step else chunk[:size])
        sent += size


async def measure_peer(
    my_id: str,
    peer: coordinator_pb2.PeerTarget,
    channel: grpc.aio.Channel,
    ping_count: int = 5,
    probe_seconds: float = 1.0,
    probe_max_bytes: int = 256 * 1024 * 1024,
    latency: bool = True,
    bandwidth: bool = True,
) -> common_pb2.LinkSample:
    """Measure the directed link from this agent to `peer` (latency, bandwidth or both).

    `channel` is the caller's to keep: reusing one per peer across phases saves the TCP and
    HTTP/2 handshakes, which cost round trips on long links.
    """
    peer_id, address = peer.agent_id, peer.address
    sample = common_pb2.LinkSample(peer_id=peer_id, measured_unix_s=time.time())
    try:
        stub = agent_pb2_grpc.AgentStub(channel)
        await stub.Ping(agent_pb2.PingRequest(nonce=0, from_agent_id=my_id),
                        timeout=PING_TIMEOUT_S, wait_for_ready=False)
        if latency:
            rtts = await asyncio.gather(*(
                _ping(stub, my_id, nonce, delay_s=PING_SPACING_S * nonce)
                for nonce in range(1, max(1, ping_count) + 1)))
            sample.delay_ms = statistics.median(rtts) / 2 * 1000.0
        if bandwidth:
            sample.bandwidth_gbps = await _bandwidth(stub, probe_seconds, probe_max_bytes)
        sample.reachable = True
    except grpc.aio.AioRpcError as exc:
        sample.reachable = False
        sample.error = rpc.describe_rpc_error(exc, f"peer {peer_id} at {address}")
    except (ValueError, OSError) as exc:
        sample.reachable = False
        sample.error = f"peer {peer_id} at {address}: {exc}"
    if not sample.reachable:
        log.warning("link to %s unreachable: %s", peer_id, sample.error)
    return sample


async def _ping(stub: agent_pb2_grpc.AgentStub, my_id: str, nonce: int, delay_s: float
                ) -> float:
    """One timed round trip; pings overlap (spaced a little) so a phase costs ~one RTT."""
    await asyncio.sleep(delay_s)
    start = time.perf_counter()
    reply = await stub.Ping(agent_pb2.PingRequest(nonce=nonce, from_agent_id=my_id),
                            timeout=PING_TIMEOUT_S)
    rtt = time.perf_counter() - start
    if reply.nonce != nonce:
        raise ValueError(f"peer echoed nonce {reply.nonce}, expected {nonce}")
    return rtt


async def _bandwidth(stub: agent_pb2_grpc.AgentStub, target_s: float, cap: int) -> float:
    """Steady-state rate in Gbit/s: probe until two long-enough probes agree.

    A fresh connection reads low (the receiver's TCP buffer and window grow only while data
    flows: a 64 Mbit/s, 240 ms path read 14 Mbit/s on its first probe and 64 on its third),
    so a rate counts only once the next probe confirms it within CONVERGED.
    """
    size = min(FIRST_PROBE_BYTES, cap)
    rates: list[float] = []
    for _ in range(MAX_PROBES):
        result = await stub.Probe(_payload(size), timeout=max(30.0, 20 * target_s))
        if result.bytes != size:
            raise ValueError(f"peer received {result.bytes} of {size} probe bytes")
        seconds = result.first_to_last_s
        rate = result.tail_bytes * 8 / result.tail_seconds if result.tail_seconds > 0 else 0.0
        if rate > 0 and (seconds >= 0.8 * target_s or size >= cap):
            rates.append(rate)
            if len(rates) >= 2 and abs(rates[-1] - rates[-2]) <= CONVERGED * max(rates[-2:]):
                return max(rates[-2:]) / 1e9
        elif size >= cap:
            raise ValueError("probe too short to time even at the size cap")
        # aim the next probe at the target duration, by the best rate seen so far
        best = max(rates + [rate, size * 8 / max(seconds, 1e-3)])
        size = min(cap, max(size, int(1.2 * best * target_s / 8)))
    if not rates:
        raise ValueError(f"no probe lasted {0.8 * target_s:.2f} s within {MAX_PROBES} tries")
    return max(rates) / 1e9
