"""Pass bytes between two connected sockets, both ways, inside the kernel (splice(2)).

The one-port front (dtfm/net/front.py) joins each gRPC connection to the daemon's gRPC server.
Copying through Python on the event loop halved a bulk stream's rate on loopback
(bench/sharedport.py); `splice` moves the bytes socket -> pipe -> socket without them
entering user space. The event loop drives it (issue 41): a thread per direction and a pipe
each made every connection, even an idle one, cost two threads and six descriptors, and let
~140 silent connections exhaust a coordinator. Here a connection holds only its two sockets;
a pipe is lent from a bounded pool (`Pipes`) while bytes are in flight. Measured side by
side (bench/sharedport.py), the loop is no slower for gRPC than the threads were.
A direction ends at its source's EOF (passed on as a half-close); an error in either ends
both. Linux only, as the rest of the data plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
from collections.abc import Callable
from typing import Protocol

_CHUNK = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_SPLICE_FLAGS = os.SPLICE_F_NONBLOCK | os.SPLICE_F_MOVE
_WAKE_BUDGET = 8 * _CHUNK  # bytes one direction moves per wake before the loop serves others
_COPY_CHUNK = 64 << 10  # read through user space at a time when no pipe is free


class Joined(Protocol):
    """Two sockets joined both ways (what a `Splicer` returns)."""

    last_active: float  # loop time of the last byte moved either way

    def start(self) -> None: ...

    def close(self) -> None: ...


# (a, b, on_done) -> the join of a and b, calling on_done(join) once both are closed
Splicer = Callable[[socket.socket, socket.socket, Callable[[Joined], None]], Joined]


class Pipes:
    """Kernel pipes lent to splices while bytes are in flight, at most `limit` open at once:
    an idle connection holds none, so descriptors grow with the traffic in flight, not with
    the connections held."""

    def __init__(self, limit: int, spare: int = 4) -> None:
        self.limit, self.spare = limit, spare
        self.open = 0
        self._free: list[tuple[int, int]] = []

    def take(self) -> tuple[int, int] | None:
        """An empty pipe (read end, write end), or None when `limit` are lent out."""
        if self._free:
            return self._free.pop()
        if self.open >= self.limit:
            return None
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        with contextlib.suppress(OSError):  # a smaller pipe only means more calls
            fcntl.fcntl(w, _F_SETPIPE_SZ, _CHUNK)
        self.open += 1
        return r, w

    def give(self, pipe: tuple[int, int], empty: bool = True) -> None:
        """Return a pipe; one that may still hold bytes (`empty` False) is closed."""
        if empty and len(self._free) < self.spare:
            self._free.append(pipe)
            return
        os.close(pipe[0])
        os.close(pipe[1])
        self.open -= 1

    def close(self) -> None:
        while self._free:
            self.give(self._free.pop(), empty=False)


class _Flow:
    """One direction of a splice: bytes from `src` to `dst`."""

    def __init__(self, src: socket.socket, dst: socket.socket) -> None:
        self.src, self.dst = src, dst
        self.pipe: tuple[int, int] | None = None
        self.in_pipe = 0  # bytes in `pipe`, not yet passed on
        self.copied = b""  # bytes read without a pipe (none was free), not yet passed on
        self.eof = False


class LoopSplice:
    """Two sockets joined both ways by the event loop that runs this: on readability the
    bytes go socket -> pipe -> socket in the kernel (splice(2), non-blocking); when the
    destination is full the source is not read until it drains (no buffering beyond one
    pipe). A direction ends at its source's EOF (passed on as a half-close); an error in
    either ends both. `last_active` is the loop time of the last byte moved either way."""

    def __init__(self, a: socket.socket, b: socket.socket, pipes: Pipes,
                 on_done: Callable[[Joined], None] = lambda s: None) -> None:
        self.a, self.b, self.pipes, self.on_done = a, b, pipes, on_done
        self.loop = asyncio.get_running_loop()
        self.last_active = self.loop.time()
        self.closed = False
        self._flows = (_Flow(a, b), _Flow(b, a))
        for s in (a, b):
            s.setblocking(False)

    def start(self) -> None:
        for f in self._flows:
            self.loop.add_reader(f.src.fileno(), self._readable, f)

    def close(self) -> None:
        """End both directions now and close both sockets."""
        if self.closed:
            return
        self.closed = True
        for s in (self.a, self.b):
            self.loop.remove_reader(s.fileno())
            self.loop.remove_writer(s.fileno())
        for f in self._flows:
            if f.pipe is not None:
                self.pipes.give(f.pipe, empty=False)
                f.pipe = None
        self.a.close()
        self.b.close()
        self.on_done(self)

    def _readable(self, f: _Flow) -> None:
        try:
            budget = _WAKE_BUDGET  # then let the loop serve others
            while not self.closed:
                if f.pipe is None:
                    f.pipe = self.pipes.take()
                if f.pipe is None:  # every pipe is lent: copy this much through user space
                    f.copied = f.src.recv(_COPY_CHUNK)
                    n = len(f.copied)
                else:
                    n = f.in_pipe = os.splice(f.src.fileno(), f.pipe[1], _CHUNK,
                                              flags=_SPLICE_FLAGS)
                if n == 0:
                    self._eof(f)
                    return
                budget -= n
                if not self._drain(f) or budget <= 0 or n < _COPY_CHUNK:
                    return  # less than a chunk: most likely all there was (else: woken again)
        except BlockingIOError:
            self._release(f)
        except OSError:
            self.close()

    def _writable(self, f: _Flow) -> None:
        try:
            if not self._drain(f):
                return
        except OSError:
            self.close()
            return
        self.loop.remove_writer(f.dst.fileno())
        self.loop.add_reader(f.src.fileno(), self._readable, f)

    def _drain(self, f: _Flow) -> bool:
        """Pass on what `f` holds; False (and wait for `dst`) when it takes no more now."""
        self.last_active = self.loop.time()
        try:
            while f.in_pipe:
                assert f.pipe is not None
                f.in_pipe -= os.splice(f.pipe[0], f.dst.fileno(), f.in_pipe,
                                       flags=_SPLICE_FLAGS)
            while f.copied:
                f.copied = f.copied[f.dst.send(f.copied):]
        except BlockingIOError:
            self.loop.remove_reader(f.src.fileno())
            self.loop.add_writer(f.dst.fileno(), self._writable, f)
            return False
        self._release(f)
        return True

    def _release(self, f: _Flow) -> None:
        if f.pipe is not None and not f.in_pipe:
            self.pipes.give(f.pipe)
            f.pipe = None

    def _eof(self, f: _Flow) -> None:
        f.eof = True
        self._release(f)
        self.loop.remove_reader(f.src.fileno())
        with contextlib.suppress(OSError):
            f.dst.shutdown(socket.SHUT_WR)  # EOF on to the other end; it may still answer
        if all(g.eof and not g.in_pipe and not g.copied for g in self._flows):
            self.close()
