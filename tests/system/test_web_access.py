"""The web view's access, bounds and JSON against a real coordinator process (`--web`).

No session, a made-up cookie or a wrong token: 401 and no data. The join token (through
`coordinator web-url`'s URL) buys an HttpOnly, SameSite=Strict cookie and a redirect to `/`,
and never shows in the coordinator's log, even at debug level. The page's `/api/status` is
`coordinator status --json` key for key. TLS where `--tls-cert` is given.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import ssl
import time
from pathlib import Path
from typing import Any

import pytest

from coordinator.web.server import HEAD_LIMIT, MAX_CONNECTIONS, MAX_HEADERS
from tests.certs import make_ca, make_leaf
from tests.daemons import Daemons, free_port, wait_for

pytestmark = pytest.mark.timeout(120)


def get(port: int, path: str, cookie: str = "", context: ssl.SSLContext | None = None
        ) -> tuple[int, dict[str, str], bytes]:
    conn = (http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
            if context else http.client.HTTPConnection("127.0.0.1", port, timeout=10))
    conn.request("GET", path, headers={"Cookie": cookie} if cookie else {})
    r = conn.getresponse()
    body = r.read()
    conn.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, body


def login(daemons: Daemons, web: str, context: ssl.SSLContext | None = None,
          *extra: str) -> tuple[str, str]:
    """(the URL `coordinator web-url` prints, the session cookie its /login sets)."""
    out = daemons.cli("coordinator", "web-url", "--web", web, *extra)
    assert out.returncode == 0, out.stderr
    url = out.stdout.strip()
    path = url[url.index("/login"):]
    status, headers, _ = get(int(web.rsplit(":", 1)[1]), path, context=context)
    assert status == 303 and headers["location"] == "/", (status, headers)
    return url, headers["set-cookie"].split(";", 1)[0]


def same_keys(a: Any, b: Any, where: str = "$") -> list[str]:
    """Where two JSON documents differ in shape: keys recursively, list items pairwise."""
    if isinstance(a, dict) and isinstance(b, dict):
        diff = [f"{where}: keys {sorted(set(a) ^ set(b))}"] if set(a) != set(b) else []
        return diff + [d for k in set(a) & set(b) for d in same_keys(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=False))
                for d in same_keys(x, y, f"{where}[{i}]")]
    return []


def test_the_token_buys_a_session_and_nothing_else_gets_data(daemons: Daemons) -> None:
    web = f"127.0.0.1:{free_port()}"
    proc, address = daemons.coordinator("--web", web, "--log-level", "debug")
    port = int(web.rsplit(":", 1)[1])
    daemons.agent(address, "a0", "--log-level", "info")
    wait_for(lambda: daemons.agents_in(address, "alive"), 30, "the agent to join")
    agent = daemons.agents_in(address, "alive")[0]["id"]

    for path in ("/", "/api/status", "/api/view", "/api/events", "/app.js"):
        status, _, body = get(port, path)
        assert status == 401 and agent.encode() not in body and b"agents" not in body, path
        status, _, body = get(port, path, cookie="dtfm_session=made-up-by-a-stranger")
        assert status == 401 and agent.encode() not in body, path
    status, headers, _ = get(port, "/login?token=not-the-token-but-long")
    assert status == 401 and "set-cookie" not in headers
    status, _, _ = get(port, f"/elsewhere?token={daemons.token}")
    assert status == 401

    url, cookie = login(daemons, web)
    assert url == f"http://{web}/login?token={daemons.token}"
    status, headers, _ = get(port, url[url.index("/login"):])
    flags = [f.strip() for f in headers["set-cookie"].split(";")]
    assert {"HttpOnly", "SameSite=Strict", "Path=/"} <= set(flags), flags
    assert "referrer-policy" in headers and "content-security-policy" in headers

    status, _, page = get(port, "/", cookie=cookie)
    assert status == 200 and b"/app.js" in page
    status, _, body = get(port, "/api/status", cookie=cookie)
    assert status == 200
    served = json.loads(body)
    printed = daemons.status(address)
    assert [a["id"] for a in served["agents"]] == [agent]
    assert same_keys(served, printed) == [] and same_keys(printed, served) == []
    assert same_keys(served["agents"][0], printed["agents"][0]) == []
    status, _, body = get(port, "/api/view", cookie=cookie)
    view = json.loads(body)
    assert status == 200 and same_keys(view["status"], printed) == []
    assert any(e["kind"] == "join" and e["agent"] == agent for e in view["events"])

    time.sleep(0.5)  # let the log catch up with the last requests
    log = daemons.log(proc)
    assert "logged in" in log and "wrong token" in log
    assert daemons.token not in log, "the join token reached the coordinator's log"


def raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except (ConnectionResetError, TimeoutError):
            pass
        return b"".join(chunks)


def test_what_a_client_can_make_it_hold_is_bounded(daemons: Daemons) -> None:
    web = f"127.0.0.1:{free_port()}"
    daemons.coordinator("--web", web)
    port = int(web.rsplit(":", 1)[1])
    many = b"".join(b"X-%d: y\r\n" % i for i in range(MAX_HEADERS + 1))
    assert raw(port, b"GET / HTTP/1.1\r\n" + many + b"\r\n").startswith(b"HTTP/1.1 400")
    huge = b"GET / HTTP/1.1\r\nX: " + b"y" * HEAD_LIMIT + b"\r\n\r\n"
    assert b"200 OK" not in raw(port, huge)
    assert raw(port, b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello").startswith(
        b"HTTP/1.1 400")  # no bodies at all
    assert raw(port, b"DELETE / HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405")

    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.5)
        assert raw(port, b"GET / HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 503")
    finally:
        for s in idle:
            s.close()
    wait_for(lambda: raw(port, b"GET / HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 401"), 10,
             "the idle connections to be let go")


def test_tls_where_the_coordinator_has_a_certificate(daemons: Daemons, tmp_path: Path) -> None:
    ca, ca_key, ca_cert = make_ca(tmp_path)
    cert, key = make_leaf(tmp_path, "node", ca_key, ca_cert)
    tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
    web = f"127.0.0.1:{free_port()}"
    daemons.coordinator("--web", web, *tls)
    port = int(web.rsplit(":", 1)[1])
    context = ssl.create_default_context(cafile=str(ca))
    url, cookie = login(daemons, web, context, *tls)
    assert url.startswith("https://")
    flags = get(port, url[url.index("/login"):], context=context)[1]["set-cookie"]
    assert "Secure" in flags
    assert get(port, "/api/status", cookie=cookie, context=context)[0] == 200
    assert b"200 OK" not in raw(port, b"GET /api/status HTTP/1.1\r\n\r\n")  # no plaintext


def test_the_coordinator_stops_cleanly_with_a_page_open(daemons: Daemons) -> None:
    web = f"127.0.0.1:{free_port()}"
    proc, _ = daemons.coordinator("--web", web)
    port = int(web.rsplit(":", 1)[1])
    _, cookie = login(daemons, web)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as stream:
        stream.sendall(f"GET /api/events HTTP/1.1\r\nCookie: {cookie}\r\n\r\n".encode())
        first = stream.recv(65536)
        assert first.startswith(b"HTTP/1.1 200") and b"text/event-stream" in first
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0
    log = daemons.log(proc)
    assert "coordinator stopped" in log and "Traceback" not in log, log[-2000:]
