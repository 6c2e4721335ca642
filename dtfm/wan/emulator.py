"""The forwarding process of the WAN emulator: one-way delay and bandwidth per host pair.

This kernel has no ``netem``, so delay is made in user space. This process opens the TUN device
of every emulated host (entering each host's network namespace with ``setns``), reads the IP
packets the hosts send into their TUNs, and writes each one into the destination host's TUN
after the pair's one-way delay plus its serialization time at the pair's rate. Every directed
pair ``(src, dst)`` is its own link with a FIFO queue: a packet departs at
``max(now, link_free_at) + size * 8 / rate`` and arrives ``delay`` later. Nothing is lost,
jittered or reordered; the queue is unbounded unless the spec caps it (``queue_ms``), in which
case a packet that would wait longer than that is dropped (tail drop).

It runs as its own process (``python -m dtfm.wan.emulator --spec FILE``) so that the event loop
(one ``epoll`` over the TUN fds and a heap of timed deliveries) is not slowed by the caller's
threads or GIL. It prints ``ready`` on stdout once every TUN is open, stops on SIGTERM, and when
its stdin reaches end-of-file without a SIGTERM (the owner died), it ends the processes in its
namespaces and deletes them, so that a killed test run leaves nothing behind.

Spec (JSON)::

    {"hosts": [{"namespace": "dtfm-ab12cd-0", "ifname": "wan0", "address": "10.213.0.1"}, ...],
     "delay_ms": [[...]], "bandwidth_mbps": [[...]] or null (null entries: unlimited),
     "queue_ms": null, "watch_stdin": true, "cleanup_on_orphan": true,
     "stats_path": null}   # where to write the counters (JSON) on exit
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import logging
import math
import os
import resource
import select
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from dtfm.wan import netns

log = logging.getLogger(__name__)

READ_SIZE = 65536
READ_BURST = 64  # packets read from one TUN before looking at the others


class _Stop(Exception):
    """Raised from the SIGTERM handler to leave the event loop."""


@dataclass
class Counters:
    forwarded: int = 0
    forwarded_bytes: int = 0
    dropped_unroutable: int = 0
    dropped_queue: int = 0
    dropped_write: int = 0
    late_s_total: float = 0.0  # sum over delivered packets of (write time - due time)
    late_s_max: float = 0.0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = dict(self.__dict__)
        out["late_ms_mean"] = 1e3 * self.late_s_total / self.forwarded if self.forwarded else 0.0
        out["late_ms_max"] = 1e3 * out.pop("late_s_max")
        del out["late_s_total"]
        return out


@dataclass(frozen=True)
class Spec:
    namespaces: list[str]
    ifnames: list[str]
    addresses: list[str]
    delay_ms: list[list[float]]
    bandwidth_mbps: list[list[float | None]]
    queue_ms: float | None = None
    watch_stdin: bool = True
    cleanup_on_orphan: bool = True
    stats_path: str | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Spec:
        hosts = data["hosts"]
        n = len(hosts)
        bw = data.get("bandwidth_mbps")
        if bw is None:
            bw = [[None] * n for _ in range(n)]
        return cls(
            namespaces=[h["namespace"] for h in hosts],
            ifnames=[h.get("ifname", "wan0") for h in hosts],
            addresses=[h["address"] for h in hosts],
            delay_ms=[[float(x) for x in row] for row in data["delay_ms"]],
            bandwidth_mbps=[[None if x is None else float(x) for x in row] for row in bw],
            queue_ms=data.get("queue_ms"),
            watch_stdin=bool(data.get("watch_stdin", True)),
            cleanup_on_orphan=bool(data.get("cleanup_on_orphan", True)),
            stats_path=data.get("stats_path"),
        )


class Forwarder:
    """The event loop: TUN fds in, a heap of (arrival time, seq, dst, packet) out."""

    def __init__(self, spec: Spec, tun_fds: list[int]) -> None:
        n = len(tun_fds)
        self.spec = spec
        self.fds = tun_fds
        self.index_of_fd = {fd: i for i, fd in enumerate(tun_fds)}
        self.index_of_addr = {socket.inet_aton(a): i for i, a in enumerate(spec.addresses)}
        self.delay_s = [[spec.delay_ms[i][j] / 1e3 for j in range(n)] for i in range(n)]
        # seconds per byte on each directed link; 0.0 = unlimited
        self.sec_per_byte = [
            [0.0 if (b is None or b == float("inf")) else 8.0 / (b * 1e6) for b in row]
            for row in spec.bandwidth_mbps
        ]
        self.queue_s = None if spec.queue_ms is None else spec.queue_ms / 1e3
        self.free_at = [[0.0] * n for _ in range(n)]
        self.heap: list[tuple[float, int, int, bytes]] = []
        self.seq = 0
        self.counters = Counters()

    def _receive(self, src: int, now: float) -> None:
        fd = self.fds[src]
        counters = self.counters
        for _ in range(READ_BURST):
            try:
                pkt = os.read(fd, READ_SIZE)
            except BlockingIOError:
                return
            except OSError as exc:
                log.warning("read from host %d failed: %s", src, exc)
                return
            if len(pkt) < 20 or (pkt[0] >> 4) != 4:
                counters.dropped_unroutable += 1
                continue
            dst = self.index_of_addr.get(pkt[16:20])
            if dst is None or dst == src:
                counters.dropped_unroutable += 1
                continue
            start = self.free_at[src][dst]
            if start < now:
                start = now
            elif self.queue_s is not None and start - now > self.queue_s:
                counters.dropped_queue += 1
                continue
            depart = start + len(pkt) * self.sec_per_byte[src][dst]
            self.free_at[src][dst] = depart
            self.seq += 1
            heapq.heappush(self.heap, (depart + self.delay_s[src][dst], self.seq, dst, pkt))

    def _deliver(self, now: float) -> None:
        heap = self.heap
        counters = self.counters
        while heap and heap[0][0] <= now:
            due, _, dst, pkt = heapq.heappop(heap)
            try:
                os.write(self.fds[dst], pkt)
            except OSError as exc:
                counters.dropped_write += 1
                log.debug("write to host %d failed: %s", dst, exc)
                continue
            counters.forwarded += 1
            counters.forwarded_bytes += len(pkt)
            late = now - due
            counters.late_s_total += late
            if late > counters.late_s_max:
                counters.late_s_max = late

    def run(self, control_fd: int | None) -> str:
        """Forward until SIGTERM (returns "stopped") or EOF on ``control_fd`` ("orphaned")."""
        ep = select.epoll()
        try:
            for fd in self.fds:
                ep.register(fd, select.EPOLLIN)
            if control_fd is not None:
                ep.register(control_fd, select.EPOLLIN | select.EPOLLHUP)
            clock = time.monotonic
            while True:
                # epoll rounds its timeout up to whole milliseconds, which would make every
                # delivery up to 1 ms late: wait whole milliseconds rounded down, then sleep
                # the sub-millisecond rest (nanosleep is precise) if nothing arrived meanwhile.
                if self.heap:
                    wait = self.heap[0][0] - clock()
                    timeout = max(0.0, math.floor(wait * 1e3) / 1e3)
                else:
                    timeout = -1.0
                events = ep.poll(timeout)
                if not events and self.heap:
                    rest = self.heap[0][0] - clock()
                    if rest > 0:
                        time.sleep(rest)
                now = clock()
                for fd, _ in events:
                    if fd == control_fd:
                        try:
                            data = os.read(fd, 4096)
                        except BlockingIOError:
                            continue
                        if not data:
                            return "orphaned"
                        continue
                    self._receive(self.index_of_fd[fd], now)
                self._deliver(clock())
        finally:
            ep.close()


def open_tuns(spec: Spec) -> list[int]:
    fds: list[int] = []
    try:
        for name, ifname in zip(spec.namespaces, spec.ifnames, strict=True):
            with netns.entered(name):
                fds.append(netns.open_tun(ifname))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def cleanup_namespaces(names: list[str]) -> None:
    for name in names:
        try:
            netns.kill_namespace_processes(name)
            netns.delete_namespace(name)
        except Exception:
            log.exception("cleanup of namespace %s failed", name)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtfm.wan.emulator", description=__doc__)
    parser.add_argument("--spec", required=True, type=Path, help="JSON spec file")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s wan-emulator[%(process)d] %(message)s",
        stream=sys.stderr,
    )
    spec = Spec.from_json(json.loads(args.spec.read_text()))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner decides when we stop
    fds = open_tuns(spec)
    control_fd: int | None = None
    if spec.watch_stdin:
        control_fd = sys.stdin.fileno()
        os.set_blocking(control_fd, False)
    forwarder = Forwarder(spec, fds)
    signal.signal(signal.SIGTERM, _on_sigterm)
    outcome = "stopped"
    try:
        print("ready", flush=True)
        log.info("forwarding between %d hosts: %s", len(fds), ", ".join(spec.addresses))
        outcome = forwarder.run(control_fd)
    except _Stop:
        outcome = "stopped"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        stats = forwarder.counters.as_dict()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        stats["cpu_s"] = usage.ru_utime + usage.ru_stime
        log.info("%s; %s", outcome, stats)
        if spec.stats_path:
            with contextlib.suppress(OSError):
                Path(spec.stats_path).write_text(json.dumps(stats))
    if outcome == "orphaned" and spec.cleanup_on_orphan:
        log.warning("owner went away; deleting namespaces %s", spec.namespaces)
        cleanup_namespaces(spec.namespaces)
    return 0


if __name__ == "__main__":
    sys.exit(main())
