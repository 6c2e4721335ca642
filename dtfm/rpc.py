"""gRPC plumbing both daemons share: the join token, TLS, health and reflection.

Security is the same on every dtfm endpoint, so it lives once here: every RPC except
`grpc.health.v1.Health` needs `authorization: Bearer <token>`; TLS or mutual TLS when cert
flags are given; plaintext only without them (with a warning off loopback). Callers get a
ready `grpc.aio.Server` or channel and never touch credentials themselves.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import logging
import os
import random
import socket
import stat
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from dtfm.net.front import Front, backend_address

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
TOKEN_ENV = "DTFM_TOKEN"
MIN_TOKEN_BYTES = 16
MAKE_TOKEN = "head -c 32 /dev/urandom | base64 > FILE"
# Large enough for a bandwidth probe chunk and a status with a 64x64 link matrix.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# A stream's flow-control window from the start: without it HTTP/2 opens the window over
# several round trips, and a probe over a 300 ms path reads low until it has.
WINDOW_BYTES = 16 * 1024 * 1024
FLOW_CONTROL = [("grpc.http2.lookahead_bytes", WINDOW_BYTES)]
CHANNEL_OPTIONS = [
    *FLOW_CONTROL,
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [
    *FLOW_CONTROL,
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # A port another process already serves is an error, not a port silently shared.
    ("grpc.so_reuseport", 0),
]


class ConfigError(ValueError):
    """A setting a person must fix before the daemon can start."""


@dataclass(frozen=True)
class Security:
    """The join token and the optional TLS material of one process."""

    token: str
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert or self.tls_ca)

    def validate(self) -> None:
        if not self.token:
            raise ConfigError(
                f"no join token: pass --token-file FILE or set {TOKEN_ENV}; every daemon and "
                "client of one cluster must share the same token"
            )
        check_token(self.token)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together: give both or neither")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ConfigError(f"--{name.replace('_', '-')} {path}: no such file")

    @staticmethod
    def read(path: str) -> bytes | None:
        return Path(path).read_bytes() if path else None


def check_token(token: str, what: str = f"the join token (--token-file or ${TOKEN_ENV})"
                ) -> None:
    """Refuse a token that is short or would corrupt the `authorization` header (or any call
    metadata); `what` names the token and where it came from.

    The message never shows the token itself.
    """
    size = len(token.encode())
    if size < MIN_TOKEN_BYTES:
        raise ConfigError(f"{what} is {size} bytes; "
                          f"use at least {MIN_TOKEN_BYTES} random ones, for example "
                          f"`{MAKE_TOKEN}`")
    for i, c in enumerate(token):
        if not " " <= c <= "~":
            raise ConfigError(f"{what} has {c!r} at "
                              f"position {i}: use printable ASCII "
                              f"only (no control characters), for example `{MAKE_TOKEN}`")


def _warn_if_readable(token_file: str, st: os.stat_result, grants: str) -> None:
    """Warn when the token file's group or others can read it (`install.sh` makes it 0600)."""
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("token file %s is readable by %s (mode %04o): whoever reads it can %s; "
                    "run `chmod 600 %s`", token_file,
                    "others" if mode & stat.S_IROTH else "its group", mode, grants, token_file)


def load_token(token_file: str | None, env: str = TOKEN_ENV,
               grants: str = "join the cluster") -> str:
    """The token from `token_file`, else from $`env` (default $DTFM_TOKEN), else ''.
    `grants`: what whoever reads the file can do, for the warning about a readable one."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
            st = os.stat(token_file)
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or "not UTF-8 text"
            raise ConfigError(f"cannot read token file {token_file}: {reason}") from exc
        if not token:
            raise ConfigError(f"token file {token_file} is empty; put the token in it")
        _warn_if_readable(token_file, st, grants)
        return token
    return os.environ.get(env, "").strip()


def split_hostport(value: str, what: str = "address") -> tuple[str, int]:
    """Parse HOST:PORT (or [v6]:PORT) with a message that says what to type instead."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{what} {value!r} is not HOST:PORT (for example 127.0.0.1:7070)")
    return host.strip("[]"), int(port)


# The ports a job's rank 0 hosts its rendezvous store on (`EpochPlanner.rendezvous_port`
# draws the even ones), which `free_port` leaves alone.
RENDEZVOUS_PORTS = range(29500, 30500)
# `free_port` draws from here up to the kernel's ephemeral range.
FREE_PORTS_FROM = 20000


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (for a rendezvous or a test daemon).

    Drawn at random below the kernel's ephemeral range, not with `bind(port 0)`: the caller
    hands the number to a process that binds it seconds later (a worker importing torch), and
    a port from the ephemeral range can meanwhile become the source port of any outgoing
    connection or the port of any `bind(0)` on the machine (gloo opens dozens of each), which
    then fails the rendezvous with "Address already in use". Below the range only another
    explicit choice can take it. Falls back to `bind(0)` where the range leaves no room."""
    low = ephemeral_low()
    ports = [p for p in range(FREE_PORTS_FROM, low) if p not in RENDEZVOUS_PORTS]
    rng = random.SystemRandom()
    for port in rng.sample(ports, min(64, len(ports))):
        if _bindable(host, port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port the kernel hands out on its own (32768 when it cannot be read)."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def listening(address: str, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections at HOST:PORT now (a daemon that started)."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout):
            return True
    except OSError:
        return False


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Undecodable:
    """Stands in for a request whose bytes did not parse, so the handler can refuse it."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's fault
            return _Undecodable(exc)

    return parse


def _undecodable_reason(method: str, bad: _Undecodable) -> str:
    return f"{method}: the request is not a valid protobuf message for this RPC ({bad.error})"


class BoundaryInterceptor(grpc.aio.ServerInterceptor):
    """The edge of every dtfm server: the bearer token, and requests that do not parse.

    Every RPC but health needs the cluster's token. Bytes that are not the RPC's message get
    INVALID_ARGUMENT (grpc's default would be an opaque INTERNAL) before any handler runs.
    """

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get("authorization", "")
        given_b = given.encode() if isinstance(given, str) else bytes(given)
        if not hmac.compare_digest(given_b, self._expected):
            reason = (
                "missing authorization metadata: send 'authorization: Bearer <token>' "
                "(--token-file or DTFM_TOKEN)"
                if not given
                else "wrong join token: use the token the coordinator was started with"
            )
            return _refusing_handler(handler, reason)
        return _validating_handler(handler, method)


def _refusing_handler(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def refuse_stream(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        yield  # pragma: no cover - makes this an async generator

    kw = {
        "request_deserializer": _safe(handler.request_deserializer),
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **kw)


def _validating_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    kw = {
        "request_deserializer": _safe(handler.request_deserializer),
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    _undecodable_reason(method, request))
            return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)
    if handler.unary_stream:
        inner_us = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    _undecodable_reason(method, request))
            async for item in inner_us(request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)

    async def checked(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async for request in requests:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    _undecodable_reason(method, request))
            yield request

    if handler.stream_unary:
        inner_su = handler.stream_unary

        async def stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            return await inner_su(checked(requests, context), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, **kw)
    inner_ss = handler.stream_stream

    async def stream_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async for item in inner_ss(checked(requests, context), context):
            yield item

    return grpc.stream_stream_rpc_method_handler(stream_stream, **kw)


async def start_server(
    listen: str,
    security: Security,
    register: Callable[[grpc.aio.Server], Iterable[str]],
    what: str,
    front: Front | None = None,
) -> tuple[grpc.aio.Server, int, HealthServicer]:
    """Build, bind and start a server; `register` adds servicers and returns service names.

    With `front` (dtfm/net/front.py) the front owns `listen`'s port and splices gRPC to this
    server, which then listens only on an abstract Unix socket: one TCP port for gRPC and
    the data plane. Returns the server, the public port (useful with port 0) and the health
    servicer.
    """
    security.validate()
    host, wanted_port = split_hostport(listen, "listen address")
    check_bindable(host, wanted_port, listen, what)
    server = grpc.aio.server(
        interceptors=[BoundaryInterceptor(security.token)], options=SERVER_OPTIONS
    )
    names = list(register(server))
    backend = backend_address() if front is not None else ""
    address = f"unix-abstract:{backend}" if front is not None else listen
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME],
        server,
    )
    if security.tls:
        if not security.tls_cert:
            raise ConfigError(f"{what}: --tls-ca needs --tls-cert and --tls-key to serve TLS")
        creds = grpc.ssl_server_credentials(
            [(Security.read(security.tls_key), Security.read(security.tls_cert))],
            root_certificates=Security.read(security.tls_ca),
            require_client_auth=bool(security.tls_ca),
        )
        port = _bind(lambda: server.add_secure_port(address, creds), listen, what)
    else:
        if not is_loopback(host):
            log.warning(
                "%s listens on %s WITHOUT TLS: the join token and all traffic cross the network "
                "in clear; pass --tls-cert/--tls-key (and --tls-ca for mutual TLS)",
                what,
                listen,
            )
        port = _bind(lambda: server.add_insecure_port(address), listen, what)
    await server.start()
    if front is not None:
        try:
            port = await front.start(host, wanted_port, backend, tls=security.tls)
        except OSError as exc:
            await server.stop(grace=0)
            raise ConfigError(f"{what}: cannot listen on {listen}: {exc.strerror}; pick "
                              f"another --listen") from exc
    for name in names:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, port, health


def check_bindable(host: str, port: int, listen: str, what: str) -> None:
    """Refuse a listen address this process cannot bind, saying why (grpc only says 'failed')."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, addr in infos:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(addr)
    except OSError as exc:
        reason = ("the port is in use (is another daemon running?)"
                  if exc.errno == errno.EADDRINUSE else
                  f"{exc.strerror or exc}; is {host} an address of this machine?")
        raise ConfigError(f"{what}: cannot listen on {listen}: {reason}; pick another "
                          "--listen or stop the process holding it") from None


def _bind(add_port: Callable[[], int], listen: str, what: str) -> int:
    """The bound port, or a ConfigError a person can act on (grpc raises RuntimeError)."""
    try:
        port = add_port()
    except RuntimeError:
        port = 0
    if port == 0:
        raise ConfigError(f"{what}: cannot listen on {listen}: the port is in use or the host "
                          "is not an address of this machine; pick another --listen")
    return port


class _TokenHeader:
    """Adds the bearer token to a call's metadata, on plaintext and TLS channels alike.

    grpc.aio files each interceptor under one call type only, so there is one subclass per
    type below, all sharing this.
    """

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(*self._header)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials,
            details.wait_for_ready,
        )


class _UnaryUnaryToken(_TokenHeader, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request)


class _UnaryStreamToken(_TokenHeader, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request)


class _StreamUnaryToken(_TokenHeader, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request_iterator)


class _StreamStreamToken(_TokenHeader, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request_iterator)


def open_channel(target: str, security: Security) -> grpc.aio.Channel:
    """An aio channel to `target` carrying the token, over TLS when TLS material is given."""
    split_hostport(target, "address")
    interceptors: list[Any] = (
        [cls(security.token) for cls in (_UnaryUnaryToken, _UnaryStreamToken, _StreamUnaryToken,
                                         _StreamStreamToken)]
        if security.token else []
    )
    if security.tls:
        creds = grpc.ssl_channel_credentials(
            root_certificates=Security.read(security.tls_ca),
            private_key=Security.read(security.tls_key),
            certificate_chain=Security.read(security.tls_cert),
        )
        return grpc.aio.secure_channel(
            target, creds, options=CHANNEL_OPTIONS, interceptors=interceptors
        )
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS, interceptors=interceptors)


def describe_rpc_error(exc: grpc.RpcError, target: str) -> str:
    """One line a person can act on, for an RPC that failed against `target`."""
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.UNAVAILABLE:
        return (
            f"cannot reach {target}: {detail}. Is the daemon running there, and do the TLS "
            "flags match its own?"
        )
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return f"{target} refused the call: {detail}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"{target} did not answer in time: {detail}"
    name = code.name if code is not None else "ERROR"
    return f"{target} answered {name}: {detail}"
