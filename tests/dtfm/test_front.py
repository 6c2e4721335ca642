"""The shared port's front (dtfm/front.py): a real gRPC server behind it on loopback, and
raw sockets speaking a dtfm hello, garbage, or nothing."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dtfm import rpc
from dtfm.core import dataplane as dp
from dtfm.front import DTFM, GARBAGE, GRPC, H2_PREFACE, Front, classify
from tests.certs import make_ca, make_leaf
from tests.netstat import listening_tcp_ports

pytestmark = pytest.mark.timeout(60)
TOKEN = "front-test-token-0123456789"


def test_classify_decides_on_the_fewest_bytes_that_tell() -> None:
    hello = dp.new_hello(dp.ROLE_DIAL, "job", 1, 0).pack()
    assert classify(hello) == DTFM and classify(hello[:2]) is None
    assert classify(H2_PREFACE) == GRPC and classify(H2_PREFACE[:5]) is None
    assert classify(b"\x16\x03\x01") == GRPC  # a TLS ClientHello
    assert classify(b"GET / HTTP/1.1\r\n") == GARBAGE and classify(b"PX") == GARBAGE
    assert classify(b"") is None


async def _served(front: Front, security: rpc.Security) -> tuple[object, int]:
    server, port, _ = await rpc.start_server("127.0.0.1:0", security, lambda s: [],
                                             "test daemon", front=front)
    return server, port


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
