"""One public TCP port for gRPC and the dtfm data plane (issue 32: the coordinator needs one
port open, a reachable agent one, an unreachable agent none).

The daemon's public port is owned by this front, on the daemon's event loop. For each
accepted connection it looks at the first bytes without consuming them (`MSG_PEEK`) and
hands the connection on:

- a dtfm data-plane hello (`dtfm.core.dataplane.MAGIC`, then the whole hello, which says
  the job, epoch, rank and relay target) goes to `on_data(sock, hello)`: the coordinator's
  relay takes it in-process, an agent passes the socket to its epoch's worker process
  (agent/datahandoff.py). The socket is untouched: its reader sees the hello exactly as if
  it had accepted the connection itself;
- gRPC (the HTTP/2 preface "PRI * HTTP/2.0", or a TLS ClientHello, record type 0x16, when
  TLS is configured) is joined to the daemon's gRPC server, which listens only on an
  abstract Unix socket (no second TCP port): the kernel moves the bytes both ways
  (splice(2), dtfm/splice.py), not the event loop;
- anything else, and a client that says nothing for `sniff_timeout_s`, is closed, logged
  and counted (`refused`, `refused_bytes`); nothing a peer sends can stop the front.

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

from dtfm.core import dataplane as dp
from dtfm.splice import Splice

log = logging.getLogger(__name__)

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
TLS_RECORD_HANDSHAKE = 0x16
GRPC, DTFM, GARBAGE = "grpc", "dtfm", "garbage"
_PIPE_HIGH_WATER = 1 << 20
_PARTIAL_WAIT_S = 0.005  # poll interval while a peer has sent only part of what is needed

DataHandler = Callable[[socket.socket, dp.Hello], None]


def classify(head: bytes) -> str | None:
    """What a connection whose first bytes are `head` speaks: GRPC, DTFM or GARBAGE; None
    when more bytes are needed to tell."""
    if not head:
        return None
    if head[0] == TLS_RECORD_HANDSHAKE:
        return GRPC
    for prefix, kind in ((dp.MAGIC, DTFM), (H2_PREFACE, GRPC)):
        n = min(len(head), len(prefix))
        if head[:n] == prefix[:n]:
            return kind if n == len(prefix) else None
    return GARBAGE


def backend_address() -> str:
    """A fresh abstract Unix socket name for the gRPC server behind a front (its network
    namespace only; random, so several daemons on one host do not collide)."""
    return f"dtfm-grpc-{os.getpid()}-{os.urandom(6).hex()}"


class Front:
    """The public listener: sniffs each connection and hands it to gRPC or the data plane."""

    def __init__(self, on_data: DataHandler | None = None, *,
                 sniff_timeout_s: float = 10.0) -> None:
        # on_data None: this daemon serves no data plane here; dtfm hellos are refused
        self.on_data = on_data
        self.sniff_timeout_s = sniff_timeout_s
        self.backend = ""  # the gRPC server's abstract Unix socket name
        self.port = 0
        self.grpc_connections = 0
        self.data_connections = 0
        self.refused = 0  # connections closed for speaking neither, or nothing in time
        self.refused_bytes = 0  # bytes such connections had sent (peeked, never consumed)
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._splices: set[Splice] = set()

    async def start(self, host: str, port: int, backend: str) -> int:
        """Listen on host:port (0: a free port), splicing gRPC to `backend`; the port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        dualstack = host in ("", "::") and socket.has_dualstack_ipv6()  # as gRPC binds "[::]"
        self._listener = socket.create_server(
            (host or "::" if dualstack else host or "0.0.0.0", port),
            family=socket.AF_INET6 if dualstack else family, backlog=512, reuse_port=False,
            dualstack_ipv6=dualstack)
        self._listener.setblocking(False)
        self.backend, self.port = backend, self._listener.getsockname()[1]
        self._accepting = asyncio.create_task(self._accept_loop())
        return self.port

    async def aclose(self) -> None:
        """Stop accepting, end the connections still being sniffed and every splice."""
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        if self._listener is not None:
            self._listener.close()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sp in list(self._splices):
            sp.close()
        await asyncio.sleep(0)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # EMFILE and friends: say so, keep serving
                log.warning("front: accept on port %d failed: %s", self.port, exc)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._dispatch(sock))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _dispatch(self, sock: socket.socket) -> None:
        peer = _peername(sock)
        handed = False
        try:
            kind, head = await self._sniff(sock)
            if kind == DTFM and self.on_data is not None:
                hello = dp.Hello.unpack(head[:dp.HELLO_BYTES])
                self.data_connections += 1
                handed = True
                self.on_data(sock, hello)
            elif kind == GRPC:
                self.grpc_connections += 1
                await self._splice(sock)
                handed = True
            elif kind is None:
                self._refuse(peer, head, f"not enough to tell what it speaks within "
                             f"{self.sniff_timeout_s:g} s ({len(head)} bytes)")
            else:
                self._refuse(peer, head, "a dtfm data-plane hello, but this daemon serves no "
                             "data plane on this port" if kind == DTFM else
                             f"neither gRPC nor a dtfm hello (first bytes {head[:16]!r})")
        except dp.AuthError as exc:  # the magic, but another version
            self._refuse(peer, b"", str(exc))
        except ConnectionError as exc:
            log.info("front: %s closed before it could be served: %s", peer, exc)
        except OSError as exc:
            log.warning("front: connection from %s failed: %s", peer, exc)
        finally:
            if not handed:
                sock.close()

    def _refuse(self, peer: str, head: bytes, why: str) -> None:
        self.refused += 1
        self.refused_bytes += len(head)
        log.warning("front: closed a connection from %s on port %d: %s", peer, self.port, why)

    async def _sniff(self, sock: socket.socket) -> tuple[str | None, bytes]:
        """(kind, the bytes peeked), DTFM only once a whole hello is there; kind None when
        the peer has not said enough within `sniff_timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.sniff_timeout_s
        while True:
            try:
                head: bytes | None = sock.recv(dp.HELLO_BYTES, socket.MSG_PEEK)
            except BlockingIOError:
                head = None
            if head == b"":
                raise ConnectionError("it closed without a word")
            if head:
                kind = classify(head)
                if kind is not None and (kind != DTFM or len(head) >= dp.HELLO_BYTES):
                    return kind, head
            left = deadline - loop.time()
            if left <= 0:
                return None, head or b""
            if head:  # part of a message: the socket stays readable, so poll for the rest
                await asyncio.sleep(min(_PARTIAL_WAIT_S, left))
            else:
                await _readable(loop, sock, left)

    async def _splice(self, sock: socket.socket) -> None:
        """Join the connection to the gRPC server, both ways, in the kernel (dtfm/splice.py)."""
        loop = asyncio.get_running_loop()
        back = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        back.setblocking(False)
        try:
            await loop.sock_connect(back, "\0" + self.backend)
        except BaseException:
            back.close()
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        splice = Splice(sock, back, self._splices.discard)
        self._splices.add(splice)
        splice.start(f"dtfm-splice-{self.port}")


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket, timeout: float) -> None:
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()
    loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
    try:
        await asyncio.wait_for(fut, timeout)
    except TimeoutError:
        pass  # the caller checks its deadline
    finally:
        loop.remove_reader(fd)


def _peername(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "a peer"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
