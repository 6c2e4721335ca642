"""Stopping child processes politely, then firmly: one routine for every launcher.

SIGTERM first so daemons and workers can shut down cleanly (stop workers, say goodbye, flush
checkpoints), SIGKILL for whatever is still alive when the grace period ends. With
`group=True` the signal goes to each child's process group (children started with
`start_new_session=True`), so grandchildren go too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable


def _send(proc: subprocess.Popen, sig: int, group: bool) -> None:  # type: ignore[type-arg]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)


def terminate_all(procs: Iterable[subprocess.Popen], grace_s: float = 10.0,  # type: ignore[type-arg]
                  group: bool = True) -> None:
    """SIGTERM every live process, wait up to `grace_s` in total, SIGKILL the rest."""
    live = [p for p in procs if p.poll() is None]
    for proc in reversed(live):
        _send(proc, signal.SIGTERM, group)
    deadline = time.monotonic() + grace_s
    for proc in live:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _send(proc, signal.SIGKILL, group)
            proc.wait()
