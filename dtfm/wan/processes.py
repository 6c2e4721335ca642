"""The processes a harness runs inside an emulated WAN's hosts.

Owns starting commands inside a host's network namespace (``ip netns exec``) and ending every
process so started when the WAN closes (SIGTERM, then SIGKILL, and their pipes closed), so a
test that forgets one leaks nothing. Processes started some other way inside the namespaces are
the harness's to find (it kills whatever is left in them, :mod:`dtfm.wan.netns`).
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

from dtfm.procs import terminate_all


class HostProcesses:
    """Commands in the hosts of one WAN. ``namespace`` names host i's namespace (IndexError
    for no such host); ``require_running`` raises unless the WAN is up."""

    def __init__(self, namespace: Callable[[int], str],
                 require_running: Callable[[], None]) -> None:
        self._namespace = namespace
        self._require_running = require_running
        self._procs: list[subprocess.Popen[Any]] = []

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside host ``i``'s namespace."""
        return ["ip", "netns", "exec", self._namespace(i), *argv]

    def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside host ``i``; the process is killed when the emulator closes."""
        self._require_running()
        proc: subprocess.Popen[Any] = subprocess.Popen(self.command(i, argv), **kwargs)
        self._procs.append(proc)
        return proc

    def stop(self) -> None:
        """End every process `popen` started, and close their pipes."""
        terminate_all(self._procs, grace_s=3.0, group=False)
        for proc in self._procs:
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
