"""`coordinator status --watch --json` kept running inside the coordinator's emulated host, so
that tests and benchmarks polling a `WanCluster` read the real CLI's JSON without starting a
Python per poll.

Why: a poll once a second through `ip netns exec ... coordinator status --json` costs about a
third of a core (interpreter start and imports), on CI's two cores beside the daemons under
test; one watcher answering every poll costs a few milliseconds each. A poll still waits for a
line the watcher printed after the poll began, so no caller reads a status older than its own
call.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

WATCH_EVERY_S = 0.5


class StatusWatch:
    """One `coordinator status --watch` process, started on first use and again whenever it
    has ended (a refused token ends it; a coordinator away only makes it print errors)."""

    def __init__(self, popen: Callable[..., subprocess.Popen[Any]], argv: Sequence[str],
                 env: dict[str, str]) -> None:
        self._popen = popen  # WanEmulator.popen bound to the coordinator's host
        self._argv = [sys.executable, "-m", "coordinator", "status", "--json", "--watch",
                      str(WATCH_EVERY_S), *argv]
        self._env = env
        self._proc: subprocess.Popen[str] | None = None
        self._cond = threading.Condition()
        self._line = ""
        self._seen = 0.0  # when the newest line was read (time.monotonic)

    def status(self, timeout: float) -> dict[str, Any] | None:
        """The coordinator's status as `coordinator status --json` prints it, from a line
        printed after this call began; None while the coordinator does not answer."""
        asked = time.monotonic()
        self._ensure_running()
        deadline = asked + timeout
        with self._cond:
            while self._seen <= asked:
                left = deadline - time.monotonic()
                if left <= 0 or self._proc is None or self._proc.poll() is not None:
                    return None
                self._cond.wait(min(left, 0.5))
            line = self._line
        try:
            data = json.loads(line)
        except ValueError:
            return None
        return None if "error" in data else data

    def _ensure_running(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self.close()
        proc = self._popen(self._argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           env=self._env, text=True)
        self._proc = proc
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True,
                         name="status-watch").start()

    def _read(self, stdout: IO[str]) -> None:
        for line in stdout:
            with self._cond:
                self._line, self._seen = line, time.monotonic()
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
