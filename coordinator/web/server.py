"""The web view's HTTP server (`coordinator start --web HOST:PORT`), on the coordinator's loop.

Like the Prometheus endpoint (dtfm/metrics.py) it is a small HTTP/1.1 responder on asyncio
streams, not a framework: the page is one file with two assets and three JSON routes, and
serving on the daemon's own loop lets every answer read the live registry and job without
locks. Routes:
- `/login?token=...`: the join token buys a session cookie and a redirect to `/` (sessions.py);
- `/`, `/app.js`, `/style.css`: the page, shipped in `static/` (no build step, no CDN);
- `/api/status`: the `coordinator status --json` document; `/api/view`: it plus what the page
  draws (view.py); `/api/events`: the same, pushed every second as server-sent events.
Everything but `/login` needs a session: 401 and no data without one.

It faces the network (`--web 0.0.0.0:PORT`), so what a client can make it hold is bounded: a
request head of `HEAD_LIMIT` bytes and `MAX_HEADERS` lines read within `READ_TIMEOUT_S`, no
body, `MAX_CONNECTIONS` at once (`MAX_STREAMS` of them event streams, each for at most
`STREAM_MAX_S`), and a client that stops reading is dropped after `WRITE_TIMEOUT_S`. No request
target is ever logged: `/login`'s carries the token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
import time
import urllib.parse
from dataclasses import dataclass
from importlib import resources

from coordinator.web.sessions import Sessions
from coordinator.web.view import View
from dtfm.rpc import ConfigError, Security, is_loopback, split_hostport

log = logging.getLogger(__name__)

DEFAULT_WEB = "127.0.0.1:7080"
HEAD_LIMIT = 16 * 1024
MAX_HEADERS = 64
READ_TIMEOUT_S = 10.0
WRITE_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64
MAX_STREAMS = 16
STREAM_EVERY_S = 1.0
STREAM_MAX_S = 3600.0
BAD_LOGIN_DELAY_S = 1.0
STATIC = {"/": ("index.html", "text/html; charset=utf-8"),
          "/index.html": ("index.html", "text/html; charset=utf-8"),
          "/app.js": ("app.js", "text/javascript; charset=utf-8"),
          "/style.css": ("style.css", "text/css; charset=utf-8")}
SECURITY_HEADERS = (
    "Content-Security-Policy: default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'\r\n"
    "X-Content-Type-Options: nosniff\r\nReferrer-Policy: no-referrer\r\n"
    "X-Frame-Options: DENY\r\nCache-Control: no-store\r\n")
DENIED = (b"<!doctype html><title>dtfm: log in</title><p>Not logged in. Open the URL that "
          b"<code>coordinator web-url</code> (or <code>coordinator demo</code>) prints: it "
          b"carries the cluster's join token once and sets a session cookie.</p>\n")


class BadRequest(Exception):
    """A request this server will not read any further."""


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]


def response(status: str, content_type: str, body: bytes, extra: str = "") -> bytes:
    head = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n{SECURITY_HEADERS}{extra}Connection: close\r\n\r\n")
    return head.encode("latin-1") + body


def parse_head(head: bytes) -> Request:
    """The request line and headers of one request head (up to and with the blank line)."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest("malformed request line")
    fields = [line for line in lines[1:] if line]
    if len(fields) > MAX_HEADERS:
        raise BadRequest(f"more than {MAX_HEADERS} header lines")
    headers: dict[str, str] = {}
    for line in fields:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest("malformed header line")
        headers[name.lower()] = value.strip()
    if headers.get("content-length", "0") not in ("", "0") or "transfer-encoding" in headers:
        raise BadRequest("this server reads no request body")
    target = urllib.parse.urlsplit(parts[1])
    return Request(parts[0], target.path, urllib.parse.parse_qs(target.query), headers)


def server_ssl_context(security: Security) -> ssl.SSLContext | None:
    """The web view's TLS from the same `--tls-cert`/`--tls-key` as the gRPC port, or None
    without TLS. No client certificate is asked for: a browser logs in with the token."""
    if not security.tls:
        return None
    if not security.tls_cert:
        raise ConfigError("--web with --tls-ca serves TLS: give --tls-cert and --tls-key too")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(security.tls_cert, security.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"--web: cannot load --tls-cert {security.tls_cert} / --tls-key "
                          f"{security.tls_key}: {exc}") from None
    return context


def base_url(listen: str, tls: bool) -> str:
    """scheme://host:port a browser uses for `listen`; a wildcard host becomes this machine's
    name."""
    host, port = split_hostport(listen, "--web")
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.getfqdn()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}"


def _asset(name: str) -> bytes:
    return resources.files("coordinator.web").joinpath("static", name).read_bytes()


class WebServer:
    """One listener serving the page, its JSON and its event stream."""

    def __init__(self, view: View, sessions: Sessions) -> None:
        self.view = view
        self.sessions = sessions
        self.connections = 0
        self.streams = 0
        self._server: asyncio.Server | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._page: tuple[float, bytes] = (0.0, b"")
        self._closing = asyncio.Event()

    async def start(self, listen: str, context: ssl.SSLContext | None) -> int:
        """Listen on `listen` (HOST:PORT; port 0: any free one); returns the port."""
        host, port = split_hostport(listen, "--web")
        if context is None and not is_loopback(host):
            log.warning("the web view listens on %s WITHOUT TLS: its login carries the join "
                        "token in clear; pass --tls-cert/--tls-key, or keep --web on loopback "
                        "and reach it through an SSH tunnel", listen)
        try:
            self._server = await asyncio.start_server(
                self._handle, host, port, limit=HEAD_LIMIT, ssl=context,
                ssl_handshake_timeout=READ_TIMEOUT_S if context else None)
        except OSError as exc:
            raise ConfigError(f"--web {listen}: cannot listen ({exc.strerror}); pick a free "
                              f"port or another address") from None
        bound = self._server.sockets[0].getsockname()[1]
        self._ticker = asyncio.create_task(self._tick())
        log.info("web view on %s/ (open the URL `coordinator web-url --web %s:%d` prints)",
                 base_url(f"{host}:{bound}", context is not None), host, bound)
        return bound

    async def close(self) -> None:
        """Stop listening, end the event streams and let their connections finish."""
        self._closing.set()
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        if self._server is not None:
            self._server.close()
        deadline = time.monotonic() + WRITE_TIMEOUT_S
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def _tick(self) -> None:
        """Keep the timeline's snapshots coming while nobody watches (streams feed it too)."""
        while True:
            await asyncio.sleep(2 * STREAM_EVERY_S)
            if not self.streams:
                try:
                    self.view.status()
                except Exception:
                    log.exception("the web view could not read the status")

    def page_bytes(self) -> bytes:
        """The page's document, built at most once per half stream period for all readers."""
        at, body = self._page
        if time.monotonic() - at >= STREAM_EVERY_S / 2:
            body = json.dumps(self.view.page(), allow_nan=False).encode()
            self._page = (time.monotonic(), body)
        return body

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.connections >= MAX_CONNECTIONS:
            writer.write(response("503 Service Unavailable", "text/plain",
                                  b"too many connections; try again\n"))
            await self._finish(writer)
            return
        self.connections += 1
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            try:
                request = parse_head(head)
            except BadRequest as exc:
                writer.write(response("400 Bad Request", "text/plain", f"{exc}\n".encode()))
            else:
                await self._route(request, writer)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
                ConnectionError, ssl.SSLError):
            pass  # a client that hangs up, stalls or sends junk gets nothing more
        except asyncio.CancelledError:
            return  # the loop is ending (asyncio's connection callback would log a traceback)
        except Exception:  # a bug must not take the coordinator down, nor leak a target
            log.exception("web view: answering a request failed")
            with contextlib.suppress(Exception):
                writer.write(response("500 Internal Server Error", "text/plain",
                                      b"the coordinator could not build this answer; see its "
                                      b"log\n"))
        finally:
            self.connections -= 1
            await self._finish(writer)

    @staticmethod
    async def _finish(writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, TimeoutError, ssl.SSLError):
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
        writer.close()
        with contextlib.suppress(ConnectionError, TimeoutError, ssl.SSLError):
            await asyncio.wait_for(writer.wait_closed(), WRITE_TIMEOUT_S)

    async def _route(self, request: Request, writer: asyncio.StreamWriter) -> None:
        if request.method != "GET":
            writer.write(response("405 Method Not Allowed", "text/plain", b"use GET\n",
                                  "Allow: GET\r\n"))
        elif request.path == "/login":
            await self._login(request, writer)
        elif not self.sessions.valid(request.headers.get("cookie", "")):
            writer.write(response("401 Unauthorized", "text/html; charset=utf-8", DENIED))
        elif request.path in STATIC:
            name, content_type = STATIC[request.path]
            writer.write(response("200 OK", content_type, _asset(name)))
        elif request.path == "/api/status":
            body = json.dumps(self.view.status(), allow_nan=False).encode()
            writer.write(response("200 OK", "application/json", body))
        elif request.path == "/api/view":
            writer.write(response("200 OK", "application/json", self.page_bytes()))
        elif request.path == "/api/events":
            await self._stream(writer)
        else:
            writer.write(response("404 Not Found", "text/plain", b"no such page\n"))

    async def _login(self, request: Request, writer: asyncio.StreamWriter) -> None:
        token = (request.query.get("token") or [""])[0]
        if not self.sessions.token_ok(token):
            log.warning("web view: a login with a wrong token was refused")
            await asyncio.sleep(BAD_LOGIN_DELAY_S)  # guessing costs time
            writer.write(response("401 Unauthorized", "text/html; charset=utf-8", DENIED))
            return
        cookie = self.sessions.open()
        log.info("web view: a browser logged in (%d sessions)", len(self.sessions))
        writer.write(response("303 See Other", "text/plain", b"logged in\n",
                              f"Location: /\r\nSet-Cookie: {cookie}\r\n"))

    async def _stream(self, writer: asyncio.StreamWriter) -> None:
        """Server-sent events: the page's document every `STREAM_EVERY_S`."""
        if self.streams >= MAX_STREAMS:
            writer.write(response("503 Service Unavailable", "text/plain",
                                  b"too many open views; close one or poll /api/view\n",
                                  "Retry-After: 5\r\n"))
            return
        self.streams += 1
        try:
            writer.write(("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                          f"{SECURITY_HEADERS}Connection: close\r\n\r\nretry: 2000\n\n")
                         .encode("latin-1"))
            deadline = time.monotonic() + STREAM_MAX_S
            while time.monotonic() < deadline and not self._closing.is_set():
                writer.write(b"data: " + self.page_bytes() + b"\n\n")
                await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
                with contextlib.suppress(TimeoutError):  # the coordinator stopping ends it
                    await asyncio.wait_for(self._closing.wait(), STREAM_EVERY_S)
        finally:
            self.streams -= 1


async def start_web(listen: str, security: Security, view: View) -> tuple[WebServer, int]:
    """Start the web view on `listen` behind `security`'s join token (and TLS, where it has
    a certificate); returns it and its port."""
    context = server_ssl_context(security)
    server = WebServer(view, Sessions(security.token, secure=context is not None))
    return server, await server.start(listen, context)
