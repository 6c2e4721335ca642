"""Real coordinator and agent processes on loopback for tests, always reaped.

Tests talk to the daemons only through their real interfaces (the CLI and gRPC), so what they
pin is what a person sees. `Daemons.status` asks GetStatus over gRPC from the test's own process
and shapes the answer with the CLI's own `status_to_json`: the same RPC and the same JSON as
`coordinator status --json`, without starting a Python per poll (tests poll every 0.2-0.5 s, and
a CLI per poll took half a core of CI's two away from the daemons under test). The CLI's own
printing keeps its tests (tests/system/test_wire_limits.py, test_cluster.py, test_reach.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from coordinator.commands.status import omitted_agents, status_to_json
from dtfm.procs import terminate_all, wait_for
from dtfm.rpc import CHANNEL_OPTIONS, free_port, listening
from protos.dtfm.v1 import coordinator_pb2, coordinator_pb2_grpc

__all__ = ["Daemons", "free_port", "wait_for"]

TOKEN = "test-token-0123456789"


class Daemons:
    def __init__(self, tmp: Path, token: str = TOKEN) -> None:
        self.tmp = tmp
        self.token = token
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: dict[int, Path] = {}
        self.channels: dict[str, grpc.Channel] = {}

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DTFM_")}
        # one compute thread per worker, as WanCluster and `coordinator demo` give theirs: a
        # test's several agents share this machine's cores, and N workers with a thread per core
        # each oversubscribe them, their OpenMP threads spinning on cores the others need
        env.update({"DTFM_TOKEN": self.token, "PYTHONUNBUFFERED": "1", "DTFM_NUM_THREADS": "1",
                    "OMP_NUM_THREADS": "1"}, **extra)
        return env

    def spawn(self, args: Sequence[str], name: str, env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{name}.log"
        with open(log, "ab") as f:
            proc = subprocess.Popen([sys.executable, "-m", *args], stdout=f,
                                    stderr=subprocess.STDOUT, env=env or self.env(),
                                    start_new_session=True)
        self.procs.append(proc)
        self.logs[proc.pid] = log
        return proc

    def log(self, proc: subprocess.Popen[bytes]) -> str:
        return self.logs[proc.pid].read_text(errors="replace")

    def coordinator(self, *extra: str, port: int | None = None,
                    env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
        address = f"127.0.0.1:{port or free_port()}"
        name = f"coordinator-{len(self.procs)}"
        proc = self.spawn(["coordinator", "start", "--listen", address, "--liveness-timeout",
                           "3", "--heartbeat-interval", "0.5", *extra], name, env)
        wait_for(lambda: listening(address) or proc.poll() is not None, 20,
                 "the coordinator to listen")
        assert proc.poll() is None, self.log(proc)
        return proc, address

    def agent(self, coordinator: str, name: str, *extra: str,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        return self.spawn(["agent", "start", "--coordinator", coordinator, "--state-dir",
                           str(self.tmp / name), "--device", "cpu", *extra], name, env)

    def cli(self, *args: str, env: dict[str, str] | None = None, timeout: float = 60
            ) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                              env=env or self.env(), timeout=timeout)

    def status(self, address: str) -> dict[str, Any]:
        """`coordinator status --coordinator ADDRESS --json`, asked from this process."""
        if address not in self.channels:
            self.channels[address] = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        stub = coordinator_pb2_grpc.CoordinatorStub(self.channels[address])
        try:
            status, call = stub.GetStatus.with_call(
                coordinator_pb2.StatusRequest(), timeout=10.0,
                metadata=(("authorization", f"Bearer {self.token}"),))
        except grpc.RpcError as exc:
            raise AssertionError(f"GetStatus on {address} failed: {exc.code()}: "
                                 f"{exc.details()}") from exc
        return {**status_to_json(status), "agents_omitted": omitted_agents(
            call.trailing_metadata())}

    def agents_in(self, address: str, state: str) -> list[dict[str, Any]]:
        return [a for a in self.status(address)["agents"] if a["state"] == state]

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
        terminate_all(self.procs)
