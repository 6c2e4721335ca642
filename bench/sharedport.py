"""One port per daemon (dtfm/net/front.py) against ports of their own, side by side on loopback.

- gRPC: a unary call's round trip and a server-streamed bulk transfer (1 MiB messages, as
  checkpoint copies stream) to a server on its own TCP port, and to the same server behind
  the front, which splices each connection to it over an abstract Unix socket.
- Data plane: one `Mesh` sends tensors to another that listens on its own port, and to one
  that takes its connections from the agent's handoff (dtfm/net/handoff.py: the front
  passes the accepted socket over, so the bytes never cross the agent).

- The front's splice, gRPC only: on the event loop (dtfm/net/splice.py, since issue 41) and,
  the row "threads", as before it, a thread and a pipe per direction (`ThreadSplice`).

Everything runs in this process (gRPC and its front on uvloop, as in the daemons; the data
plane's front on an event loop thread and the meshes' threads), the same way for every row,
and the rows take turns in each repetition, so a loaded machine weighs on all of them.
Loopback measures the front's own cost, not a WAN. Prints a table (with the process's CPU
seconds per gRPC case) and writes bench/results/sharedport.json; a minute or two.

    .venv/bin/python bench/sharedport.py [--mib 256] [--calls 500]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from agent.daemon.server import data_router  # noqa: E402
from agent.worker.transport import TransportConfig  # noqa: E402
from agent.worker.transport.mesh import Mesh  # noqa: E402
from dtfm import rpc  # noqa: E402
from dtfm.flags import run_async  # noqa: E402
from dtfm.net.front import Front  # noqa: E402
from dtfm.net.handoff import DataHandoff  # noqa: E402
from dtfm.net.splice import Joined  # noqa: E402
from dtfm.rpc import free_port  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "sharedport.json"
SECURITY = rpc.Security(token="bench-sharedport-token-0123")
CHUNK = 1 << 20
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


class ThreadSplice:
    """The splice the front used before issue 41, kept here to compare: a thread and a pipe
    per direction, blocking in splice(2). Two sockets joined both ways until both
    directions end; `close` ends them now."""

    last_active = 0.0  # not tracked: the bench's front never reaches its idle timeout

    def __init__(self, a: socket.socket, b: socket.socket,
                 on_done: Callable[[Joined], None] = lambda s: None) -> None:
        self.a, self.b, self.on_done = a, b, on_done
        self._left = 2
        self._lock = threading.Lock()
        for s in (a, b):
            s.setblocking(True)

    def start(self) -> None:
        for src, dst in ((self.a, self.b), (self.b, self.a)):
            threading.Thread(target=self._pump, args=(src, dst), name="bench-splice",
                             daemon=True).start()

    def close(self) -> None:
        """End both directions (their threads return; the sockets close with the last)."""
        for s in (self.a, self.b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        r, w = os.pipe()
        try:
            with contextlib.suppress(OSError):  # a smaller pipe only means more calls
                fcntl.fcntl(w, F_SETPIPE_SZ, CHUNK)
            while True:
                n = os.splice(src.fileno(), w, CHUNK)
                if n == 0:
                    break
                while n:
                    n -= os.splice(r, dst.fileno(), n)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)  # EOF on to the other end; it may still answer
        except OSError:
            self.close()
        finally:
            os.close(r)
            os.close(w)
            with self._lock:
                self._left -= 1
                last = self._left == 0
            if last:
                self.a.close()
                self.b.close()
                self.on_done(self)


def _register(server: grpc.aio.Server) -> list[str]:
    async def echo(req: bytes, _: Any) -> bytes:
        return req

    async def pull(req: bytes, _: Any) -> AsyncIterator[bytes]:
        chunk = b"\0" * CHUNK
        for _ in range(int(req.decode())):
            yield chunk

    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Bench", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Pull": grpc.unary_stream_rpc_method_handler(pull)})])
    return []


async def _grpc_case(front: Front | None, mib: int, calls: int) -> dict[str, float]:
    server, port, _ = await rpc.start_server("127.0.0.1:0", SECURITY, _register, "bench",
                                             front=front)
    try:
        async with rpc.open_channel(f"127.0.0.1:{port}", SECURITY) as ch:
            echo = ch.unary_unary("/bench.Bench/Echo")
            pull = ch.unary_stream("/bench.Bench/Pull")
            await echo(b"x")
            rtts = []
            for _ in range(calls):
                t0 = time.perf_counter()
                await echo(b"x")
                rtts.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = 0
            async for msg in pull(str(mib).encode()):
                got += len(msg)
            dt = time.perf_counter() - t0
        return {"grpc_unary_rtt_us": statistics.median(rtts) * 1e6,
                "grpc_stream_mib_s": got / dt / (1 << 20)}
    finally:
        if front is not None:
            await front.aclose()
        await server.stop(0)


class _Loop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _data_case(shared: bool, mib: int) -> dict[str, float]:
    loop = _Loop()
    handoff = front = None
    try:
        if shared:
            handoff = DataHandoff()
            handoff.hold("bench", 1)  # as the agent does on its assignment
            front = Front(data_router(handoff, None))
            loop.call(handoff.start())
            port = loop.call(front.start("127.0.0.1", 0, "no-grpc"))
        else:
            port = free_port()
        peers: dict[int, str | None] = {0: f"127.0.0.1:{port}", 1: None}
        t = timedelta(seconds=120)
        m0 = Mesh(TransportConfig("bench", 1, b"bench-secret", peers,
                                  handoff=handoff.name if handoff else None, timeout=t), 0)
        m1 = Mesh(TransportConfig("bench", 1, b"bench-secret", peers, timeout=t), 1)
        try:
            msg = 16  # MiB per message
            src, dst = torch.ones(msg << 18), torch.zeros(msg << 18)
            m1.send(0, 0, 0, src).wait()  # connect
            m0.recv(1, 0, 0, dst).wait()
            n = max(1, mib // msg)
            t0 = time.perf_counter()
            sends = [m1.send(0, 0, i + 1, src) for i in range(n)]
            for i in range(n):
                m0.recv(1, 0, i + 1, dst).wait()
            for w in sends:
                w.wait()
            dt = time.perf_counter() - t0
            return {"data_mib_s": n * msg / dt}
        finally:
            m1.close()
            m0.close()
    finally:
        if front is not None and handoff is not None:
            loop.call(front.aclose())
            loop.call(handoff.aclose())
        loop.stop()


def _thread_front() -> Front:
    return Front(splicer=ThreadSplice)


def _timed_grpc(front: Front | None, mib: int, calls: int) -> dict[str, float]:
    cpu = time.process_time()
    row = run_async(_grpc_case(front, mib, calls))
    return {**row, "grpc_cpu_s": time.process_time() - cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB per bulk transfer")
    ap.add_argument("--calls", type=int, default=500, help="unary calls timed")
    ap.add_argument("--reps", type=int, default=3, help="runs per case (the median is kept)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    cases: list[tuple[str, Callable[[], Front] | None, bool | None]] = [
        ("own ports", None, False), ("one (front)", Front, True),
        ("one, threads", _thread_front, None)]  # (row, front, data plane shared or not run)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in cases}
    for _ in range(args.reps):
        for name, front, shared in cases:
            row = _timed_grpc(front() if front else None, args.mib, args.calls)
            runs[name].append({**row, **(_data_case(shared, args.mib) if shared is not None
                                         else {})})
    rows = [{"ports": name, **{k: statistics.median(r[k] for r in runs[name])
                               for k in runs[name][0]}} for name, _, _ in cases]
    print(f"{'ports':<13} {'gRPC unary RTT us':>18} {'gRPC stream MiB/s':>18} "
          f"{'gRPC CPU s':>11} {'data plane MiB/s':>17}")
    for r in rows:
        print(f"{r['ports']:<13} {r['grpc_unary_rtt_us']:>18.0f} {r['grpc_stream_mib_s']:>18.0f} "
              f"{r['grpc_cpu_s']:>11.2f} {r.get('data_mib_s', float('nan')):>17.0f}")
    ratio = {k: rows[1][k] / rows[0][k] for k in rows[0] if k != "ports"}
    print("one port / own ports: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items()))
    splice = {k: rows[1][k] / rows[2][k] for k in rows[0] if k.startswith("grpc")}
    print("loop splice / threads: " + ", ".join(f"{k} {v:.2f}x" for k, v in splice.items()))
    Path(args.out).write_text(json.dumps({"loopback": True, "mib": args.mib,
                                          "calls": args.calls, "reps": args.reps,
                                          "rows": rows, "ratio": ratio,
                                          "loop_splice_over_threads": splice}, indent=1))


if __name__ == "__main__":
    main()
