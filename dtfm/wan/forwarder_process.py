"""The forwarding process of one emulated WAN, seen from the harness that starts it (the
forwarding itself is `dtfm.wan.emulator.Forwarder`, inside that process).

Owns the process :mod:`dtfm.wan.emulator` runs in and its work directory (the spec it reads,
its log, its control socket, the per-host compute files, the stats it leaves on exit):
starting it and waiting for its ``ready``, asking it something over its control socket,
stopping it, and reading what it left. :class:`dtfm.wan.harness.WanEmulator` owns when; this
module owns how, so the harness's lifecycle reads as a list of steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtfm.procs import terminate_all
from dtfm.wan.topology import Topology

log = logging.getLogger("dtfm.wan.harness")  # its lines read as the harness's, as before

READY_TIMEOUT_S = 20.0
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


class ForwarderProcess:
    """The forwarder of one WAN: started once, stopped once. ``require_running`` raises unless
    the WAN it belongs to is up (it guards what only a running WAN has)."""

    def __init__(self, token: str, log_level: str, require_running: Callable[[], None]) -> None:
        self._token = token
        self._log_level = log_level
        self._require_running = require_running
        self._process: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None
        self._log_path: Path | None = None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def running(self) -> bool:
        """Whether the forwarding process is alive (if it is not, no packet moves)."""
        return self._process is not None and self._process.poll() is None

    @property
    def control_socket(self) -> str:
        """Its control socket (for ``python -m dtfm.wan set --control``)."""
        self._require_running()
        assert self._workdir is not None
        return str(Path(self._workdir.name) / "control.sock")

    @property
    def compute_dir(self) -> Path:
        """Where the per-host compute slowdown files are."""
        self._require_running()
        assert self._workdir is not None
        return Path(self._workdir.name) / "compute"

    def log(self, tail: int = 4000) -> str:
        """The last ``tail`` characters of its log."""
        if self._log_path is None:
            return ""
        try:
            return self._log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send ``message`` over the control socket and return the answer (what the links and
        compute factors are now). RuntimeError if the WAN is down or the process exited."""
        from dtfm.wan.emulator import request

        self._require_running()
        if not self.running:
            raise RuntimeError(f"the WAN emulator has exited: {self.log()}")
        return request(self.control_socket, message)

    def start(self, topology: Topology, queue_ms: float | None) -> None:
        """Write its spec, start it, and wait (up to READY_TIMEOUT_S) for its ``ready``."""
        self._workdir = tempfile.TemporaryDirectory(prefix=f"dtfm-wan-{self._token}-")
        work = Path(self._workdir.name)
        (work / "compute").mkdir()
        spec = {
            "hosts": topology.forwarder_hosts(),
            "delay_ms": topology.delay_ms,
            "bandwidth_mbps": topology.bandwidth_mbps,
            "queue_ms": queue_ms,
            "watch_stdin": True,
            "cleanup_on_orphan": True,
            "stats_path": str(work / "stats.json"),
            "control_socket": str(work / "control.sock"),
            "compute_dir": str(work / "compute"),
        }
        spec_path = work / "spec.json"
        spec_path.write_text(json.dumps(spec))
        self._log_path = work / "emulator.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p
        )
        with open(self._log_path, "wb") as logf:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "dtfm.wan.emulator", "--spec", str(spec_path),
                 "--log-level", self._log_level],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=logf,
                env=env,
                start_new_session=True,  # terminal Ctrl-C goes to us; we stop it in order
            )
        assert self._process.stdout is not None
        out = self._process.stdout
        deadline = time.monotonic() + READY_TIMEOUT_S
        line = b""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([out], [], [], 0.2)
            if ready:
                line = out.readline()
                break
            if self._process.poll() is not None:
                break
        if line.strip() != b"ready":
            raise RuntimeError(
                f"WAN emulator did not start (exit {self._process.poll()}): {self.log()}"
            )

    def stop(self) -> None:
        """End the process (SIGTERM, then SIGKILL) and close its pipes; says if it had exited."""
        emu = self._process
        if emu is None:
            return
        if emu.poll() is not None:
            log.error("the WAN emulator had exited early (%s):\n%s", emu.returncode, self.log())
        elif terminate_all([emu], grace_s=5.0, group=False):
            log.warning("the emulator did not stop on SIGTERM; killed it")
        for stream in (emu.stdin, emu.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

    def finish(self) -> dict[str, float] | None:
        """After `stop`: the counters it left (None if none), and its work directory removed."""
        if self._workdir is None:
            return None
        stats = None
        with contextlib.suppress(OSError, ValueError):
            stats = json.loads((Path(self._workdir.name) / "stats.json").read_text())
        log.debug("emulator log:\n%s", self.log())
        self._workdir.cleanup()
        return stats
