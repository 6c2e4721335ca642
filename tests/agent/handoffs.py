"""An agent's front and data-plane hand-off for tests (dtfm/net/handoff.py, dtfm/net/front.py).

`LoopAgent` runs them on an event loop thread in the test's process, as the agent daemon
holds them; `python -m tests.agent.handoffs` runs them in a process of their own under
systemd's default soft limit of 1,024 open files (issue 41), prints `{"port", "handoff"}`
as one JSON line and serves until its stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import resource
import socket
import sys
import threading
import time
from collections.abc import Coroutine
from datetime import timedelta
from typing import Any

from agent.daemon.server import data_router
from agent.worker.transport import TransportConfig
from agent.worker.transport.mesh import Mesh
from dtfm.net import dataplane as dp
from dtfm.net.front import Front
from dtfm.net.frontlimits import FrontLimits
from dtfm.net.handoff import DataHandoff

SECRET = b"join-token-of-the-handoff-test"
JOB = "job-a"
SYSTEMD_NOFILE = 1024  # systemd's default soft limit, as deploy/'s units run the daemons


# bounds the front never reaches in the in-process tests, which count what the hand-off does
# with every connection (the front's own bounds: tests/dtfm/test_front.py)
ROOMY_FRONT = FrontLimits(grpc=4096, grpc_per_source=4096, sniffing=4096,
                          sniffing_per_source=4096, pipes=8)


class LoopAgent:
    """A front and a hand-off on their own loop, holding `JOB`'s `epoch` as its assignment.
    `front_limits` None: the front's bounds from this process's open-file limit, as the
    agent daemon's."""

    def __init__(self, epoch: int = 1, front_limits: FrontLimits | None = ROOMY_FRONT,
                 **handoff: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.handoff = DataHandoff(**{"wait_s": 20.0, "sweep_s": 0.05, **handoff})
        self.loop.call_soon_threadsafe(self.handoff.hold, JOB, epoch)
        self.front = Front(data_router(self.handoff, None), limits=front_limits)
        self.call(self.handoff.start())
        self.port = self.call(self.front.start("127.0.0.1", 0, "no-grpc-here"))

    def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def on_loop(self, fn: Any, *args: Any) -> None:
        """Run `fn(*args)` on the agent's loop (as its session calls the hand-off) and wait."""
        async def run() -> None:
            fn(*args)
        self.call(run())

    def seen(self) -> int:
        """Connections the hand-off has been given: each ends up in exactly one of these."""
        h = self.handoff
        return len(h.parking) + h.handed + h.refused + h.evicted + h.dropped + h.abandoned

    def close(self) -> None:
        self.call(self.front.aclose())
        self.call(self.handoff.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def mesh(rank: int, peers: dict[int, str | None], handoff: str | None, epoch: int = 1) -> Mesh:
    return Mesh(TransportConfig(JOB, epoch, SECRET, peers, handoff=handoff,
                                timeout=timedelta(seconds=20)), rank)


def wait_for(cond: Any, what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def closed(s: socket.socket, timeout_s: float = 10) -> bool:
    """Whether the other end closed `s` within `timeout_s` (an unread hello makes the kernel
    reset instead)."""
    s.settimeout(timeout_s)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def dial_hello(port: int, epoch: int, job: str = JOB, source: str = "127.0.0.1",
               target: int = dp.NO_RANK) -> socket.socket:
    """A connection to `port` from `source` that has sent only a hello for (job, epoch)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    s.sendall(dp.new_hello(dp.ROLE_DIAL, job, epoch, 1, target).pack())
    return s


def main() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(SYSTEMD_NOFILE, hard), hard))
    agent = LoopAgent(epoch=int(sys.argv[1]) if len(sys.argv) > 1 else 1, front_limits=None,
                      wait_s=60.0, sweep_s=1.0)  # the daemon's own
    print(json.dumps({"port": agent.port, "handoff": agent.handoff.name}), flush=True)
    sys.stdin.read()
    agent.close()


if __name__ == "__main__":
    main()
