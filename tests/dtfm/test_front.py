"""The shared port's front (dtfm/net/front.py): a real gRPC server behind it on loopback, and
raw sockets speaking a dtfm hello, garbage, or nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dtfm import rpc
from dtfm.net import dataplane as dp
from dtfm.net.front import DTFM, GARBAGE, GRPC, H2_PREFACE, H2_SETTINGS, Front, classify, needed
from dtfm.net.frontlimits import FrontLimits
from tests.certs import make_ca, make_leaf
from tests.netstat import listening_tcp_ports

pytestmark = pytest.mark.timeout(60)
TOKEN = "front-test-token-0123456789"
SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty HTTP/2 SETTINGS frame


def test_classify_decides_on_the_fewest_bytes_that_tell() -> None:
    hello = dp.new_hello(dp.ROLE_DIAL, "job", 1, 0).pack()
    assert classify(hello) == DTFM and classify(hello[:2]) is None
    assert classify(hello[:-1]) is None and needed(hello[:2]) == dp.HELLO_BYTES
    # gRPC: the preface and the header of its first frame, which must be SETTINGS
    assert classify(H2_PREFACE + SETTINGS) == GRPC and classify(H2_PREFACE[:5]) is None
    assert classify(H2_PREFACE) is None and needed(H2_PREFACE) == len(H2_PREFACE + SETTINGS)
    assert classify(H2_PREFACE + b"\x00\x00\x00\x01\x00\x00\x00\x00\x01") == GARBAGE
    client_hello = b"\x16\x03\x01\x02\x00\x01"  # a TLS record header, a ClientHello
    assert classify(client_hello, tls=True) == GRPC and classify(client_hello[:3], tls=True) is None
    assert classify(client_hello) == GARBAGE and classify(b"\x16") == GARBAGE  # TLS is off
    assert classify(b"\x16\x03\x01\x02\x00\x02", tls=True) == GARBAGE  # not a ClientHello
    assert classify(b"GET / HTTP/1.1\r\n") == GARBAGE and classify(b"PX") == GARBAGE
    assert classify(b"") is None and needed(b"") == 1


async def _served(front: Front, security: rpc.Security) -> tuple[object, int]:
    server, port, _ = await rpc.start_server("127.0.0.1:0", security, lambda s: [],
                                             "test daemon", front=front)
    return server, port


@contextlib.asynccontextmanager
async def _serving(front: Front, security: rpc.Security) -> AsyncIterator[int]:
    """A gRPC server behind `front`; its public port. Both stop on the way out."""
    server, port = await _served(front, security)
    try:
        yield port
    finally:
        await front.aclose()
        await server.stop(0)


async def _health(port: int, security: rpc.Security) -> int:
    async with rpc.open_channel(f"127.0.0.1:{port}", security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        return reply.status


async def _grpc_and_the_data_plane_share_one_port_and_only_it() -> None:
    got: list[tuple[socket.socket, dp.Hello]] = []
    front = Front(lambda sock, hello: got.append((sock, hello)))
    security = rpc.Security(token=TOKEN)
    server, port = await _served(front, security)
    try:
        assert listening_tcp_ports(os.getpid(), owned=True) == {port}  # gRPC: no TCP port
        assert await _health(port, security) == health_pb2.HealthCheckResponse.SERVING
        hello = dp.new_hello(dp.ROLE_DIAL, "job-a", 3, 1, 2)
        with socket.create_connection(("127.0.0.1", port)) as dialer:
            dialer.sendall(hello.pack() + b"after")
            for _ in range(200):
                if got:
                    break
                await asyncio.sleep(0.01)
            sock, seen = got[0]
            assert seen == hello
            sock.setblocking(True)
            # nothing was consumed: the data plane reads the hello as if it had accepted
            assert dp.recv_exact(sock, dp.HELLO_BYTES + 5) == hello.pack() + b"after"
            sock.sendall(b"reply")
            assert dp.recv_exact(dialer, 5) == b"reply"
            sock.close()
        assert (front.grpc_connections, front.data_connections, front.refused) == (1, 1, 0)
    finally:
        await front.aclose()
        await server.stop(0)


async def _closed_by_front(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if payload:
        writer.write(payload)
        await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    except ConnectionResetError:  # closed with our bytes unread: the kernel resets
        return b""
    finally:
        writer.close()


async def _garbage_and_silence_are_closed_counted_and_the_front_serves_on() -> None:
    front = Front(sniff_timeout_s=0.5)  # no data plane here: a dtfm hello is refused too
    security = rpc.Security(token=TOKEN)
    server, port = await _served(front, security)
    try:
        assert await _closed_by_front(port, b"GET / HTTP/1.1\r\n\r\n") == b""
        assert (front.refused, front.refused_bytes) == (1, 18)
        t0 = asyncio.get_running_loop().time()
        assert await _closed_by_front(port, b"") == b""  # says nothing: closed at the timeout
        assert asyncio.get_running_loop().time() - t0 >= 0.4
        assert await _closed_by_front(port, b"DT") == b""  # a hello that never completes
        hello = dp.new_hello(dp.ROLE_DIAL, "job-a", 3, 1).pack()
        assert await _closed_by_front(port, hello) == b""
        assert front.refused == 4 and front.data_connections == 0
        assert await _health(port, security) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await front.aclose()
        await server.stop(0)


async def _mutual_tls_grpc_is_spliced_through_the_front(tmp_path: Path) -> None:
    ca, ca_key, ca_cert = make_ca(tmp_path)
    cert, key = make_leaf(tmp_path, "node", ca_key, ca_cert)
    security = rpc.Security(token=TOKEN, tls_cert=str(cert), tls_key=str(key), tls_ca=str(ca))
    front = Front()
    server, port = await _served(front, security)
    try:
        assert await _health(port, security) == health_pb2.HealthCheckResponse.SERVING
        assert front.grpc_connections == 1 and front.refused == 0
    finally:
        await front.aclose()
        await server.stop(0)


# the daemons run on uvloop (dtfm.flags.run_loop): the front must work there and on asyncio
LOOPS = ["asyncio", "uvloop"]


def _run(loop: str, coro: Any) -> None:
    if loop == "uvloop":
        uvloop.run(coro)
    else:
        asyncio.run(coro)


@pytest.mark.parametrize("loop", LOOPS)
def test_grpc_and_the_data_plane_share_one_port_and_only_it(loop: str) -> None:
    _run(loop, _grpc_and_the_data_plane_share_one_port_and_only_it())


@pytest.mark.parametrize("loop", LOOPS)
def test_garbage_and_silence_are_closed_counted_and_the_front_serves_on(loop: str) -> None:
    _run(loop, _garbage_and_silence_are_closed_counted_and_the_front_serves_on())


@pytest.mark.parametrize("loop", LOOPS)
def test_mutual_tls_grpc_is_spliced_through_the_front(loop: str, tmp_path: Path) -> None:
    _run(loop, _mutual_tls_grpc_is_spliced_through_the_front(tmp_path))


# Issue 41: what a peer can make the front hold. An attacker dials from 127.0.0.2 (and .3),
# honest clients from 127.0.0.1: on loopback every 127/8 address is a source of its own.
SMALL = FrontLimits(grpc=3, grpc_per_source=2, sniffing=5, sniffing_per_source=3, pipes=4)


def _dial(port: int, payload: bytes, source: str = "127.0.0.2") -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))  # the kernel completes it; the front accepts later
    s.sendall(payload)
    return s


async def _until(ready: Callable[[], bool], what: Callable[[], object]) -> None:
    for _ in range(1000):
        if ready():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not so after 10 s: {what()}")


def _held(front: Front) -> tuple[int, int, int, int]:
    return front.sniffing, front.spliced, front.refused, front.over_limit


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _floods_from_one_source_leave_room_for_a_real_client() -> None:
    limits = FrontLimits(grpc=16, grpc_per_source=4, sniffing=32, sniffing_per_source=8,
                         pipes=4)
    front = Front(limits=limits)
    security = rpc.Security(token=TOKEN)
    held: list[socket.socket] = []
    async with _serving(front, security) as port, contextlib.AsyncExitStack() as stack:
        fds = _open_fds()
        # a preface and nothing, one byte and nothing; from .3 a preface, SETTINGS, nothing
        for payload, source in ((H2_PREFACE, "127.0.0.2"), (b"P", "127.0.0.2"),
                                (H2_PREFACE + SETTINGS, "127.0.0.3")):
            held += [stack.enter_context(_dial(port, payload, source)) for _ in range(100)]
        await _until(lambda: _held(front) == (8, 4, 288, 288), lambda: _held(front))
        # the front holds 8 + 2 * 4 of its own, gRPC 4 more: not a descriptor per attempt
        assert _open_fds() - fds - len(held) <= 8 + 2 * 4 + 4 + 2 * limits.pipes
        assert await _health(port, security) == health_pb2.HealthCheckResponse.SERVING
        assert front.grpc_connections == 5  # the attacker's 4 and the real client


@pytest.mark.parametrize("loop", LOOPS)
def test_floods_from_one_source_leave_room_for_a_real_client(
        loop: str, caplog: pytest.LogCaptureFixture) -> None:
    _run(loop, _floods_from_one_source_leave_room_for_a_real_client())
    refusals = [r for r in caplog.records if "front: refused a connection" in r.getMessage()]
    assert 1 <= len(refusals) <= 2, "288 refusals: the log says so once per 10 s"
    assert "LimitNOFILE" in refusals[0].getMessage()


async def _caps_per_source_and_in_total_are_enforced_and_counted() -> None:
    front = Front(limits=SMALL)
    security = rpc.Security(token=TOKEN)
    async with _serving(front, security) as port:
        sorting = [_dial(port, b"P") for _ in range(4)]  # 3 per source
        sorting += [_dial(port, b"D", "127.0.0.3") for _ in range(3)]  # 5 in all
        await _until(lambda: _held(front) == (5, 0, 2, 2), lambda: _held(front))
        for s in sorting:  # closed half-way: not refused, the slots are free again
            s.close()
        await _until(lambda: _held(front) == (0, 0, 2, 2), lambda: _held(front))
        spliced = [_dial(port, H2_PREFACE + SETTINGS) for _ in range(3)]  # 2 per source
        spliced += [_dial(port, H2_PREFACE + SETTINGS, "127.0.0.3") for _ in range(2)]  # 3
        await _until(lambda: _held(front) == (0, 3, 4, 4), lambda: _held(front))
        assert await _closed_by_front(port, H2_PREFACE + SETTINGS) == b""  # full: refused
        assert front.over_limit == 5 and front.refused == 5
        for s in spliced:  # the attacker leaves: its splices end, and room is made
            s.close()
        await _until(lambda: _held(front) == (0, 0, 5, 5), lambda: _held(front))
        assert await _health(port, security) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("loop", LOOPS)
def test_caps_per_source_and_in_total_are_enforced_and_counted(loop: str) -> None:
    _run(loop, _caps_per_source_and_in_total_are_enforced_and_counted())


async def _tls_and_prefaces_that_go_no_further_are_closed() -> None:
    front = Front(sniff_timeout_s=0.5, idle_timeout_s=1.0)
    security = rpc.Security(token=TOKEN)  # no TLS here
    async with _serving(front, security) as port:
        assert await _closed_by_front(port, b"\x16\x03\x01\x02\x00\x01") == b""
        assert (front.refused, front.grpc_connections) == (1, 0)
        assert await _closed_by_front(port, H2_PREFACE) == b""  # no frame: the sniff deadline
        assert (front.refused, front.grpc_connections) == (2, 0)
        loop = asyncio.get_running_loop()
        t0 = loop.time()  # a SETTINGS frame, then nothing: gRPC answers, the front ends it
        assert (await _closed_by_front(port, H2_PREFACE + SETTINGS))[3] == H2_SETTINGS
        assert loop.time() - t0 >= 0.9
        assert (front.grpc_connections, front.idle_closed, front.spliced) == (1, 1, 0)
        assert await _health(port, security) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("loop", LOOPS)
def test_tls_and_prefaces_that_go_no_further_are_closed(loop: str) -> None:
    _run(loop, _tls_and_prefaces_that_go_no_further_are_closed())


async def _cpu_over(seconds: float) -> float:
    t0 = time.process_time()
    await asyncio.sleep(seconds)
    return time.process_time() - t0


async def _parked_partial_connections_cost_no_cpu() -> None:
    front = Front(sniff_timeout_s=60, limits=FrontLimits(
        grpc=16, grpc_per_source=16, sniffing=300, sniffing_per_source=300, pipes=4))
    await front.start("127.0.0.1", 0, "no-grpc-here")
    held: list[socket.socket] = []
    try:
        idle = await _cpu_over(1.0)
        for payload in (b"P", b"D", H2_PREFACE, dp.MAGIC):  # each part of what it needs
            held += [_dial(front.port, payload) for _ in range(60)]
        await _until(lambda: _held(front) == (240, 0, 0, 0), lambda: _held(front))
        parked = await _cpu_over(1.0)
        # polled, 240 partial connections took about a third of a core
        assert parked <= 3 * idle + 0.03, (parked, idle)
        assert front.refused == 0
    finally:
        for s in held:
            s.close()
        await front.aclose()


@pytest.mark.parametrize("loop", LOOPS)
def test_parked_partial_connections_cost_no_cpu(loop: str) -> None:
    _run(loop, _parked_partial_connections_cost_no_cpu())
