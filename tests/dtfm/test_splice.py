"""The front's event-loop splice (dtfm/net/splice.py): bytes arrive whole and in order both ways,
through a slow reader (the source is not read while the destination is full), with fewer
pipes than directions (the rest copy through user space), and EOF passes on as a half-close."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import threading
from typing import Any

import pytest
import uvloop

from dtfm.net.splice import Joined, LoopSplice, Pipes

pytestmark = pytest.mark.timeout(60)
MIB = 1 << 20


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)


def _recv_all(sock: socket.socket, out: list[bytes], slow: bool) -> None:
    got = []
    while chunk := sock.recv(4096 if slow else MIB):
        got.append(chunk)
    out.append(b"".join(got))


async def _two_splices_through_one_pipe() -> None:
    pipes = Pipes(limit=1)
    done: list[Joined] = []
    ends, threads, received = [], [], []
    sent = [os.urandom(6 * MIB) for _ in range(4)]
    for i in range(2):
        a, a_peer = socket.socketpair()
        b, b_peer = socket.socketpair()
        LoopSplice(a, b, pipes, done.append).start()
        ends += [a_peer, b_peer]
        for src, dst, data, slow in ((a_peer, b_peer, sent[2 * i], i == 0),
                                     (b_peer, a_peer, sent[2 * i + 1], i == 1)):
            out: list[bytes] = []
            received.append(out)
            threads += [threading.Thread(target=_send, args=(src, data)),
                        threading.Thread(target=_recv_all, args=(dst, out, slow))]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        assert pipes.open <= 1
        await asyncio.sleep(0.01)
    assert [hashlib.sha256(r[0]).digest() for r in received] == [
        hashlib.sha256(d).digest() for d in sent]
    for _ in range(100):  # both directions ended: each splice closes its sockets
        if len(done) == 2:
            break
        await asyncio.sleep(0.01)
    assert len(done) == 2 and all(s.closed for s in done)  # type: ignore[attr-defined]
    for e in ends:
        e.close()
    pipes.close()
    assert pipes.open == 0


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_two_splices_through_one_pipe(loop: str) -> None:
    run: Any = uvloop.run if loop == "uvloop" else asyncio.run
    run(_two_splices_through_one_pipe())


def _send_until_cut(sock: socket.socket, errors: list[OSError]) -> None:
    try:
        sock.sendall(os.urandom(8 * MIB))
    except OSError as exc:
        errors.append(exc)


async def _closing_with_bytes_in_flight_returns_every_pipe() -> None:
    pipes = Pipes(limit=2)
    a, a_peer = socket.socketpair()
    b, b_peer = socket.socketpair()  # b_peer never reads: the bytes stop in the pipe
    done: list[Joined] = []
    splice = LoopSplice(a, b, pipes, done.append)
    splice.start()
    cut: list[OSError] = []
    writer = threading.Thread(target=_send_until_cut, args=(a_peer, cut), daemon=True)
    writer.start()
    for _ in range(200):
        if pipes.open:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    assert pipes.open == 1  # held while its bytes wait for b_peer
    splice.close()
    assert done == [splice] and a.fileno() == -1 and b.fileno() == -1
    pipes.close()
    assert pipes.open == 0  # the pipe that held bytes was closed, not lent again
    writer.join(10)  # the writer's peer is gone: it fails instead of blocking
    assert not writer.is_alive() and cut
    a_peer.close()
    b_peer.close()


def test_closing_with_bytes_in_flight_returns_every_pipe() -> None:
    asyncio.run(_closing_with_bytes_in_flight_returns_every_pipe())
