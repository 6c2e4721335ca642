"""One public TCP port for gRPC and the dtfm data plane (issue 32: the coordinator needs one
port open, a reachable agent one, an unreachable agent none).

The daemon's public port is owned by this front, on the daemon's event loop. For each
accepted connection it looks at the first bytes without consuming them (`MSG_PEEK`) and
hands the connection on:

- a dtfm data-plane hello (`dtfm.net.dataplane.MAGIC`, then the whole hello, which says
  the job, epoch, rank and relay target) goes to `on_data(sock, hello)`: the coordinator's
  relay takes it in-process, an agent passes the socket to its epoch's worker process
  (dtfm/net/handoff.py). The socket is untouched: its reader sees the hello exactly as if
  it had accepted the connection itself;
- gRPC is joined to the daemon's gRPC server, which listens only on an abstract Unix socket
  (no second TCP port); the event loop moves the bytes both ways with splice(2), in the
  kernel (dtfm/net/splice.py). gRPC is the HTTP/2 preface followed by the header of its first
  frame, a SETTINGS frame, or, only when the daemon serves TLS, a TLS record header of a
  ClientHello (first byte 0x16; without TLS that is garbage);
- anything else, and a client that has not said enough within `sniff_timeout_s`, is
  closed, logged (at most once per 10 s per reason) and counted (`refused`,
  `refused_bytes`); nothing a peer sends can stop the front.

Issue 41: nothing a peer does may exhaust the daemon. The connections held are bounded in
total and per source address, both those being sorted and the spliced gRPC ones
(dtfm/net/frontlimits.py; by default from the open-file limit); over a bound a connection is
closed at once and counted (`refused`, `over_limit`). Waiting costs nothing: the socket's
SO_RCVLOWAT is set to the bytes still needed, so a peer that sends a byte and stops never
wakes the loop. A spliced connection with no byte either way for `idle_timeout_s` is closed
(`idle_closed`); dtfm's own channels ping every 10 s (dtfm.rpc.CHANNEL_OPTIONS).

gRPC handlers see the peer as the Unix socket; they use `context.peer()` only in log lines.
No dtfm code imports this module but the plumbing that starts a server (dtfm/rpc.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable

from dtfm.net import dataplane as dp
from dtfm.net.frontlimits import FrontLimits, Tally, source_of
from dtfm.net.ratelog import RateLog
from dtfm.net.splice import Joined, LoopSplice, Pipes, Splicer

log = logging.getLogger(__name__)

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
H2_SETTINGS = 0x4  # the frame type a client's preface must be followed by (RFC 9113 3.4)
GRPC_HEAD = len(H2_PREFACE) + 9  # the preface and its first frame's header
TLS_RECORD_HANDSHAKE = 0x16
TLS_CLIENT_HELLO = 0x01
TLS_HEAD = 6  # record type, version, length; the handshake message's type
_TLS_MAX_RECORD = (1 << 14) + 2048
GRPC, DTFM, GARBAGE = "grpc", "dtfm", "garbage"
_TCP_ESTABLISHED = 1
_PEEK = max(dp.HELLO_BYTES, GRPC_HEAD)  # peeked at once: what was sent, for the log

DataHandler = Callable[[socket.socket, dp.Hello], None]


def needed(head: bytes, tls: bool = False) -> int:
    """How many bytes `classify` needs to decide on a connection that began with `head`."""
    if not head:
        return 1
    if tls and head[0] == TLS_RECORD_HANDSHAKE:
        return TLS_HEAD
    return dp.HELLO_BYTES if dp.MAGIC.startswith(head[:len(dp.MAGIC)]) else GRPC_HEAD


def classify(head: bytes, tls: bool = False) -> str | None:
    """What a connection whose first bytes are `head` speaks: GRPC, DTFM or GARBAGE; None
    when more bytes are needed to tell (`needed`). A TLS record is gRPC only with `tls`."""
    if not head:
        return None
    if head[0] == TLS_RECORD_HANDSHAKE:
        if not tls:
            return GARBAGE
        if len(head) < TLS_HEAD:
            return None
        length = int.from_bytes(head[3:5], "big")
        hello = head[1] == 3 and 0 < length <= _TLS_MAX_RECORD and head[5] == TLS_CLIENT_HELLO
        return GRPC if hello else GARBAGE
    for prefix, kind, whole in ((dp.MAGIC, DTFM, dp.HELLO_BYTES),
                                (H2_PREFACE, GRPC, GRPC_HEAD)):
        n = min(len(head), len(prefix))
        if head[:n] == prefix[:n]:
            if len(head) < whole:
                return None
            return GARBAGE if kind == GRPC and not _settings(head[len(H2_PREFACE):]) else kind
    return GARBAGE


def _settings(frame_header: bytes) -> bool:
    """Whether an HTTP/2 frame header is that of a client's first SETTINGS frame."""
    length = int.from_bytes(frame_header[:3], "big")
    stream = int.from_bytes(frame_header[5:9], "big") & 0x7FFFFFFF
    return (frame_header[3] == H2_SETTINGS and not frame_header[4] & 1 and stream == 0
            and length % 6 == 0 and length <= 1 << 14)


def _garbage_reason(head: bytes, tls: bool) -> str:
    if head[:1] == bytes([TLS_RECORD_HANDSHAKE]) and not tls:
        return ("it opens like TLS, but this daemon serves no TLS (give the daemon "
                "--tls-cert/--tls-key, or the client no TLS)")
    if head.startswith(H2_PREFACE):
        return "an HTTP/2 preface not followed by a SETTINGS frame"
    return f"neither gRPC nor a dtfm hello (first bytes {head[:16]!r})"


def backend_address() -> str:
    """A fresh abstract Unix socket name for the gRPC server behind a front (its network
    namespace only; random, so several daemons on one host do not collide)."""
    return f"dtfm-grpc-{os.getpid()}-{os.urandom(6).hex()}"


class Front:
    """The public listener: sniffs each connection and hands it to gRPC or the data plane.

    `limits` bound what it holds (dtfm/net/frontlimits.py; default: from RLIMIT_NOFILE at
    construction); `sniff_timeout_s` is how long a connection may take to say what it
    speaks; `idle_timeout_s` how long a spliced gRPC connection may move no byte.
    `splicer` joins a gRPC connection to the server (default: `LoopSplice` on this loop,
    with pipes from a pool of `limits.pipes`; bench/sharedport.py passes another)."""

    def __init__(self, on_data: DataHandler | None = None, *, sniff_timeout_s: float = 10.0,
                 idle_timeout_s: float = 120.0, limits: FrontLimits | None = None,
                 splicer: Splicer | None = None) -> None:
        # on_data None: this daemon serves no data plane here; dtfm hellos are refused
        self.on_data = on_data
        self.sniff_timeout_s, self.idle_timeout_s = sniff_timeout_s, idle_timeout_s
        self.limits = limits or FrontLimits.from_rlimit()
        self.tls = False  # whether the gRPC server behind speaks TLS (set by `start`)
        self.backend = ""  # the gRPC server's abstract Unix socket name
        self.port = 0
        self.grpc_connections = 0  # spliced to gRPC, ever
        self.data_connections = 0
        self.refused = 0  # connections closed for speaking neither, nothing in time, or a bound
        self.refused_bytes = 0  # bytes such connections had sent (peeked, never consumed)
        self.over_limit = 0  # of `refused`: closed because a bound on connections held was met
        self.idle_closed = 0  # spliced connections closed after `idle_timeout_s` of silence
        self._sorting = Tally("unsorted", self.limits.sniffing, self.limits.sniffing_per_source)
        self._grpc = Tally("gRPC", self.limits.grpc, self.limits.grpc_per_source)
        self._pipes = Pipes(self.limits.pipes)
        self._splicer: Splicer = splicer or (lambda a, b, done: LoopSplice(a, b, self._pipes,
                                                                            done))
        self._log = RateLog(log)
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._splices: dict[Joined, tuple[str, str]] = {}  # -> (source, peer)

    @property
    def sniffing(self) -> int:
        """Connections accepted and not yet sorted."""
        return len(self._sorting)

    @property
    def spliced(self) -> int:
        """gRPC connections joined to the server now."""
        return len(self._splices)

    async def start(self, host: str, port: int, backend: str, tls: bool = False) -> int:
        """Listen on host:port (0: a free port), splicing gRPC to `backend`, which speaks TLS
        when `tls`; the port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        dualstack = host in ("", "::") and socket.has_dualstack_ipv6()  # as gRPC binds "[::]"
        self._listener = socket.create_server(
            (host or "::" if dualstack else host or "0.0.0.0", port),
            family=socket.AF_INET6 if dualstack else family, backlog=512, reuse_port=False,
            dualstack_ipv6=dualstack)
        self._listener.setblocking(False)
        self.backend, self.port, self.tls = backend, self._listener.getsockname()[1], tls
        self._spawn(self._accept_loop())
        self._spawn(self._sweep())
        log.info("front on port %d: %s", self.port, self.limits.describe())
        return self.port

    async def aclose(self) -> None:
        """Stop accepting, end the connections still being sniffed and every splice."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        for sp in list(self._splices):
            sp.close()
        self._pipes.close()

    def _spawn(self, coro: object) -> None:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                sock, addr = await loop.sock_accept(self._listener)
            except OSError as exc:  # EMFILE and friends: say so, keep serving
                self._log.warning("accept", f"front: accept on port {self.port} failed: {exc}")
                await asyncio.sleep(0.1)
                continue
            source = source_of(str(addr[0]))
            why = self._sorting.admit(source)
            if why is None:
                self._spawn(self._dispatch(sock, source))
            else:
                sock.close()
                self._over_limit(_peername(sock, addr), why)

    async def _dispatch(self, sock: socket.socket, source: str) -> None:
        peer = _peername(sock)
        handed = False
        try:
            try:
                kind, head = await self._sniff(sock)
            finally:
                self._sorting.release(source)
            if kind == DTFM and self.on_data is not None:
                hello = dp.Hello.unpack(head[:dp.HELLO_BYTES])
                self.data_connections += 1
                handed = True
                self.on_data(sock, hello)
            elif kind == GRPC:
                handed = await self._splice(sock, source, peer)
            elif kind is None:
                self._refuse(peer, head, "silent", f"not enough to tell what it speaks within "
                             f"{self.sniff_timeout_s:g} s ({len(head)} bytes)")
            else:
                self._refuse(peer, head, "garbage", "a dtfm data-plane hello, but this daemon "
                             "serves no data plane on this port" if kind == DTFM else
                             _garbage_reason(head, self.tls))
        except dp.AuthError as exc:  # the magic, but another version
            self._refuse(peer, b"", "garbage", str(exc))
        except ConnectionError as exc:
            log.debug("front: %s closed before it could be served: %s", peer, exc)
        except OSError as exc:
            self._log.warning("error", f"front: connection from {peer} failed: {exc}")
        finally:
            if not handed:
                sock.close()

    def _refuse(self, peer: str, head: bytes, kind: str, why: str) -> None:
        self.refused += 1
        self.refused_bytes += len(head)
        self._log.warning(kind, f"front: closed a connection from {peer} on port {self.port}: "
                                f"{why}")

    def _over_limit(self, peer: str, why: str) -> None:
        self.refused += 1
        self.over_limit += 1
        self._log.warning("limit", f"front: refused a connection from {peer} on port "
                                   f"{self.port}: {why}; if these are honest clients, raise "
                                   "the daemon's open-file limit (LimitNOFILE)")

    async def _sniff(self, sock: socket.socket) -> tuple[str | None, bytes]:
        """(kind, the bytes peeked), once `classify` can tell; kind None when the peer has
        not said enough within `sniff_timeout_s`. Sleeps in the kernel until the bytes
        needed are there (SO_RCVLOWAT), so a peer that stops half-way costs no wakeups."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.sniff_timeout_s
        head = b""
        try:
            while True:
                want = needed(head, self.tls)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                if not await _readable(loop, sock, deadline - loop.time()):
                    return None, head
                try:
                    head = sock.recv(max(want, _PEEK), socket.MSG_PEEK)
                except BlockingIOError:
                    continue
                if head == b"":
                    raise ConnectionError("it closed without a word")
                kind = classify(head, self.tls)
                if kind is not None:
                    return kind, head
                if len(head) < want and _peer_closed(sock):  # readable short: its EOF
                    raise ConnectionError(f"it closed after {len(head)} bytes")
        finally:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)

    async def _splice(self, sock: socket.socket, source: str, peer: str) -> bool:
        """Join the connection to the gRPC server, both ways, in the kernel (dtfm/net/splice.py);
        False when a bound refuses it."""
        why = self._grpc.admit(source)
        if why is not None:
            self._over_limit(peer, why)
            return False
        loop = asyncio.get_running_loop()
        back = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        back.setblocking(False)
        try:
            await loop.sock_connect(back, "\0" + self.backend)
        except BaseException:
            back.close()
            self._grpc.release(source)
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        splice = self._splicer(sock, back, self._spliced_done)
        self._splices[splice] = (source, peer)
        self.grpc_connections += 1
        splice.start()
        return True

    def _spliced_done(self, splice: Joined) -> None:
        held = self._splices.pop(splice, None)
        if held is not None:
            self._grpc.release(held[0])

    async def _sweep(self) -> None:
        """Close spliced connections that moved no byte for `idle_timeout_s`."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(0.05, min(self.idle_timeout_s / 4, 10.0)))
            cutoff = loop.time() - self.idle_timeout_s
            for splice, (_, peer) in list(self._splices.items()):
                if splice.last_active < cutoff:
                    self.idle_closed += 1
                    self._log.warning("idle", f"front: closed a gRPC connection from {peer} "
                                              f"on port {self.port}: no byte either way for "
                                              f"{self.idle_timeout_s:g} s")
                    splice.close()


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                    timeout: float) -> bool:
    """Whether `sock` became readable within `timeout` seconds."""
    if timeout <= 0:
        return False
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()
    loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
    try:
        await asyncio.wait_for(fut, timeout)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the TCP connection has left ESTABLISHED (the peer sent its FIN, or reset)."""
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != _TCP_ESTABLISHED
    except OSError:
        return True


def _peername(sock: socket.socket, addr: object = None) -> str:
    try:
        host, port = (addr or sock.getpeername())[:2]  # type: ignore[index]
    except (OSError, TypeError, ValueError):
        return "a peer"
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
