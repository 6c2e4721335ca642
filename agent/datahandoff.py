"""Data-plane connections accepted on the agent's one public port, handed to the epoch's
worker process without a copy (issue 32: a reachable agent needs one port open).

The agent's front (dtfm/front.py) accepts every connection on the agent's gRPC port and
sorts them; a dtfm hello naming no relay target is a peer dialling this agent's worker.
The worker is a child process started per epoch, so the socket itself crosses over: the
agent listens on an abstract Unix socket (its name in the worker's environment,
`dtfm.core.dataplane.HANDOFF_ENV`); each worker connects, claims its (job, epoch), and
receives the accepted sockets of that epoch with SCM_RIGHTS (`socket.send_fds`). The worker's
mesh admits each exactly as if it had accepted it (the hello is still unread; the job-key
handshake decides, as before). Bytes never pass through the agent.

A peer may dial before its worker has claimed the epoch (workers start at different times):
such a connection waits here, at most `wait_s`, then is closed and logged. Only a process of
this agent's user may claim (SO_PEERCRED); it would still need the epoch's key to speak to
anyone, as every dtfm connection does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct

from dtfm.core import dataplane as dp

log = logging.getLogger(__name__)

Epoch = tuple[bytes, int]  # (job digest, epoch)


class DataHandoff:
    """Where the agent's front puts data-plane connections for its workers."""

    def __init__(self, wait_s: float = 60.0, claim_timeout_s: float = 10.0) -> None:
        self.name = f"dtfm-data-{os.getpid()}-{os.urandom(6).hex()}"
        self.wait_s, self.claim_timeout_s = wait_s, claim_timeout_s
        self.handed = 0  # connections passed to a worker
        self.dropped = 0  # connections closed: no worker claimed their epoch in time
        self._workers: dict[Epoch, socket.socket] = {}
        self._waiting: list[tuple[socket.socket, Epoch, asyncio.TimerHandle]] = []
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        """Listen for workers; the abstract socket name they connect to."""
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + self.name)
        self._listener.listen(16)
        self._listener.setblocking(False)
        self._spawn(self._accept_workers())
        return self.name

    def give(self, sock: socket.socket, hello: dp.Hello) -> None:
        """Hand `sock` (its hello unread) to the worker of the hello's epoch, now or once
        that worker claims it."""
        epoch = (hello.job, hello.epoch)
        if self._send(sock, epoch):
            return
        timer = asyncio.get_running_loop().call_later(self.wait_s, self._expire, sock)
        self._waiting.append((sock, epoch, timer))

    async def aclose(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        for conn in self._workers.values():
            conn.close()
        self._workers.clear()
        for sock, _, timer in self._waiting:
            timer.cancel()
            sock.close()
        self._waiting.clear()

    def _spawn(self, coro: object) -> None:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _send(self, sock: socket.socket, epoch: Epoch) -> bool:
        """Pass `sock` to its epoch's worker; False when no live worker holds that epoch."""
        conn = self._workers.get(epoch)
        if conn is None:
            return False
        try:
            socket.send_fds(conn, [b"x"], [sock.fileno()])
        except OSError as exc:  # the worker is gone (or its queue is full): forget it
            log.info("data handoff: the worker of epoch %d is gone (%s)", epoch[1], exc)
            self._workers.pop(epoch, None)
            conn.close()
            return False
        sock.close()  # the worker holds its own copy of the connection now
        self.handed += 1
        return True

    def _expire(self, sock: socket.socket) -> None:
        for i, (s, epoch, _) in enumerate(self._waiting):
            if s is sock:
                del self._waiting[i]
                self.dropped += 1
                log.warning("data handoff: a peer dialled epoch %d but no worker of this "
                            "agent took it within %g s: connection closed", epoch[1],
                            self.wait_s)
                sock.close()
                return

    async def _accept_workers(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            self._spawn(self._claim(conn))

    async def _claim(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      struct.calcsize("3i")))[1]
            if uid != os.getuid():
                raise ConnectionError(f"a process of uid {uid}, not this agent's, connected")
            data = b""
            async with asyncio.timeout(self.claim_timeout_s):
                while len(data) < dp.CLAIM_BYTES:
                    chunk = await loop.sock_recv(conn, dp.CLAIM_BYTES - len(data))
                    if not chunk:
                        raise ConnectionError("it closed before claiming an epoch")
                    data += chunk
        except (OSError, TimeoutError) as exc:
            log.warning("data handoff: refused a worker connection: %s", exc)
            conn.close()
            return
        epoch = dp.unpack_claim(data)
        conn.setblocking(True)  # send_fds of one byte: never blocks in practice
        conn.settimeout(1.0)
        old = self._workers.pop(epoch, None)
        if old is not None:
            old.close()
        # a job's older epochs are over once a newer one's worker starts here
        for stale in [e for e in self._workers if e[0] == epoch[0] and e[1] < epoch[1]]:
            self._workers.pop(stale).close()
        self._workers[epoch] = conn
        log.info("data handoff: the worker of epoch %d takes its peers' connections",
                 epoch[1])
        waiting, self._waiting = self._waiting, []
        for sock, e, timer in waiting:
            if e == epoch and self._send(sock, e):
                timer.cancel()
            else:
                self._waiting.append((sock, e, timer))
