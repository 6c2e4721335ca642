"""Socket and byte helpers of the mesh's connections (agent/worker/transport/mesh.py): a
tensor's bytes as a writable view, whether a connection's peer is gone, shutting a socket
down, dropping a refused payload and filling a receive from the mailbox. Moved out of the mesh
so that module stays about connections and frames.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import struct

import torch

from agent.worker.transport.work import TransportWork
from dtfm.net import dataplane as dp

DISCARD_CHUNK = 1 << 20
_TCP_ESTABLISHED = 1  # tcp_info's tcpi_state (linux/tcp_states.h)


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (any dtype, bfloat16 included)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"the dtfm transport sends contiguous CPU tensors: got {t.device} "
                         f"{'contiguous' if t.is_contiguous() else 'non-contiguous'}")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def gone(sock: socket.socket) -> str:
    """Why `sock`'s peer is gone ('' while the connection stands), without reading it: the
    kernel's TCP state shows a peer's FIN even behind unread bytes."""
    try:
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            return f"the connection failed: {os.strerror(err)}"
        state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
    except OSError:  # closed here meanwhile (its error says so), or not TCP: nothing known
        return ""
    return "" if state == _TCP_ESTABLISHED else "the peer closed the connection"


KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 5, 1, 3
# data sent and not acknowledged for this long ends the connection (Linux: TCP_USER_TIMEOUT;
# with keepalive, probes unanswered this long after the last byte received do): a path that
# black-holes a busy flow is otherwise retransmitted into for ~15 minutes. Short, as the loss
# costs a resume (`resume.py`) and must be found before a fast step's 10 s deadline
UNACKED_S = 8


def keep_alive(sock: socket.socket) -> None:
    """TCP keepalive on a data-plane connection: a NAT or firewall forgets an idle flow
    (often within minutes, not RFC 5382's two hours), and an end whose next act is a receive
    would then wait for frames the NAT drops until the receive's deadline. A probe after 5 s
    of silence keeps the mapping, or finds it gone (the peer answers the unknown flow with a
    reset, or nothing answers) within about `UNACKED_S`, and the connection is resumed
    (`resume.py`). A flow with data in flight gets no keepalive: its data unacknowledged for
    `UNACKED_S` ends it instead (a zero window whose probes are answered does not: a parked
    reader stays connected)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                       ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        if hasattr(socket, opt):  # Linux; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, UNACKED_S * 1000)


def abort(sock: socket.socket) -> None:
    """Give `sock` up with a reset, not a FIN: the connection is to be resumed, and a peer
    that saw a FIN after frames crossed would take it for its worker closing on purpose
    (`peer.Peer._detach`). Shutting the read side wakes a thread blocked reading it without
    sending anything; the close with a zero linger sends the reset."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RD)
    sock.close()


def shut(sock: socket.socket) -> None:
    """Shut `sock` down (its reader's recv returns) and close it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def discard(sock: socket.socket, n: int) -> None:
    """Read and drop `n` payload bytes a chunk at a time, so a frame refused for its length
    costs no memory of that length."""
    chunk = memoryview(bytearray(min(n, DISCARD_CHUNK)))
    while n > 0:
        k = min(n, len(chunk))
        dp.recv_into_exact(sock, chunk[:k])
        n -= k


def copy_in(tensor: torch.Tensor, work: TransportWork, buf: bytearray, src: int) -> None:
    """A mailbox message into its receive's tensor, outside the mesh's lock and with torch's
    copy, which releases the GIL: a plain memoryview copy of a large message holds the GIL
    (and the lock) for its whole length and stalls every other transport thread meanwhile."""
    n = tensor.numel() * tensor.element_size()
    if n != len(buf):
        work.finish(RuntimeError(f"rank {src} sent {len(buf)} bytes for a receive of "
                                   f"{n} bytes: the ends disagree on shape or dtype"))
        return
    if n:
        dst = torch.frombuffer(byte_view(tensor), dtype=torch.uint8)
        dst.copy_(torch.frombuffer(buf, dtype=torch.uint8))
    work.finish()
