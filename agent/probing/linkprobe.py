"""Measures this agent's links to peers: latency by Ping, bandwidth by a streamed probe.

Latency is half the shortest round trip of several pings, after one warm-up ping that pays for
the connection set-up: the path never returns a ping early, while a busy host (two agents'
event loops, the scheduler) only ever adds to it, so the minimum is the link's own delay and
the median drifted 2 ms high on 10 ms links whenever the cores were shared.
Bandwidth comes from one continuous, paced stream: the receiver reports what arrived every
tick, the sender sums ticks into windows and stops once three windows after the first agree
(the first pays for slow start and window growth). A probe whose windows never agree (a slow,
far link stalls for a retransmission timeout whenever a packet is lost, so some windows carry
nothing and the next one a burst) ends after MAX_WINDOWS, at the size cap, or when the peer
ends the stream, and reports its best estimate marked as one (`LinkSample.estimated`). Only a
peer that moves no data at all, or does not answer, becomes an unreachable sample, never an
exception.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import random
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from dtfm import rpc
from dtfm.core import limits
from dtfm.core.limits import clip
from protos.dtfm.v1 import agent_pb2, agent_pb2_grpc, common_pb2, coordinator_pb2

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 * 1024  # fine enough to time a 5 Mbit/s link in a quarter second
# A steady flow settles within about five windows; one that has not after MAX_WINDOWS (about
# 6.7 s at the default probe_seconds of 1 s) is estimated rather than watched any longer: a
# 2 Mbit/s link with 171 ms one way still had windows of nothing after ten.
MAX_WINDOWS = 20
# Three windows within CONVERGED of each other: two could agree while the rate still ramps.
STEADY_WINDOWS = 3
CONVERGED = 0.1  # windows within 10 % of each other: the flow is steady
# A steady rate needs windows of at least this many chunks: at 2 or 3 chunks a window (a
# 1 Mbit/s trickle between stalls) one chunk is 30-50 % of the rate, and three such windows
# "agreed" on 0.87 Mbit/s for a 2.1 Mbit/s link.
MIN_CHUNKS_TO_JUDGE = 4
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
    ping_spread_s: float = 0.0,
) -> common_pb2.LinkSample:
    """Measure the directed link from this agent to `peer` (latency, bandwidth or both).

    `channel` is the caller's to keep: reusing one per peer across phases saves the TCP and
    HTTP/2 handshakes, which cost round trips on long links. A bandwidth-only probe given
    `rtt_hint_s` (the round trip from the latency pass) starts streaming at once instead of
    spending two round trips on pings. `ping_spread_s` > 0 spreads the pings over that long
    (one per slot, at a random point of it) instead of `limits.PING_SPACING_S` apart.
    """
    peer_id, address = peer.agent_id, peer.address
    sample = common_pb2.LinkSample(peer_id=peer_id, measured_unix_s=time.time())
    try:
        stub = agent_pb2_grpc.AgentStub(channel)
        rtt_s = rtt_hint_s
        if latency or rtt_s <= 0:
            first = await stub.Ping(agent_pb2.PingRequest(nonce=0, from_agent_id=my_id),
                                    timeout=PING_TIMEOUT_S, wait_for_ready=False)
            if first.agent_id and first.agent_id != peer_id:
                # one private address, two agents behind different NATs: ids tell them apart
                raise ValueError(f"{address} answered as agent {first.agent_id}, not "
                                 f"{peer_id}: another agent sits at the address {peer_id} "
                                 "advertises")
            count = max(1, ping_count) if latency else 1
            # capped: a spread of hours (or NaN) from a bad command must not hold the pass
            spread_s = min(ping_spread_s, limits.MAX_PING_SPREAD_S) if ping_spread_s > 0 else 0.0
            slot_s = spread_s / count if spread_s > 0 else limits.PING_SPACING_S
            rtts = await asyncio.gather(*(
                _ping(stub, my_id, nonce, delay_s=slot_s * (nonce - 1 + random.random()))
                for nonce in range(1, count + 1)))
            rtt_s = min(rtts)
            if latency:
                sample.delay_ms = rtt_s / 2 * 1000.0
        if bandwidth:
            rate = await _bandwidth(stub, probe_seconds, probe_max_bytes, rtt_s, peer_id)
            sample.bandwidth_gbps = rate.gbps
            sample.estimated = bool(rate.estimate_note)
            sample.estimate_note = clip(rate.estimate_note)
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


class Windows:
    """Sums the receiver's ticks into windows of at least `window_s` and judges them."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.chunk_bps = CHUNK_BYTES * 8 / window_s  # one chunk more or less in a window
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

    def typical(self) -> float:
        """The median of the windows after the first that moved data (or of all that did).

        For windows that never agreed because the flow stalled: a stalled window reads
        nothing and the one after it a burst of what the stall held back, and the median
        ignores both."""
        moving = [r for r in self.rates[1:] if r > 0] or [r for r in self.rates if r > 0]
        return statistics.median(moving) if moving else 0.0

    def stalled(self) -> int:
        """How many windows moved no data."""
        return sum(r <= 0 for r in self.rates)

    def _agree(self, rates: list[float]) -> bool:
        """Within CONVERGED of each other, or one chunk per window apart: the receiver counts
        whole chunks, so at 2 Mbit/s a window of 0.33 s holds 5 or 6 of them (17 % apart)
        however steady the flow."""
        spread = max(rates) - min(rates)
        return spread <= max(CONVERGED * max(rates), self.chunk_bps)

    def ramping(self) -> bool:
        """True until two windows after the first agree."""
        last = self.rates[1:][-2:]
        return len(last) < 2 or not self._agree(last)

    def steady(self) -> float | None:
        """The rate once STEADY_WINDOWS windows after the first moved data and agree, else
        None. A window that moved nothing is a stall, never part of a steady rate, and windows
        of fewer than MIN_CHUNKS_TO_JUDGE chunks are too coarse to call steady: a probe of
        them ends estimated, from the median of its windows."""
        last = self.rates[1:][-STEADY_WINDOWS:]
        coarse = MIN_CHUNKS_TO_JUDGE * self.chunk_bps
        if len(last) == STEADY_WINDOWS and min(last) >= coarse and self._agree(last):
            return sum(last) / len(last)
        return None


@dataclass(frozen=True)
class Rate:
    """What a bandwidth probe found: a settled rate, or an estimate and how it was made."""

    gbps: float
    estimate_note: str = ""  # empty: the windows agreed; else why not and what was taken


def inflight_limit(fastest_bps: float, rtt_s: float, tick_s: float, ramping: bool) -> int:
    """How many bytes the sender may have sent beyond what the receiver reported: the fastest
    recent rate over a round trip and two ticks, `INFLIGHT_FACTOR` times (`RAMP_FACTOR`
    while the rate still climbs), at least `MIN_INFLIGHT`."""
    factor = RAMP_FACTOR if ramping else INFLIGHT_FACTOR
    return max(MIN_INFLIGHT, int(factor * fastest_bps / 8 * (rtt_s + 2 * tick_s)))


def window_s(target_s: float, rtt_s: float, tick_s: float) -> float:
    """How long each window the probe judges lasts: `target_s / STEADY_WINDOWS`, but never
    under a round trip and a tick. TCP's rate grows once per round trip, so two windows
    inside one round trip read the same rate while it still doubles: on Seoul-Frankfurt
    (470 ms round trips, 8.9 Mbit/s) windows of 0.33 s agreed early, the climb ended at
    slow start's rate, the steady pace limit (1.5x that rate in flight) held it there, and
    the probe settled on 2.1 Mbit/s in 2 of the WAN demo's first 4 soak rounds."""
    return max(target_s / STEADY_WINDOWS, rtt_s + tick_s)


async def _bandwidth(stub: agent_pb2_grpc.AgentStub, target_s: float, cap: int,
                     rtt_s: float, peer_id: str) -> Rate:
    """Steady-state rate of one continuous, paced stream once its windows agree, else an
    estimate (see `estimate_rate`); raises ValueError only when no data arrived at all.

    A fresh connection reads low at first (slow start, and the receiver's TCP buffer grows
    only while data flows: a 30 Mbit/s path with 476 ms round trips takes about 2.5 s to
    reach its rate), so the sender keeps streaming and sums the receiver's ticks into windows
    of `target_s / STEADY_WINDOWS`; after the first window, STEADY_WINDOWS consecutive windows
    that moved data and lie within CONVERGED of each other end the probe, so the steady rate
    is watched for about `target_s`. The stream is then cancelled rather than drained: the
    pace limit keeps what is in flight within about 1.5 round trips' worth, and the next
    probe through either device counts only windows that agree, so a backlog still draining
    cannot pass for a steady rate.
    """
    tick_s = min(TICK_S, target_s / 4)
    windows = Windows(window_s(target_s, rtt_s, tick_s))
    # Once the rate settles, the pace limit follows the fastest tick of the last round trip,
    # so what is still in flight when the probe ends drains within about a round trip.
    recent: collections.deque[float] = collections.deque(
        maxlen=math.ceil((rtt_s + tick_s) / tick_s) + 1)
    stream = _PacedStream(cap, tick_s, INITIAL_INFLIGHT)
    began = time.perf_counter()
    rate: Rate | None = None
    ended, cut_short = "the peer ended the stream", True
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
        fastest = max(recent, default=0.0)
        stream.report(tick.total_bytes,
                      inflight_limit(fastest, rtt_s, tick_s, windows.ramping()))
        steady = windows.steady()
        if steady is not None:
            rate = Rate(steady / 1e9)
        elif len(windows.rates) >= MAX_WINDOWS:
            ended, cut_short = f"its {len(windows.rates)} windows never agreed", False
        elif stream.sent >= cap:
            ended = f"it reached its cap of {cap / 2**20:.0f} MiB"
        else:
            continue
        stream.stop()
        call.cancel()
        break
    elapsed = time.perf_counter() - began
    if rate is None:
        rate = estimate_rate(windows, stream.received, elapsed, ended, cut_short)
    log.info("bandwidth to %s: %.1f Mbit/s%s after %.2f s; windows of %.2f s: %s Mbit/s",
             peer_id, rate.gbps * 1e3, f" (an estimate: {rate.estimate_note})"
             if rate.estimate_note else "", elapsed, windows.window_s,
             " ".join(f"{r / 1e6:.1f}" for r in windows.rates))
    return rate


def estimate_rate(windows: Windows, received: int, elapsed_s: float, ended: str,
              cut_short: bool) -> Rate:
    """The best figure of a probe whose windows never agreed; `ended` says why it stopped.

    `cut_short` (the byte cap, the peer): the flow was most likely still climbing, so its
    fastest window after the first stands for it. Watched to MAX_WINDOWS, it kept changing
    (stalls and the bursts after them), so the median of its windows that moved data does.
    Nothing received at all: the peer is unreachable (ValueError).
    """
    if received <= 0:
        raise ValueError(f"no probe data arrived in {elapsed_s:.1f} s ({ended})")
    bps = windows.best() if cut_short else windows.typical()
    how = "the fastest window after the first" if cut_short else (
        "the median of the windows that moved data")
    if bps <= 0:  # data arrived, but no window completed with any: the whole probe's average
        bps, how = received * 8 / elapsed_s, "the average over the whole probe"
    stalls = windows.stalled()
    note = (f"no steady rate: {ended}"
            + (f" ({stalls} of {len(windows.rates)} moved no data)" if stalls else "")
            + f"; took {how}, {bps / 1e6:.2f} Mbit/s")
    return Rate(bps / 1e9, note)
