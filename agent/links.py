"""Measures this agent's links to peers: latency by Ping, bandwidth by a streamed probe.

Latency is half the median round trip of several pings, after one warm-up ping that pays for
the connection set-up. Bandwidth comes from one continuous stream: the receiver
reports the arrival rate of each window of time, and the sender stops once three windows after
the first agree (the first pays for slow start and window growth) or the size cap is hit.
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

CHUNK_BYTES = 16 * 1024  # fine enough to time a 5 Mbit/s link in a quarter second
MAX_WINDOWS = 10
# Three windows within CONVERGED of each other: two could agree while the rate still ramps.
STEADY_WINDOWS = 3
INITIAL_INFLIGHT = 4 * 1024 * 1024
CONVERGED = 0.1  # windows within 10 % of each other: the flow is steady
PING_TIMEOUT_S = 5.0
PING_SPACING_S = 0.01


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
        rtt_s = await _ping(stub, my_id, 1, delay_s=0.0)
        if latency:
            rtts = await asyncio.gather(*(
                _ping(stub, my_id, nonce, delay_s=PING_SPACING_S * nonce)
                for nonce in range(1, max(1, ping_count) + 1)))
            sample.delay_ms = statistics.median(rtts) / 2 * 1000.0
        if bandwidth:
            sample.bandwidth_gbps = await _bandwidth(stub, probe_seconds, probe_max_bytes, rtt_s)
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


class _PacedStream:
    """The probe's payload, never more than `limit` bytes ahead of what the peer reported.

    Without a limit the sender fills every buffer on the path (HTTP/2 window, socket buffers,
    router queues); when the probe ends that backlog still drains for seconds and delays the
    acknowledgements of the next measurement on the reverse link.
    """

    def __init__(self, cap: int, window_s: float, limit: int) -> None:
        self.cap = cap
        self.window_s = window_s
        self.limit = limit
        self.sent = 0
        self.received = 0
        self.stopped = False
        self._wake = asyncio.Event()

    def report(self, received: int, limit: int) -> None:
        self.received = received
        self.limit = max(self.limit, limit)
        self._wake.set()

    def stop(self) -> None:
        self.stopped = True
        self._wake.set()

    async def chunks(self) -> AsyncIterator[agent_pb2.ProbeChunk]:
        chunk = b"\0" * CHUNK_BYTES
        first = True
        while self.sent < self.cap and not self.stopped:
            if self.sent - self.received >= self.limit:
                self._wake.clear()
                await self._wake.wait()
                continue
            yield agent_pb2.ProbeChunk(payload=chunk, window_s=self.window_s if first else 0.0)
            first = False
            self.sent += CHUNK_BYTES


async def _bandwidth(stub: agent_pb2_grpc.AgentStub, target_s: float, cap: int,
                     rtt_s: float) -> float:
    """Steady-state rate in Gbit/s of one continuous, paced stream, once its windows agree.

    A fresh connection reads low at first (the receiver's TCP buffer and the HTTP/2 window
    grow only while data flows: a 64 Mbit/s, 240 ms path read 14 Mbit/s in its first
    second), so the sender keeps streaming and the receiver reports each window's arrival
    rate; after the first window, STEADY_WINDOWS consecutive windows within CONVERGED of each
    other end the probe. The sender then waits until the receiver has everything, so the
    link is quiet for whoever measures next.
    """
    window_s = target_s / 2
    stream = _PacedStream(cap, window_s, INITIAL_INFLIGHT)
    rates: list[float] = []
    result: float | None = None
    call = stub.Probe(stream.chunks(), timeout=max(60.0, 40 * target_s))
    async for window in call:
        if window.seconds > 0 and window.bytes > 0:
            rates.append(window.bytes * 8 / window.seconds)
        best = max(rates, default=0.0)
        # room for what is in flight over a round trip plus a window, twice over
        stream.report(window.total_bytes, int(2 * best / 8 * (rtt_s + window_s)))
        if result is None:
            last = rates[1:][-STEADY_WINDOWS:]
            if len(last) == STEADY_WINDOWS and max(last) - min(last) <= CONVERGED * max(last):
                result = sum(last) / len(last)
            elif len(rates) >= MAX_WINDOWS or stream.sent >= cap:
                result = max(rates[1:] or rates or [0.0])
            if result is not None:
                stream.stop()  # half-close; keep reading until the peer has it all
    if not result:
        raise ValueError(f"the probe ended after {len(rates)} window(s) without a rate")
    return result / 1e9
