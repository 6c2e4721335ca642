"""Pass bytes between two connected sockets, both ways, inside the kernel (splice(2)).

The one-port front (dtfm/front.py) joins each gRPC connection to the daemon's gRPC server.
Copying through Python on the event loop halved a bulk stream's rate on loopback
(bench/sharedport.py) and spent the daemon's loop on it; `splice` moves the bytes socket ->
pipe -> socket without them entering user space, on one thread per direction that blocks in
the kernel (no GIL held). A direction ends at its source's EOF (passed on as a half-close);
an error in either ends both. Linux only, as the rest of the data plane.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import threading
from collections.abc import Callable

_CHUNK = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


class Splice:
    """Two sockets joined both ways until both directions end; `close` ends them now."""

    def __init__(self, a: socket.socket, b: socket.socket,
                 on_done: Callable[[Splice], None] = lambda s: None) -> None:
        self.a, self.b, self.on_done = a, b, on_done
        self._left = 2
        self._lock = threading.Lock()
        for s in (a, b):
            s.setblocking(True)

    def start(self, name: str = "dtfm-splice") -> None:
        for src, dst in ((self.a, self.b), (self.b, self.a)):
            threading.Thread(target=self._pump, args=(src, dst), name=name,
                             daemon=True).start()

    def close(self) -> None:
        """End both directions (their threads return; the sockets close with the last)."""
        for s in (self.a, self.b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        r, w = os.pipe()
        try:
            with contextlib.suppress(OSError):  # a smaller pipe only means more calls
                fcntl.fcntl(w, _F_SETPIPE_SZ, _CHUNK)
            while True:
                n = os.splice(src.fileno(), w, _CHUNK)
                if n == 0:
                    break
                while n:
                    n -= os.splice(r, dst.fileno(), n)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)  # EOF on to the other end; it may still answer
        except OSError:
            self.close()
        finally:
            os.close(r)
            os.close(w)
            with self._lock:
                self._left -= 1
                last = self._left == 0
            if last:
                self.a.close()
                self.b.close()
                self.on_done(self)
