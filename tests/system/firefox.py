"""Debian's Firefox (`firefox-esr`) driven over Marionette and WebDriver BiDi, the remote
protocols built into it, for the web view's browser test.

Why not Playwright or geckodriver: Playwright drives only its own patched Firefox build (a
download CI cannot make), and geckodriver is one more binary to fetch. Firefox needs neither:
started with `--marionette` it listens on a TCP port and speaks length-prefixed JSON
(`LEN:[0, id, "Command", {params}]`, answered by `LEN:[1, id, error, result]`), the protocol
geckodriver itself forwards WebDriver to; this is a client for the few commands the test
needs, on a plain socket. The page's errors are the one thing Marionette cannot report, so the
session is opened with `webSocketUrl`, and a minimal WebSocket client (below, no dependency)
subscribes to BiDi's `log.entryAdded` before the first navigation: every uncaught script
error and console.error call of the page, its load included. (Unlike Chromium, Firefox does
not log a failed request as a page error; the Chromium test catches those from the same
server.)

Each `Firefox` is headless, in a fresh profile (`marionette.port` 0 and `--remote-debugging-port
0`: Firefox picks free ports and says which, so no race for one), in a process group of its own
that is SIGKILLed on exit, failure included, so no content process outlives the test. Every
read has a timeout, and no message may be larger than MAX_MESSAGE.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from dtfm.procs import wait_for

# a full-page screenshot of the web view is a few MiB of base64; nothing we ask for is larger
MAX_MESSAGE = 64 << 20


def firefox_binary() -> str:
    """$DTFM_FIREFOX, else Debian's firefox-esr, else a `firefox`; "" when there is none."""
    return (os.environ.get("DTFM_FIREFOX") or shutil.which("firefox-esr")
            or shutil.which("firefox") or "")


class MarionetteError(RuntimeError):
    """Firefox answered a command with an error, or broke its protocol."""


class Stream:
    """Bytes from a socket, each recv bounded by the socket's timeout."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def fill(self) -> None:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise MarionetteError("Firefox closed the connection")
        self.buf += chunk

    def take(self, n: int) -> bytes:
        if n > MAX_MESSAGE:
            raise MarionetteError(f"a {n}-byte message, over the {MAX_MESSAGE} we accept")
        while len(self.buf) < n:
            self.fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def until(self, sep: bytes, limit: int) -> bytes:
        """What comes before `sep` (consumed too), at most `limit` bytes."""
        while (end := self.buf.find(sep)) < 0:
            if len(self.buf) > limit:
                raise MarionetteError(f"no {sep!r} in {bytes(self.buf[:limit])!r}")
            self.fill()
        out = bytes(self.buf[:end])
        del self.buf[:end + len(sep)]
        return out


class BiDi:
    """A WebDriver BiDi session over a minimal WebSocket client (RFC 6455: text frames, masked
    from us, pings answered) that keeps every event it reads in `events`."""

    def __init__(self, url: str, timeout_s: float) -> None:
        parts = urlsplit(url)
        self.stream = Stream(socket.create_connection((parts.hostname, parts.port),
                                                      timeout=timeout_s))
        self.last_id = 0
        self.events: list[dict[str, Any]] = []
        key = base64.b64encode(os.urandom(16)).decode()
        self.stream.sock.sendall(
            f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            f"Sec-WebSocket-Version: 13\r\n\r\n".encode())
        head = self.stream.until(b"\r\n\r\n", 16 << 10)
        if not head.startswith(b"HTTP/1.1 101"):
            raise MarionetteError(f"WebSocket upgrade refused: {head[:200]!r}")

    def _send(self, payload: bytes, opcode: int = 1) -> None:
        size = len(payload)
        head = bytes([0x80 | opcode]) + (
            bytes([0x80 | size]) if size < 126 else
            bytes([0x80 | 126]) + struct.pack("!H", size) if size < 1 << 16 else
            bytes([0x80 | 127]) + struct.pack("!Q", size))
        mask = os.urandom(4)
        self.stream.sock.sendall(head + mask + bytes(b ^ mask[i % 4]
                                                     for i, b in enumerate(payload)))

    def _frame(self) -> tuple[int, bool, bytes]:
        b0, b1 = self.stream.take(2)
        size = b1 & 0x7F
        if size == 126:
            size = struct.unpack("!H", self.stream.take(2))[0]
        elif size == 127:
            size = struct.unpack("!Q", self.stream.take(8))[0]
        mask = self.stream.take(4) if b1 & 0x80 else b""
        data = self.stream.take(size)
        if mask:
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
        return b0 & 0x0F, bool(b0 & 0x80), data

    def _message(self) -> dict[str, Any]:
        parts: list[bytes] = []
        while True:
            opcode, final, data = self._frame()
            if opcode == 9:
                self._send(data, opcode=10)
            elif opcode == 8:
                raise MarionetteError("Firefox closed the BiDi WebSocket")
            elif opcode in (0, 1):
                parts.append(data)
                if sum(map(len, parts)) > MAX_MESSAGE:
                    raise MarionetteError(f"a BiDi message over {MAX_MESSAGE} bytes")
                if final:
                    return dict(json.loads(b"".join(parts)))

    def command(self, method: str, params: dict[str, Any]) -> Any:
        """Send one command and return its result, keeping the events read on the way."""
        self.last_id += 1
        self._send(json.dumps({"id": self.last_id, "method": method, "params": params})
                   .encode())
        while True:
            msg = self._message()
            if msg.get("type") == "event":
                self.events.append(msg)
            elif msg.get("id") == self.last_id:
                if msg.get("type") == "error":
                    raise MarionetteError(f"{method}: {msg.get('error')}: {msg.get('message')}")
                return msg.get("result")


class Firefox:
    """A headless Firefox with a Marionette session and, for its log, a BiDi one; use it as a
    context manager."""

    def __init__(self, executable: str, profile: Path, timeout_s: float = 60.0) -> None:
        self.executable = executable
        self.profile = profile
        self.timeout_s = timeout_s
        self.log = profile.with_name(f"{profile.name}.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.stream: Stream | None = None
        self.bidi: BiDi | None = None
        self.last_id = 0

    def __enter__(self) -> Firefox:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _start(self) -> None:
        self.profile.mkdir(parents=True)
        (self.profile / "user.js").write_text('user_pref("marionette.port", 0);\n')
        env = {**os.environ, "MOZ_CRASHREPORTER_DISABLE": "1"}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [self.executable, "--marionette", "--remote-debugging-port", "0", "--headless",
                 "--no-remote", "--profile", str(self.profile), "about:blank"],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        active = self.profile / "MarionetteActivePort"
        proc = self.proc
        wait_for(lambda: active.exists() or proc.poll() is not None, self.timeout_s,
                 f"Firefox to listen for Marionette (its log: {self.log})")
        if proc.poll() is not None:
            raise RuntimeError(f"Firefox exited with {proc.returncode} before listening for "
                               f"Marionette: {self.log.read_text(errors='replace')[-2000:]}")
        port = int(wait_for(lambda: active.read_text().strip(), 5, "MarionetteActivePort"))
        self.stream = Stream(socket.create_connection(("127.0.0.1", port),
                                                      timeout=self.timeout_s))
        hello = self._read()
        assert hello.get("marionetteProtocol") == 3, f"not Marionette 3: {hello}"
        session = self.command("WebDriver:NewSession", {"webSocketUrl": True})
        self.bidi = BiDi(session["capabilities"]["webSocketUrl"], self.timeout_s)
        self.bidi.command("session.subscribe", {"events": ["log.entryAdded"]})

    def _read(self) -> Any:
        assert self.stream is not None
        return json.loads(self.stream.take(int(self.stream.until(b":", 20))))

    def command(self, name: str, params: dict[str, Any] | None = None) -> Any:
        """Send one Marionette command and return its result; an error raises
        MarionetteError."""
        assert self.stream is not None
        self.last_id += 1
        body = json.dumps([0, self.last_id, name, params or {}]).encode()
        self.stream.sock.sendall(str(len(body)).encode() + b":" + body)
        while True:
            kind, msg_id, error, result = self._read()
            if kind == 1 and msg_id == self.last_id:
                break
        if error:
            raise MarionetteError(f"{name}: {error.get('error')}: {error.get('message')}")
        return result

    def navigate(self, url: str) -> None:
        self.command("WebDriver:Navigate", {"url": url})

    @property
    def url(self) -> str:
        return str(self.command("WebDriver:GetCurrentURL")["value"])

    def execute(self, script: str, *args: Any) -> Any:
        """Run `script` (a function body: `return ...`) in the page."""
        return self.command("WebDriver:ExecuteScript", {"script": script, "args": list(args)}
                            )["value"]

    def wait_until(self, script: str, timeout: float) -> Any:
        """Poll `script` in the page until it returns something true, and return that."""
        return wait_for(lambda: self.execute(script), timeout, script)

    def window(self, width: int, height: int) -> None:
        self.command("WebDriver:SetWindowRect", {"width": width, "height": height})

    def screenshot(self, path: Path) -> None:
        """The whole page, not only the window, as a PNG."""
        shot = self.command("WebDriver:TakeScreenshot", {"full": True})["value"]
        path.write_bytes(base64.b64decode(shot))

    def errors(self) -> list[str]:
        """Every script error and console.error of the pages since the session began, as
        "javascript: message" or "console: message" (with where it came from)."""
        assert self.bidi is not None
        self.bidi.command("session.status", {})  # reads the events sent before its answer
        out = []
        for event in self.bidi.events:
            entry = event["params"]
            if event.get("method") == "log.entryAdded" and entry.get("level") == "error":
                frames = (entry.get("stackTrace") or {}).get("callFrames") or [{}]
                where = f"{frames[0].get('url', '?')}:{frames[0].get('lineNumber', -1) + 1}"
                out.append(f"{entry.get('type')}: {entry.get('text')} ({where})")
        return out

    def close(self) -> None:
        """SIGKILL the whole process group, whatever happened, reap Firefox, and wait (10 s
        at most) until the rest of the group is gone too."""
        for stream in (self.bidi.stream if self.bidi else None, self.stream):
            if stream is not None:
                stream.sock.close()
        self.bidi = self.stream = None
        if self.proc is None:
            return
        group = self.proc.pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
        self.proc.wait(timeout=30)
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: not group_alive(group), 10, "Firefox's processes to go",
                     interval=0.05)


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
