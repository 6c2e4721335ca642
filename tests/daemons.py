"""Real coordinator and agent processes on loopback for tests, always reaped.

Tests talk to the daemons only through their real interfaces (the CLI and gRPC), so what they
pin is what a person sees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dtfm.procs import terminate_all, wait_for
from dtfm.rpc import free_port, listening

__all__ = ["Daemons", "free_port", "wait_for"]

TOKEN = "test-token-0123456789"


class Daemons:
    def __init__(self, tmp: Path, token: str = TOKEN) -> None:
        self.tmp = tmp
        self.token = token
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: dict[int, Path] = {}

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DTFM_")}
        env.update({"DTFM_TOKEN": self.token, "PYTHONUNBUFFERED": "1"}, **extra)
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
        out = self.cli("coordinator", "status", "--coordinator", address, "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def agents_in(self, address: str, state: str) -> list[dict[str, Any]]:
        return [a for a in self.status(address)["agents"] if a["state"] == state]

    def close(self) -> None:
        terminate_all(self.procs)
