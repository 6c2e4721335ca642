"""Measures this agent's links to peers: latency by Ping, bandwidth by a streamed probe.

Latency is half the shortest round trip of several pings, after one warm-up ping that pays for
the connection set-up: the path never returns a ping early, while a busy host (two agents'
event loops, the scheduler) only ever adds to it, so the minimum is the link's own delay and
the median drifted 2 ms high on 10 ms links whenever the cores were shared.
Bandwidth comes from one continuous, paced stream: the receiver reports
what arrived every tick, the sender sums ticks into windows and stops once three windows after
the first agree (the first pays for slow start and window growth), after MAX_WINDOWS, or at
the size cap. A peer that does not answer becomes an unreachable sample, never an exception.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import random
import time
from collections.abc import AsyncIterator

import grpc

from dtfm import rpc
from dtfm.core.limits import clip
from protos.dtfm.v1 import agent_pb2, agent_pb2_grpc, common_pb2, coordinator_pb2

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 * 1024  # fine enough to time a 5 Mbit/s link in a quarter second
MAX_WINDOWS = 10
# Three windows within CONVERGED of each other: two could agree while the rate still ramps.
STEADY_WINDOWS = 3
CONVERGED = 0.1  # windows within 10 % of each other: the flow is steady
# The receiver reports every TICK_S; the sender sums ticks into windows. Frequent reports let
# the sender keep little more than a round trip's worth of data in flight.
TICK_S = 0.1
INITIAL_INFLIGHT = 1024 * 1024  # before the first report: room for TCP's initial window
# While the rate still climbs, allow more in flight: TCP's windows grow only while they are
# full, so a limit that trails the measured rate would slow the climb itself.
RAMP_FACTOR = 4.0
MIN_INFLIGHT = 256 * 1024
INFLIGHT_FACTOR = 1.5  # in flight: this many times the rate over a round trip and a tick
PING_TIMEOUT_S = 5.0
# Pings to one peer start this far apart, each at a random point of its slot: every agent pings
# every peer at once, and pings fired together queue in the agents' event loops (on 2 cores, 8
# agents pinging 7 peers every 10 ms read 11 ms links 1.7 ms long).
PING_SPACING_S = 0.1


async def measure_peer(
    my_id: str,
    peer: coordinator_pb2.PeerTarget,
    channel: grpc.aio.Channel,
    ping_count: int = 5,
    probe_seconds: float = 1.0,
    probe_max_bytes: int = 256 * 1024 * 1024,
    latency: bool = True,
    bandwidth: bool = True,
    rtt_hint_s: float = 0.0,
) -> common_pb2.LinkSample:
    """Measure the directed link from this agent to `peer` (latency, bandwidth or both).

    `channel` is the caller's to keep: reusing one per peer across phases saves the TCP and
    HTTP/2 handshakes, which cost round trips on long links. A bandwidth-only probe given
    `rtt_hint_s` (the round trip from the latency pass) starts streaming at once instead of
    spending two round trips on pings.
    """
    peer_id, address = peer.agent_id, peer.address
    sample = common_pb2.LinkSample(peer_id=peer_id, measured_unix_s=time.time())
    try:
        stub = agent_pb2_grpc.AgentStub(channel)
        rtt_s = rtt_hint_s
        if latency or rtt_s <= 0:
            await stub.Ping(agent_pb2.PingRequest(nonce=0, from_agent_id=my_id),
                            timeout=PING_TIMEOUT_S, wait_for_ready=False)
            rtts = await asyncio.gather(*(
                _ping(stub, my_id, nonce, delay_s=PING_SPACING_S * (nonce - 1 + random.random()))
                for nonce in range(1, (max(1, ping_count) if latency else 1) + 1)))
            rtt_s = min(rtts)
            if latency:
                sample.delay_ms = rtt_s / 2 * 1000.0
        if bandwidth:
            sample.bandwidth_gbps = await _bandwidth(stub, probe_seconds, probe_max_bytes, rtt_s,
                                                     peer_id)
        sample.reachable = True
    except grpc.aio.AioRpcError as exc:
        sample.reachable = False
        sample.error = rpc.describe_rpc_error(exc, f"peer {peer_id} at {address}")
    except (ValueError, OSError) as exc:
        sample.reachable = False
        sample.error = f"peer {peer_id} at {address}: {exc}"
    if not sample.reachable:
        sample.error = clip(sample.error)
        log.warning("link to %s unreachable: %s", peer_id, sample.error)
    return sample


async def _ping(stub: agent_pb2_grpc.AgentStub, my_id: str, nonce: int, delay_s: float
                ) -> float:
    """One timed round trip after `delay_s`; a peer's pings overlap unless its RTT is short."""
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
    router queues); when the probe ends that backlog still drains for seconds and delays
    whoever measures next. The limit follows the measured rate (see `_bandwidth`), so what is in
    flight stays within about 1.5 round trips' worth.
    """

    def __init__(self, cap: int, tick_s: float, limit: int) -> None:
        self.cap = cap
        self.tick_s = tick_s
        self.limit = limit
        self.sent = 0
        self.received = 0
        self.stopped = False
        self._wake = asyncio.Event()

    def report(self, received: int, limit: int) -> None:
        self.received = received
        self.limit = limit
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
            yield agent_pb2.ProbeChunk(payload=chunk, window_s=self.tick_s if first else 0.0)
            first = False
            self.sent += CHUNK_BYTES


class _Windows:
    """Sums the receiver's ticks into windows of at least `window_s` and judges them."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.rates: list[float] = []  # bit/s of each completed window
        self._bytes = 0
        self._seconds = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        self._bytes += nbytes
        self._seconds += seconds
        if self._seconds >= self.window_s * 0.999:
            self.rates.append(self._bytes * 8 / self._seconds)
            self._bytes, self._seconds = 0, 0.0

    def best(self) -> float:
        """The fastest window after the first (or the first, if it is all there is)."""
        return max(self.rates[1:] or self.rates or [0.0])

    def ramping(self) -> bool:
        """True until two windows after the first agree."""
        last = self.rates[1:][-2:]
        return len(last) < 2 or max(last) - min(last) > CONVERGED * max(last)

    def steady(self) -> float | None:
        """The rate once STEADY_WINDOWS windows after the first agree, else None."""
        last = self.rates[1:][-STEADY_WINDOWS:]
        if len(last) == STEADY_WINDOWS and max(last) - min(last) <= CONVERGED * max(last):
            return sum(last) / len(last)
        return None


async def _bandwidth(stub: agent_pb2_grpc.AgentStub, target_s: float, cap: int,
                     rtt_s: float, peer_id: str) -> float:
    """Steady-state rate in Gbit/s of one continuous, paced stream, once its windows agree.

    A fresh connection reads low at first (slow start, and the receiver's TCP buffer grows
    only while data flows: a 30 Mbit/s path with 476 ms round trips takes about 2.5 s to
    reach its rate), so the sender keeps streaming and sums the receiver's ticks into windows
    of `target_s / STEADY_WINDOWS`; after the first window, STEADY_WINDOWS consecutive windows
    within CONVERGED of each other end the probe, so the steady rate is watched for about
    `target_s`. The stream is then cancelled rather than drained: the pace limit keeps what
    is in flight within about 1.5 round trips' worth, and the next probe through either
    device counts only windows that agree, so a backlog still draining cannot pass for a
    steady rate.
    """
    tick_s = min(TICK_S, target_s / 4)
    windows = _Windows(target_s / STEADY_WINDOWS)
    # Once the rate settles, the pace limit follows the fastest tick of the last round trip,
    # so what is still in flight when the probe ends drains within about a round trip.
    recent: collections.deque[float] = collections.deque(
        maxlen=math.ceil((rtt_s + tick_s) / tick_s) + 1)
    stream = _PacedStream(cap, tick_s, INITIAL_INFLIGHT)
    began = time.perf_counter()
    result: float | None = None
    call = stub.Probe(stream.chunks(), timeout=max(60.0, 40 * target_s))
    while True:
        try:
            tick = await asyncio.wait_for(call.read(), PING_TIMEOUT_S)
        except TimeoutError:
            call.cancel()
            raise ValueError(f"the peer sent no report for {PING_TIMEOUT_S:.0f} s "
                             f"(it reports every {tick_s:.2f} s)") from None
        if tick is grpc.aio.EOF:
            break
        windows.add(tick.bytes, tick.seconds)
        if tick.seconds > 0:
            recent.append(tick.bytes * 8 / tick.seconds)
        rate = max(recent, default=0.0)
        factor = RAMP_FACTOR if windows.ramping() else INFLIGHT_FACTOR
        limit = max(MIN_INFLIGHT, int(factor * rate / 8 * (rtt_s + 2 * tick_s)))
        stream.report(tick.total_bytes, limit)
        result = windows.steady()
        if result is None and (len(windows.rates) >= MAX_WINDOWS or stream.sent >= cap):
            result = windows.best()
        if result is not None:
            stream.stop()
            call.cancel()
            break
    if result is None:  # the peer ended the stream early
        result = windows.best()
    log.info("bandwidth to %s: %.1f Mbit/s after %.2f s; windows of %.2f s: %s Mbit/s",
             peer_id, (result or 0) / 1e6, time.perf_counter() - began, windows.window_s,
             " ".join(f"{r / 1e6:.1f}" for r in windows.rates))
    if not result:
        raise ValueError(
            f"the probe ended after {len(windows.rates)} window(s) without a rate")
    return result / 1e9
