"""Data-plane connections accepted on the agent's one public port, handed to the epoch's
worker process without a copy (issue 32: a reachable agent needs one port open).

The agent's front (dtfm/net/front.py) accepts every connection on the agent's gRPC port and
sorts them; a dtfm hello naming no relay target is a peer dialling this agent's worker.
The worker is a child process started per epoch, so the socket itself crosses over: the
agent listens on an abstract Unix socket (its name in the worker's environment,
`dtfm.net.dataplane.HANDOFF_ENV`); each worker connects, claims its (job, epoch), and
receives the accepted sockets of that epoch with SCM_RIGHTS (`socket.send_fds`). The worker's
mesh admits each exactly as if it had accepted it (the hello is still unread; the job-key
handshake decides, as before). Bytes never pass through the agent. Only a process of this
agent's user may claim (SO_PEERCRED); it would still need the epoch's key to speak to
anyone, as every dtfm connection does.

A hello proves nothing (the key's proof comes after it, in the worker), and anyone can send
one, so what a connection may make the agent hold is bounded (issue 41: 1,100 hellos for a
made-up epoch, each kept 60 s, used up every file descriptor of an agent):

- only an epoch this agent runs or is starting is waited for. The session tells the hand-off
  each assignment as it arrives (`hold`), before the worker starts, and each stop
  (`release`). A hello for any other (job, epoch) is closed at once and counted (`refused`);
  the only exception is a later epoch of the job this agent holds, the one assignment that
  may still be on its way here while a faster peer already dials: it waits `ahead_wait_s`;
- a connection whose epoch's worker has not claimed yet waits in a bounded lot
  (dtfm/net/parking.py: per source address and in all; `evicted` counts what the bounds
  closed), at most `wait_s`, and is closed as soon as its dialer gives up (`abandoned`);
- a connection handed to a worker sits in the worker's queue until the worker takes it. The
  agent sends without blocking into a queue of `worker_queue_bytes` (about 40 connections on
  Linux 6); while the worker has not drained it, further connections wait in the lot (so
  under its bounds) and go on once the worker's socket is writable again, instead of
  stalling the agent's event loop or piling descriptors into a worker that does not read.

Why `wait_s` stays long (60 s): it only ever applies to the epoch this agent is starting, so
it is not what bounds a stranger (the epoch filter and the lot are), and a worker may start
slowly: a fresh process importing torch on a loaded machine, a checkpoint fetched from a peer
first. A wait shorter than the dialer's own patience would turn a slow start into a failed
epoch (issue 40). A connection whose dialer has left is not kept for the rest of the wait.
Refusals and evictions are logged at a bounded rate (dtfm/net/ratelog.py); the counters count
them all.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import struct
import time

from dtfm.net import dataplane as dp
from dtfm.net.parking import Epoch, Parked, Parking, source_of
from dtfm.net.ratelog import RateLog

log = logging.getLogger(__name__)

_WORKER_BUSY = (errno.EAGAIN, errno.ETOOMANYREFS)  # its queue is full: it is alive
HANDED, FULL, NO_WORKER = "handed", "full", "no worker"  # what `_send` did


class DataHandoff:
    """Where the agent's front puts data-plane connections for its workers."""

    def __init__(self, wait_s: float = 60.0, claim_timeout_s: float = 10.0, *,
                 ahead_wait_s: float = 10.0, parking: Parking | None = None,
                 sweep_s: float = 1.0, worker_queue_bytes: int = 16 * 1024) -> None:
        self.name = f"dtfm-data-{os.getpid()}-{os.urandom(6).hex()}"
        self.wait_s, self.claim_timeout_s = wait_s, claim_timeout_s
        self.ahead_wait_s, self.sweep_s = ahead_wait_s, sweep_s
        self.worker_queue_bytes = worker_queue_bytes
        self.parking = parking if parking is not None else Parking()
        self.handed = 0  # connections passed to a worker
        self.dropped = 0  # closed waiting: no worker claimed their epoch in time, or it ended
        self.refused = 0  # closed at once: for an epoch this agent neither runs nor starts
        self.evicted = 0  # closed to keep the parking bounds (dtfm/net/parking.py)
        self.abandoned = 0  # closed waiting, after their dialer closed its end
        self._held: Epoch | None = None  # the epoch this agent runs or starts (None: none)
        self._last: Epoch | None = None  # the last one held, for its job's later epochs
        self._held_name = ""  # "job J epoch E", for log lines
        self._workers: dict[Epoch, socket.socket] = {}
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._parked = asyncio.Event()  # set while the lot may be non-empty
        self._log = RateLog(log)

    async def start(self) -> str:
        """Listen for workers; the abstract socket name they connect to."""
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + self.name)
        self._listener.listen(16)
        self._listener.setblocking(False)
        self._spawn(self._accept_workers())
        self._spawn(self._sweep())
        return self.name

    def hold(self, job_id: str, epoch: int) -> None:
        """This agent is assigned `job_id`'s `epoch` (its worker starts now): wait for that
        epoch's connections; close those waiting for any other."""
        self._held = self._last = (dp.job_digest(job_id), epoch)
        self._held_name = f"job {job_id} epoch {epoch}"
        for p in self.parking:  # an early one of this epoch now waits as long as any
            if p.epoch == self._held:
                p.deadline = max(p.deadline, p.arrived + self.wait_s)
        self._drop(self.parking.take(lambda p: self._wait_for(p.epoch) is not None),
                   f"this agent now holds {self._held_name}")

    def release(self) -> None:
        """The held epoch is over here (its worker was stopped): close what waits for it.
        A later epoch of the same job may still come (`ahead_wait_s`)."""
        if self._held is None:
            return
        name, self._held = self._held_name, None
        self._drop(self.parking.take(lambda p: self._wait_for(p.epoch) is not None),
                   f"this agent's worker of {name} was stopped")

    def give(self, sock: socket.socket, hello: dp.Hello) -> None:
        """Hand `sock` (its hello unread) to the worker of the hello's epoch, now or once
        that worker claims it; close it at once when this agent runs no such epoch."""
        epoch = (hello.job, hello.epoch)
        if self._send(sock, epoch) == HANDED:
            return
        source = source_of(sock)
        wait = self._wait_for(epoch)
        if wait is None:
            self.refused += 1
            self._log.warning("refused", "data handoff: closed a connection from %s at once: "
                              "it dialled epoch %d of job %s…, which this agent neither runs "
                              "nor starts (%s)", source, hello.epoch, hello.job.hex()[:8],
                              self._held_name if self._held else "it holds no assignment")
            sock.close()
            return
        now = time.monotonic()
        for victim in self.parking.add(Parked(sock, epoch, source, now, now + wait)):
            self.evicted += 1
            self._log.warning("evicted", "data handoff: %d connections wait from %s, %d in "
                              "all (bounds %d and %d): closed the oldest from %s",
                              self.parking.held_by(source), source, len(self.parking),
                              self.parking.per_source, self.parking.total, victim.source)
            victim.sock.close()
        self._parked.set()

    async def aclose(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        for epoch in list(self._workers):
            self._forget(epoch)
        for p in self.parking.take(lambda p: False):
            p.sock.close()

    def _wait_for(self, epoch: Epoch) -> float | None:
        """How long a connection for `epoch` may wait for its worker; None: not at all."""
        if epoch == self._held or epoch in self._workers:
            return self.wait_s
        last = self._last
        if last is not None and epoch[0] == last[0] and epoch[1] > last[1]:
            return self.ahead_wait_s
        return None

    def _drop(self, parked: list[Parked], why: str) -> None:
        for p in parked:
            self.dropped += 1
            p.sock.close()
        if parked:
            log.info("data handoff: closed %d connection(s) waiting for another epoch: %s",
                     len(parked), why)

    def _spawn(self, coro: object) -> None:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _send(self, sock: socket.socket, epoch: Epoch) -> str:
        """Pass `sock` to its epoch's worker: HANDED, FULL (its queue is full: `sock` is
        still ours) or NO_WORKER (no live worker holds that epoch)."""
        conn = self._workers.get(epoch)
        if conn is None:
            return NO_WORKER
        try:
            socket.send_fds(conn, [b"x"], [sock.fileno()])
        except OSError as exc:
            if exc.errno in _WORKER_BUSY:
                self._flush_when_drained(conn, epoch)
                return FULL
            log.info("data handoff: the worker of epoch %d is gone (%s)", epoch[1], exc)
            self._forget(epoch)
            return NO_WORKER
        sock.close()  # the worker holds its own copy of the connection now
        self.handed += 1
        return HANDED

    def _flush(self, epoch: Epoch) -> None:
        """Hand the connections waiting for `epoch` to its worker, oldest first, while its
        queue takes them; those of a worker that is gone wait on (or end with their wait)."""
        conn = self._workers.get(epoch)
        if conn is not None:
            asyncio.get_running_loop().remove_writer(conn)
        for p in self.parking:
            if p.epoch != epoch:
                continue
            if self._send(p.sock, epoch) != HANDED:
                return
            self.parking.remove(p)

    def _flush_when_drained(self, conn: socket.socket, epoch: Epoch) -> None:
        """Hand on once the worker has taken some of its queue (its socket is writable):
        no polling, and the event loop never blocks on a worker that does not read."""
        asyncio.get_running_loop().add_writer(conn, self._flush, epoch)

    def _forget(self, epoch: Epoch) -> None:
        conn = self._workers.pop(epoch, None)
        if conn is not None:
            asyncio.get_running_loop().remove_writer(conn)
            conn.close()

    async def _sweep(self) -> None:
        """Close waiting connections whose dialer left, then those whose wait is over."""
        while True:
            if not len(self.parking):
                self._parked.clear()
                await self._parked.wait()
            await asyncio.sleep(self.sweep_s)
            for p in self.parking.gone():
                self.abandoned += 1
                p.sock.close()
            for p in self.parking.expired(time.monotonic()):
                self.dropped += 1
                self._log.warning("expired", "data handoff: %s dialled epoch %d but no worker "
                                  "of this agent took it within %g s: connection closed",
                                  p.source, p.epoch[1], p.deadline - p.arrived)
                p.sock.close()

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
        conn.setblocking(False)  # a full queue must not stall the event loop (`_send`)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.worker_queue_bytes)
        self._forget(epoch)
        # a job's older epochs are over once a newer one's worker starts here
        for stale in [e for e in self._workers if e[0] == epoch[0] and e[1] < epoch[1]]:
            self._forget(stale)
        self._workers[epoch] = conn
        log.info("data handoff: the worker of epoch %d takes its peers' connections",
                 epoch[1])
        self._flush(epoch)
