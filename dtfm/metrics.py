"""The Prometheus endpoint both daemons serve behind `--metrics-listen HOST:PORT`.

Owns the HTTP side only: a tiny HTTP/1.1 responder on the daemon's own event loop that renders
one `CollectorRegistry` per request. Serving on the loop (not prometheus_client's thread
server) means collectors read the daemon's live objects from the thread that mutates them, so
there is nothing to lock and nothing to keep in sync. What each daemon exports lives in
`coordinator/daemon/metrics.py` and `agent/daemon/metrics.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from dtfm.rpc import ConfigError, split_hostport

log = logging.getLogger(__name__)
HEADER_LIMIT = 16 * 1024
READ_TIMEOUT_S = 10.0
INDEX = b'<html><body><a href="/metrics">/metrics</a></body></html>\n'


def _response(status: str, content_type: str, body: bytes, head_only: bool = False) -> bytes:
    headers = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
               f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return headers.encode("ascii") + (b"" if head_only else body)


def render(registry: CollectorRegistry, request_line: bytes) -> bytes:
    """The whole HTTP response to one request line (`GET /metrics HTTP/1.1`)."""
    parts = request_line.decode("latin-1").split()
    if len(parts) != 3:
        return _response("400 Bad Request", "text/plain", b"malformed request line\n")
    method, target = parts[0], parts[1].split("?", 1)[0]
    if method not in ("GET", "HEAD"):
        return _response("405 Method Not Allowed", "text/plain", b"use GET\n")
    head = method == "HEAD"
    if target == "/":
        return _response("200 OK", "text/html", INDEX, head)
    if target != "/metrics":
        return _response("404 Not Found", "text/plain", b"metrics are at /metrics\n", head)
    try:
        body = generate_latest(registry)
    except Exception as exc:  # a collector bug must not take the daemon down
        log.exception("collecting metrics failed")
        return _response("500 Internal Server Error", "text/plain",
                         f"collecting metrics failed: {exc}\n".encode(), head)
    return _response("200 OK", CONTENT_TYPE_LATEST, body, head)


async def _handle(registry: CollectorRegistry, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter) -> None:
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
        writer.write(render(registry, head.split(b"\r\n", 1)[0]))
        await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
            ConnectionError):
        pass  # a client that hangs up or sends junk gets nothing
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def serve_metrics(listen: str, registry: CollectorRegistry) -> tuple[asyncio.Server, int]:
    """Listen on `listen` (HOST:PORT, port 0: any free one); returns the server and its port."""
    host, port = split_hostport(listen, "--metrics-listen")
    try:
        server = await asyncio.start_server(lambda r, w: _handle(registry, r, w), host, port,
                                            limit=HEADER_LIMIT)
    except OSError as exc:
        raise ConfigError(f"--metrics-listen {listen}: cannot listen ({exc.strerror}); pick "
                          "a free port or another address") from None
    bound = server.sockets[0].getsockname()[1]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return server, bound
