"""The forwarding process of the WAN emulator: one-way delay and bandwidth per host pair.

This kernel has no ``netem``, so delay is made in user space. This process opens the TUN device
of every emulated host (entering each host's network namespace with ``setns``), reads the IP
packets the hosts send into their TUNs, and writes each one into the destination host's TUN
after the pair's one-way delay plus its serialization time at the pair's rate. Every directed
pair ``(src, dst)`` is its own link with a FIFO queue: a packet departs at
``max(now, link_free_at) + size * 8 / rate`` and arrives ``delay`` later. Nothing is lost,
jittered or reordered (a link cut on purpose drops everything: a route failure or a
firewall between two hosts that both still reach everyone else); the queue is unbounded
unless the spec caps it (``queue_ms``), in which case a packet that would wait longer than
that is dropped (tail drop).

It runs as its own process (``python -m dtfm.wan.emulator --spec FILE``) so that the event loop
(one ``epoll`` over the TUN fds and a heap of timed deliveries) is not slowed by the caller's
threads or GIL. It prints ``ready`` on stdout once every TUN is open, stops on SIGTERM, and when
its stdin reaches end-of-file without a SIGTERM (the owner died), it ends the processes in its
namespaces and deletes them, so that a killed test run leaves nothing behind.

Hosts behind a NAT or a stateful firewall (:mod:`dtfm.wan.nat`, which says why translation
happens here rather than in a kernel NAT): a host's ``reachability`` is ``public`` (default),
``firewall`` or ``nat``; a NATed host's ``address`` is private and ``public_address`` is its
NAT's, and hosts with the same ``site`` share one NAT (and reach each other on its LAN).

Spec (JSON)::

    {"hosts": [{"namespace": "dtfm-ab12cd-0", "ifname": "wan0", "address": "10.213.0.1",
                "reachability": "public", "public_address": null, "site": null}, ...],
     "delay_ms": [[...]], "bandwidth_mbps": [[...]] or null (null entries: unlimited),
     "queue_ms": null, "watch_stdin": true, "cleanup_on_orphan": true,
     "stats_path": null,   # where to write the counters (JSON) on exit
     "control_socket": null,   # a Unix datagram socket path: live changes (below)
     "compute_dir": null}      # where host i's compute slowdown factor is written (file "i")

Live changes: with ``control_socket`` set, the forwarder also reads JSON datagrams there and
answers each (to the sender's address) with ``{"ok": true, ...}`` or ``{"error": "..."}``::

    {"links": [{"src": 1, "dst": 2, "delay_ms": 140, "bandwidth_mbps": 2.5}, ...]}
    {"links": [{"src": 1, "dst": 2, "cut": true}]}   # drop every packet 1 -> 2 (false: heal)
    {"compute": {"3": 2.0}}          # host 3's workers compute 2x slower (needs compute_dir)
    {"get": true}                    # the current matrices and compute factors

A changed link applies to packets that enter it from then on; those already queued keep their
times, and no packet overtakes an earlier one on the same link (a shorter delay waits for the
packets still in flight), so TCP sees a path change, not reordering. A compute factor is a file
that workers started with ``DTFM_COMPUTE_SLOWDOWN_FILE`` pointing at it read before every step
(``agent/worker/train.py``).
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

from dtfm.wan import nat, netns

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
    dropped_cut: int = 0  # sent over a link cut by a live change
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
    control_socket: str | None = None
    compute_dir: str | None = None
    reachability: tuple[str, ...] = ()  # per host; empty: every host public
    public_addresses: tuple[str | None, ...] = ()  # per host: its NAT's address, if NATed
    sites: tuple[int | None, ...] = ()  # per host: its NAT (hosts with one site share it)

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
            control_socket=data.get("control_socket"),
            compute_dir=data.get("compute_dir"),
            reachability=tuple(h.get("reachability", nat.PUBLIC) for h in hosts),
            public_addresses=tuple(h.get("public_address") for h in hosts),
            sites=tuple(h.get("site") for h in hosts),
        )

    def router(self) -> nat.Router | None:
        """The NAT and firewall state, or None where every host is public (the fast path)."""
        modes = self.reachability or (nat.PUBLIC,) * len(self.addresses)
        if all(m == nat.PUBLIC for m in modes):
            return None
        unknown = sorted(set(modes) - set(nat.MODES))
        if unknown:
            raise ValueError(f"unknown reachability {unknown}: give one of {nat.MODES}")
        public: list[bytes | None] = []
        sites: dict[int, tuple[bytes, dict[bytes, int]]] = {}
        for i, mode in enumerate(modes):
            addr = socket.inet_aton(self.addresses[i])
            if mode != nat.NAT:
                public.append(addr)
                continue
            public.append(None)
            site, pub = self.sites[i], self.public_addresses[i]
            if site is None or pub is None:
                raise ValueError(f"host {i} is behind a NAT: give its site and public_address")
            sites.setdefault(site, (socket.inet_aton(pub), {}))[1][addr] = i
        firewalled = {i for i, m in enumerate(modes) if m == nat.FIREWALL}
        return nat.Router(public, firewalled, list(sites.values()))


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
        self.cut = [[False] * n for _ in range(n)]  # links that drop every packet
        self.last_due = [[0.0] * n for _ in range(n)]  # FIFO per link across delay changes
        self.compute: dict[int, float] = {}
        self.heap: list[tuple[float, int, int, bytes | bytearray]] = []
        self.seq = 0
        self.counters = Counters()
        self.router = spec.router()

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
            if self.router is not None:  # NAT and firewalls: it counts its own drops
                data = bytearray(pkt)
                dst = self.router.route(src, data, now)
                if dst is None:
                    continue
                pkt = data  # type: ignore[assignment]
            else:
                dst = self.index_of_addr.get(pkt[16:20])
                if dst is None or dst == src:
                    counters.dropped_unroutable += 1
                    continue
            if self.cut[src][dst]:
                counters.dropped_cut += 1
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
            due = depart + self.delay_s[src][dst]
            if due < self.last_due[src][dst]:
                due = self.last_due[src][dst]
            self.last_due[src][dst] = due
            heapq.heappush(self.heap, (due, self.seq, dst, pkt))

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

    # ---- live changes (the control socket) ----
    def control(self, request: dict[str, Any]) -> dict[str, Any]:
        """Apply one control request; the answer says what changed or what was wrong."""
        n = len(self.fds)
        if not isinstance(request, dict):
            return {"error": f"a request is a JSON object, not {type(request).__name__}"}
        unknown = set(request) - {"links", "compute", "get", "forget_nat"}
        if unknown:
            return {"error": f"unknown request key(s) {sorted(unknown)}: give links, "
                             "compute, forget_nat or get"}
        if request.get("forget_nat"):
            if self.router is None:
                return {"error": "this emulator has no NAT: there is nothing to forget"}
            gone = self.router.forget()
            log.info("live change: the NATs forgot their %d mapping(s)", gone)
            return {"ok": True, "forgotten": gone, **self.current()}
        links = request.get("links") or []
        compute = request.get("compute") or {}
        try:
            checked = [_link_change(c, n) for c in links]
            factors = {_host(h, n): _factor(f) for h, f in compute.items()}
        except (TypeError, ValueError) as exc:
            return {"error": str(exc)}
        if factors and not self.spec.compute_dir:
            return {"error": "this emulator has no compute_dir: compute cannot change"}
        for src, dst, delay_ms, mbps, cut in checked:
            if cut is not None:
                self.cut[src][dst] = cut
            if delay_ms is not None:
                self.delay_s[src][dst] = delay_ms / 1e3
            if mbps is not _KEEP:
                self.sec_per_byte[src][dst] = 0.0 if mbps is None else 8.0 / (mbps * 1e6)
        for host, factor in factors.items():
            path = Path(self.spec.compute_dir or "") / str(host)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(f"{factor}\n")
            os.replace(tmp, path)  # workers never read a half-written factor
            self.compute[host] = factor
        if checked or factors:
            log.info("live change: links %s, compute %s", checked, factors)
        return {"ok": True, "links_changed": len(checked), "compute_changed": len(factors),
                **self.current()}

    def current(self) -> dict[str, Any]:
        """The matrices and compute factors now (delay in ms, rate in Mbit/s, None: unlimited)."""
        return {
            "delay_ms": [[d * 1e3 for d in row] for row in self.delay_s],
            "bandwidth_mbps": [[None if x == 0.0 else 8.0 / x / 1e6 for x in row]
                               for row in self.sec_per_byte],
            "compute": {str(h): f for h, f in sorted(self.compute.items())},
            "cut": [[i, j] for i, row in enumerate(self.cut) for j, c in enumerate(row) if c],
            "nat_mappings": [] if self.router is None else self.router.mappings(),
        }

    def stats(self) -> dict[str, float]:
        """The counters, with the NAT's and firewalls' drops added."""
        out = self.counters.as_dict()
        if self.router is not None:
            for key, value in self.router.counters.items():
                out[key] = out.get(key, 0) + value
        return out

    def _serve_control(self, sock: socket.socket) -> None:
        while True:
            try:
                data, peer = sock.recvfrom(1 << 20)
            except BlockingIOError:
                return
            try:
                answer = self.control(json.loads(data))
            except ValueError as exc:
                answer = {"error": f"not JSON: {exc}"}
            if peer:
                with contextlib.suppress(OSError):
                    sock.sendto(json.dumps(answer).encode(), peer)

    def run(self, control_fd: int | None, control_sock: socket.socket | None = None) -> str:
        """Forward until SIGTERM (returns "stopped") or EOF on ``control_fd`` ("orphaned")."""
        ep = select.epoll()
        try:
            for fd in self.fds:
                ep.register(fd, select.EPOLLIN)
            if control_fd is not None:
                ep.register(control_fd, select.EPOLLIN | select.EPOLLHUP)
            sock_fd = -1
            if control_sock is not None:
                sock_fd = control_sock.fileno()
                ep.register(sock_fd, select.EPOLLIN)
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
                    if fd == sock_fd:
                        assert control_sock is not None
                        self._serve_control(control_sock)
                        continue
                    self._receive(self.index_of_fd[fd], now)
                self._deliver(clock())
        finally:
            ep.close()


_KEEP: Any = object()  # a link change that leaves the rate as it is


def _host(value: Any, n: int) -> int:
    host = int(value)
    if not 0 <= host < n:
        raise ValueError(f"host {value!r} out of range [0, {n})")
    return host


def _factor(value: Any) -> float:
    factor = float(value)
    if not (1.0 <= factor < 1000.0):
        raise ValueError(f"compute factor {value!r}: give a factor >= 1 (2 = half as fast)")
    return factor


def _link_change(change: Any, n: int) -> tuple[int, int, float | None, Any, bool | None]:
    """(src, dst, delay ms or None to keep, Mbit/s or None for unlimited or _KEEP, cut: True
    drops every packet, False carries them again, None keeps it as it is)."""
    if not isinstance(change, dict):
        raise ValueError(f"a link change is an object with src and dst, not {change!r}")
    src, dst = _host(change.get("src"), n), _host(change.get("dst"), n)
    if src == dst:
        raise ValueError(f"link {src}->{dst}: a host has no link to itself")
    delay = change.get("delay_ms")
    if delay is not None and not (math.isfinite(float(delay)) and float(delay) >= 0):
        raise ValueError(f"link {src}->{dst}: delay_ms must be finite and >= 0; got {delay}")
    mbps: Any = _KEEP
    if "bandwidth_mbps" in change:
        mbps = change["bandwidth_mbps"]
        if mbps is not None and not (math.isfinite(float(mbps)) and float(mbps) > 0):
            raise ValueError(f"link {src}->{dst}: bandwidth_mbps must be > 0 or null "
                             f"(unlimited); got {mbps}")
        mbps = None if mbps is None else float(mbps)
    cut = change.get("cut")
    if cut is not None and not isinstance(cut, bool):
        raise ValueError(f"link {src}->{dst}: cut must be true or false; got {cut!r}")
    return src, dst, None if delay is None else float(delay), mbps, cut


def request(control_socket: str, message: dict[str, Any], timeout: float = 5.0
            ) -> dict[str, Any]:
    """Send one request to a running forwarder's control socket; its answer (raises
    RuntimeError with the forwarder's reason when it refused)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("")  # an autobound abstract address, so the forwarder can answer
        sock.settimeout(timeout)
        try:
            sock.sendto(json.dumps(message).encode(), control_socket)
            answer = json.loads(sock.recv(1 << 20))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise RuntimeError(f"no emulator listens on {control_socket}: {exc}") from None
        except TimeoutError:
            raise RuntimeError(f"the emulator at {control_socket} did not answer within "
                               f"{timeout:.0f} s") from None
    if "error" in answer:
        raise RuntimeError(f"the emulator refused the change: {answer['error']}")
    return dict(answer)


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


# The forwarder runs ahead of the processes in its hosts: they share this machine's cores with
# it, and a forwarder waiting for a core adds delay no real link has (an emulated 40 ms link
# read 55 ms while the machine was busy).
FORWARDER_NICE = -10


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
    with contextlib.suppress(OSError):  # needs root, which the emulator has
        os.nice(FORWARDER_NICE)  # before any thread starts: they inherit it
    fds = open_tuns(spec)
    control_fd: int | None = None
    if spec.watch_stdin:
        control_fd = sys.stdin.fileno()
        os.set_blocking(control_fd, False)
    forwarder = Forwarder(spec, fds)
    control_sock: socket.socket | None = None
    if spec.control_socket:
        control_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(spec.control_socket)
        control_sock.bind(spec.control_socket)
        control_sock.setblocking(False)
    signal.signal(signal.SIGTERM, _on_sigterm)
    outcome = "stopped"
    try:
        print("ready", flush=True)
        log.info("forwarding between %d hosts: %s", len(fds), ", ".join(spec.addresses))
        outcome = forwarder.run(control_fd, control_sock)
    except _Stop:
        outcome = "stopped"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if control_sock is not None:
            control_sock.close()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        stats = forwarder.stats()
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
