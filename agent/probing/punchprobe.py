"""Measures a hole-punched direct path to a peer nobody can dial, at link measurement.

Two agents that can dial neither way (a "stranded pair", coordinator/links/relayed.py) meet
at a relay at epoch time and try a hole punch (dtfm/net/punch.py). Without knowing the
direct path's figures the scheduler could only price such a pair through the relay, an upper
bound: two NATed agents in one city with a fast direct link were placed as if two relay hops
apart. So, when the coordinator measures links, it asks both agents of each stranded pair at
once (`MEASURE_KIND_PUNCH`, `MeasureLinksCommand.punch`) to do what the data plane does:

1. dial the relay from a reusable port, prove the pseudo-job's key (a fresh secret the
   coordinator sent these two agents only, admitted at its relay for this probe and retired
   after it) and hear where the relay saw the peer (`punch.partner_address`);
2. punch (`punch.punch`, without weighing against the relay: the direct path is what is
   measured here);
3. on the direct connection, time `ping_count` small round trips each way (the delay is half
   the least), then a bulk transfer each way in turn, never both at once (the
   acknowledgements of one would queue behind the other's data). The receiver sums what
   arrives into windows (`linkprobe.Windows`, the gRPC probe's judge) and says "stop" once
   they agree; the sender stops then, at `probe_max_bytes`, or after `MAX_WINDOWS` windows,
   and the receiver sends back the rate it saw (steady, or estimated as the gRPC probe
   estimates). Each end reports its own direction: its delay and the rate the peer received.

A punch that does not get through (a symmetric NAT, a firewall that drops the peer's SYN) is
a sample that is not reachable, with the reason: the coordinator then prices the pair
relayed, as before. All socket work is blocking and runs in a thread (`asyncio.to_thread`).
"""

from __future__ import annotations

import asyncio
import logging
import select
import socket
import struct
import time
from dataclasses import dataclass

from agent.probing.linkprobe import (
    CHUNK_BYTES,
    MAX_WINDOWS,
    STEADY_WINDOWS,
    TICK_S,
    Rate,
    Windows,
    estimate_rate,
)
from dtfm.core.assignment import relay_at
from dtfm.core.limits import clip
from dtfm.net import dataplane as dp
from dtfm.net import punch
from protos.dtfm.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)

EPOCH = 0  # a pseudo-job has one epoch
DIAL_S = 10.0  # to connect to the relay
# For the peer to arrive at the relay: both commands leave the coordinator at once, so a
# peer later than this is gone; under the coordinator's probe deadline (30 s), so this agent
# reports a failure rather than falling silent.
PARTNER_WAIT_S = 15.0
STEP_S = 10.0  # for each frame of the measurement on the direct connection
PING_BYTES = 8
_RATE = struct.Struct(">d")
MAX_NOTE_BYTES = 1024
_RATE_LENGTHS = range(_RATE.size, _RATE.size + MAX_NOTE_BYTES + 1)


@dataclass(frozen=True)
class Figures:
    """What this end measured of its own direction on the punched connection."""

    delay_ms: float
    rate: Rate


async def probe(my_id: str, cmd: coordinator_pb2.MeasureLinksCommand, coordinator: str
                ) -> common_pb2.LinkSample:
    """Punch through to the command's one peer and measure this end's direction; a sample
    that is not reachable says why where the punch (or the command) failed."""
    peer_id = cmd.peers[0].agent_id if len(cmd.peers) == 1 else ""
    sample = common_pb2.LinkSample(peer_id=peer_id, measured_unix_s=time.time())
    p = cmd.punch
    try:
        if not peer_id:
            raise ValueError(f"a punch probe names one peer, this one {len(cmd.peers)}")
        if not (p.relay and p.job and p.secret) or {p.rank, p.peer_rank} != {0, 1}:
            raise ValueError("the punch probe lacks its relay, pseudo-job, secret or ranks "
                             "0 and 1: the coordinator and agent run different dtfm versions")
        figures = await asyncio.to_thread(
            measure, relay_at(p.relay, coordinator), p, cmd.ping_count or 5,
            cmd.probe_seconds or 1.0, cmd.probe_max_bytes or 256 * 1024 * 1024)
    except (OSError, ValueError) as exc:  # dp.AuthError and FrameError are OSErrors
        sample.reachable = False
        sample.error = clip(f"no hole punch to {peer_id} through the relay: {exc}")
        log.info("%s: %s", my_id, sample.error)
        return sample
    sample.reachable = True
    sample.delay_ms = figures.delay_ms
    sample.bandwidth_gbps = figures.rate.gbps
    sample.estimated = bool(figures.rate.estimate_note)
    sample.estimate_note = clip(figures.rate.estimate_note)
    log.info("hole punched to %s: %.1f ms, %.1f Mbit/s%s", peer_id, figures.delay_ms,
             figures.rate.gbps * 1e3, f" ({figures.rate.estimate_note})"
             if figures.rate.estimate_note else "")
    return sample


def measure(relay: str, p: coordinator_pb2.PunchProbe, pings: int, seconds: float,
            max_bytes: int) -> Figures:
    """Blocking: meet the peer at `relay`, punch, measure. OSError (ConnectionError) where
    the punch did not get through or the connection broke."""
    key = dp.derive_key(p.secret, p.job, EPOCH)
    digest = dp.job_digest(p.job)
    me, peer = p.rank, p.peer_rank
    host, port = dp.parse_addr(relay)
    circuit = punch.dial_reusable(host, port, DIAL_S)
    try:
        circuit.settimeout(DIAL_S)
        dp.handshake(circuit, key, p.job, EPOCH, dp.ROLE_DIAL, me, peer)
        observed = punch.partner_address(circuit, digest, EPOCH, me, peer, PARTNER_WAIT_S)
        direct = punch.punch(circuit, key, p.job, EPOCH, me, peer, observed, weigh=False)
        if direct is None:
            raise ConnectionError(f"the punch to {observed} did not get through both ways")
        try:
            direct.settimeout(STEP_S)
            link = Link(direct, digest, me, peer)
            return link.run(pings, seconds, max_bytes)
        finally:
            direct.close()
    finally:
        circuit.close()


@dataclass(frozen=True)
class Link:
    """The two ends' exchange on the punched connection; the lower rank goes first."""

    sock: socket.socket
    job: bytes
    me: int
    peer: int

    def run(self, pings: int, seconds: float, max_bytes: int) -> Figures:
        first = self.me < self.peer
        rtt_s = 0.0
        for mine in (first, not first):
            if mine:
                rtt_s = min(self._ping() for _ in range(max(1, pings)))
            else:
                for _ in range(max(1, pings)):
                    self._echo()
        rate = None
        for mine in (first, not first):
            if mine:
                rate = self._send(seconds, max_bytes)
            else:
                self._receive(seconds)
        assert rate is not None
        return Figures(rtt_s / 2 * 1000.0, rate)

    def _frame(self, tag: int, payload: bytes) -> None:
        self.sock.sendall(dp.control_frame(self.job, EPOCH, self.me, self.peer, tag, payload))

    def _read(self, tag: int, lengths: range, what: str) -> bytes:
        return dp.read_control(self.sock, self.job, EPOCH, self.me, self.peer, tag, lengths,
                               f"the peer sent another frame where {what} belongs")

    def _ping(self) -> float:
        start = time.perf_counter()
        self._frame(dp.PING_TAG, bytes(PING_BYTES))
        self._read(dp.PING_TAG, range(PING_BYTES, PING_BYTES + 1), "a ping's echo")
        return time.perf_counter() - start

    def _echo(self) -> None:
        self._read(dp.PING_TAG, range(PING_BYTES, PING_BYTES + 1), "a ping")
        self._frame(dp.PING_TAG, bytes(PING_BYTES))

    def _send(self, seconds: float, max_bytes: int) -> Rate:
        """Stream frames until the receiver says stop, `max_bytes` went, or the windows'
        time is up; then the rate the receiver saw."""
        chunk = dp.control_frame(self.job, EPOCH, self.me, self.peer, dp.BULK_TAG,
                                 bytes(CHUNK_BYTES))
        end = time.monotonic() + MAX_WINDOWS * seconds / STEADY_WINDOWS
        sent, next_look, stopped = 0, 0.0, False
        while sent < max_bytes and time.monotonic() < end:
            self.sock.sendall(chunk)
            sent += CHUNK_BYTES
            if (now := time.monotonic()) >= next_look:
                next_look = now + TICK_S / 2
                if readable_now(self.sock):
                    self._read(dp.STOP_TAG, range(0, 1), "the receiver's stop")
                    stopped = True
                    break
        self._frame(dp.BULK_TAG, b"")
        # ended by bytes or time: the receiver's stop may have crossed the end
        got = self._rate() if stopped else self._read_either()
        (bps,) = _RATE.unpack(got[:_RATE.size])
        if not bps > 0:
            raise ConnectionError(f"the peer received at {bps} bit/s: no data arrived")
        return Rate(bps / 1e9, got[_RATE.size:].decode(errors="replace"))

    def _rate(self) -> bytes:
        return self._read(dp.RATE_TAG, _RATE_LENGTHS, "the rate it received at")

    def _read_either(self) -> bytes:
        """The receiver's rate, past the stop it may have sent while the end was on its way
        (the stop and the end crossed)."""
        h = dp.Header.unpack(dp.recv_exact(self.sock, dp.HEADER_BYTES))
        h.check(self.job, EPOCH, self.peer, self.me)
        if (h.stream, h.tag, h.length) == (dp.CONTROL_STREAM, dp.STOP_TAG, 0):
            return self._rate()
        if (h.stream, h.tag) != (dp.CONTROL_STREAM, dp.RATE_TAG) or h.length not in _RATE_LENGTHS:
            raise ConnectionError(f"the peer sent another frame where the rate it received "
                                  f"at belongs (tag {h.tag}, {h.length} bytes): run the same "
                                  f"dtfm everywhere")
        return dp.recv_exact(self.sock, h.length)

    def _receive(self, seconds: float) -> None:
        """Count what arrives into windows, say stop once they agree (or after MAX_WINDOWS),
        read to the end, and send back the rate: steady, or `estimate_rate`'s."""
        windows = Windows(seconds / STEADY_WINDOWS)
        received, stopped = 0, False
        tick_bytes, began = 0, None
        tick_start = 0.0
        while True:
            payload = self._read(dp.BULK_TAG, range(0, CHUNK_BYTES + 1), "bulk data")
            now = time.perf_counter()
            if not payload:
                break
            if began is None:  # the clock starts at the first frame: no idle wait counted
                began = tick_start = now
                continue
            received += len(payload)
            tick_bytes += len(payload)
            if now - tick_start >= TICK_S:
                windows.add(tick_bytes, now - tick_start)
                tick_bytes, tick_start = 0, now
                if not stopped and (windows.steady() is not None
                                    or len(windows.rates) >= MAX_WINDOWS):
                    self._frame(dp.STOP_TAG, b"")
                    stopped = True
        elapsed = time.perf_counter() - began if began is not None else 0.0
        steady = windows.steady()
        if steady is not None:
            rate = Rate(steady / 1e9)
        elif received <= 0:
            rate = Rate(0.0, "no data arrived")
        else:
            rate = estimate_rate(windows, received, elapsed, "the sender stopped",
                                 cut_short=len(windows.rates) < MAX_WINDOWS)
        note = rate.estimate_note.encode()[:MAX_NOTE_BYTES]
        self._frame(dp.RATE_TAG, _RATE.pack(rate.gbps * 1e9) + note)


def readable_now(sock: socket.socket) -> bool:
    """Whether `sock` has bytes (or EOF) to read, without waiting. poll(2), not select(2):
    the units raise the open-file limit to 65,536 (deploy/), and select refuses a descriptor
    numbered 1,024 or more."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))
