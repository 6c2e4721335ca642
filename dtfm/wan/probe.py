"""TCP probes that check an emulated WAN delivers what its matrices promise.

Owns a tiny, dependency-free TCP echo / bulk tool that runs inside the emulated hosts
(``python -m dtfm.wan.probe serve|ping|bulk ...``) and the helpers that drive it from outside
(:func:`start_server`, :func:`echo_rtts_ms`, :func:`bulk_mbps`). The tests and the
``python -m dtfm.wan --measure`` command use it; it is a sanity check of the emulator, not the
agents' link measurement (that lives with the agent daemon).

``send`` sends bytes and gets back what the server saw: the sender's address and port as they
arrived (behind a NAT: the NAT's public address and mapped port) and the SHA-256 of the bytes,
so a transfer through a NAT is checked intact.

``bulk`` measures at the receiver, after the first 256 KiB, so that TCP's start-up is not
counted: payload bytes over the time from then to the sender's FIN.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dtfm.wan.harness import WanEmulator

DEFAULT_PORT = 7000
BULK_WARMUP_BYTES = 256 * 1024
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------- inside the hosts


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("peer closed")
        buf += chunk
    return bytes(buf)


def _handle(conn: socket.socket) -> None:
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = _recv_exact(conn, 1)
        if mode == b"E":
            while data := conn.recv(65536):
                conn.sendall(data)
            return
        if mode == b"H":
            peer = conn.getpeername()
            digest, total = hashlib.sha256(), 0
            while data := conn.recv(1 << 20):
                digest.update(data)
                total += len(data)
            conn.sendall(json.dumps({"peer": [peer[0], peer[1]], "bytes": total,
                                     "sha256": digest.hexdigest()}).encode())
            return
        total, at_warm, t_warm = 0, 0, 0.0
        while data := conn.recv(1 << 20):
            total += len(data)
            if not t_warm and total >= BULK_WARMUP_BYTES:
                t_warm, at_warm = time.monotonic(), total
        seconds = time.monotonic() - t_warm if t_warm else 0.0
        conn.sendall(json.dumps({"bytes": total - at_warm, "seconds": seconds}).encode())


def serve(addr: str, port: int) -> None:
    """Echo ("E" first byte) and bulk-sink ("B") server; prints ``listening`` when bound."""
    srv = socket.create_server((addr, port))
    print("listening", flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_handle, args=(conn,), daemon=True).start()


def ping(addr: str, port: int, count: int, size: int = 64) -> list[float]:
    """Round trips (ms) of ``count`` ``size``-byte echoes on one TCP connection (2 warm-ups)."""
    with socket.create_connection((addr, port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(b"E")
        payload = b"x" * size
        rtts = []
        for _ in range(count + 2):
            t0 = time.perf_counter()
            sock.sendall(payload)
            _recv_exact(sock, size)
            rtts.append((time.perf_counter() - t0) * 1e3)
    return rtts[2:]


def bulk(addr: str, port: int, nbytes: int) -> dict[str, float]:
    """Send ``nbytes``; return the receiver's {"bytes", "seconds", "mbps"} after warm-up."""
    with socket.create_connection((addr, port), timeout=60) as sock:
        sock.sendall(b"B")
        block = bytes(1 << 16)
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            sock.sendall(block[:n])
            left -= n
        sock.shutdown(socket.SHUT_WR)
        reply = bytearray()
        while chunk := sock.recv(4096):
            reply += chunk
    out: dict[str, float] = json.loads(reply)
    out["mbps"] = out["bytes"] * 8 / out["seconds"] / 1e6 if out["seconds"] > 0 else 0.0
    return out


def send(addr: str, port: int, nbytes: int, seed: int = 0) -> dict[str, Any]:
    """Send ``nbytes`` of pseudo-random data; return what the server saw ({"peer": [address,
    port], "bytes", "sha256"}) with the sender's own view ("local": [address, port],
    "sent_sha256")."""

    data = random.Random(seed).randbytes(nbytes)
    with socket.create_connection((addr, port), timeout=30) as sock:
        local = sock.getsockname()
        sock.sendall(b"H" + data)
        sock.shutdown(socket.SHUT_WR)
        reply = bytearray()
        while chunk := sock.recv(4096):
            reply += chunk
    out: dict[str, Any] = json.loads(reply)
    out["local"] = [local[0], local[1]]
    out["sent_sha256"] = hashlib.sha256(data).hexdigest()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtfm.wan.probe")
    parser.add_argument("cmd", choices=["serve", "ping", "bulk", "send"])
    parser.add_argument("addr")
    parser.add_argument("port", type=int)
    parser.add_argument("amount", type=int, nargs="?", default=10,
                        help="ping: number of echoes; bulk, send: bytes to send")
    args = parser.parse_args(argv)
    if args.cmd == "serve":
        serve(args.addr, args.port)
    elif args.cmd == "ping":
        print(json.dumps(ping(args.addr, args.port, args.amount)))
    elif args.cmd == "send":
        print(json.dumps(send(args.addr, args.port, args.amount)))
    else:
        print(json.dumps(bulk(args.addr, args.port, args.amount)))
    return 0


# ----------------------------------------------------------------------- from outside


def _argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "dtfm.wan.probe", *args]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p
    )
    return env


def start_server(wan: WanEmulator, host: int, port: int = DEFAULT_PORT) -> subprocess.Popen[str]:
    """Start the probe server in ``host`` (tracked by ``wan``); return once it listens."""
    proc: subprocess.Popen[str] = wan.popen(
        host, _argv("serve", wan.address(host), str(port)),
        stdout=subprocess.PIPE, text=True, env=_env(),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != "listening":
        proc.kill()
        raise RuntimeError(f"probe server in host {host} did not start (exit {proc.wait()})")
    return proc


def _run(wan: WanEmulator, host: int, args: list[str], timeout: float) -> Any:
    out = subprocess.run(
        wan.command(host, _argv(*args)), capture_output=True, text=True,
        timeout=timeout, env=_env(), check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"probe {args[0]} from host {host} failed: {out.stderr.strip()}")
    return json.loads(out.stdout)


def echo_rtts_ms(
    wan: WanEmulator, src: int, dst: int, count: int = 10, port: int = DEFAULT_PORT,
    timeout: float = 60.0,
) -> list[float]:
    """TCP echo round trips (ms) from ``src`` to the probe server in ``dst``."""
    rtts: list[float] = _run(wan, src, ["ping", wan.address(dst), str(port), str(count)],
                             timeout)
    return rtts


def bulk_mbps(
    wan: WanEmulator, src: int, dst: int, nbytes: int, port: int = DEFAULT_PORT,
    timeout: float = 120.0,
) -> float:
    """Goodput (Mbit/s) of sending ``nbytes`` from ``src`` to the probe server in ``dst``."""
    reply = _run(wan, src, ["bulk", wan.address(dst), str(port), str(nbytes)], timeout)
    return float(reply["mbps"])


def send_to(wan: WanEmulator, src: int, dst: int, nbytes: int, port: int = DEFAULT_PORT,
            timeout: float = 60.0) -> dict[str, Any]:
    """Send ``nbytes`` from ``src`` to the probe server in ``dst`` (at ``address(dst)``); what
    the server saw: {"peer": [address, port], "bytes", "sha256"}, plus the sender's own
    "local" [address, port] and "sent_sha256"."""
    reply: dict[str, Any] = _run(wan, src, ["send", wan.address(dst), str(port), str(nbytes)],
                                 timeout)
    return reply


if __name__ == "__main__":
    sys.exit(main())
