"""Stopping child processes politely, then firmly: the one routine for every launcher.

SIGTERM first so daemons and workers can shut down cleanly (stop workers, say goodbye, flush
checkpoints), SIGKILL for whatever is still alive when the grace period ends. With
`group=True` the signal goes to each child's process group (children started with
`start_new_session=True`), so grandchildren go too. Every terminate-then-kill in the programs
and in `dtfm` goes through here (the worker launcher, the demo, the WAN harness), so the order
of signals, the shared grace period and the reaping are written once.

The other side of SIGTERM, for a command that must clean up when stopped (`sigterm_unwinds`):
the signal raises `Terminated` in the main thread, so the command unwinds through its `finally`
blocks as it does on Ctrl-C (`agent local` stops its workers, `agent prepare` removes its
partial directory) and says so, instead of dying where it stood.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

# the exit status of a command that stopped on SIGTERM (128 + the signal, as a shell reports it)
TERMINATED_STATUS = 128 + signal.SIGTERM


class Terminated(BaseException):
    """SIGTERM arrived inside `sigterm_unwinds`: unwinds like Ctrl-C's KeyboardInterrupt (a
    BaseException, so that no `except Exception` swallows it)."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While the block runs, SIGTERM raises `Terminated`; the previous handler comes back
    after. Python installs handlers only in the main thread, so elsewhere (a test calling a
    command's `run` from a thread) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _send(proc: subprocess.Popen, sig: int, group: bool) -> None:  # type: ignore[type-arg]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)


def terminate_all(procs: Iterable[subprocess.Popen], grace_s: float = 10.0,  # type: ignore[type-arg]
                  group: bool = True) -> list[subprocess.Popen]:  # type: ignore[type-arg]
    """SIGTERM every live process, wait up to `grace_s` in total, SIGKILL the rest.

    Returns the processes that needed SIGKILL, for callers that want to say so. Every process
    is reaped when this returns.
    """
    live = [p for p in procs if p.poll() is None]
    for proc in reversed(live):
        _send(proc, signal.SIGTERM, group)
    deadline = time.monotonic() + grace_s
    killed = []
    for proc in live:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _send(proc, signal.SIGKILL, group)
            proc.wait()
            killed.append(proc)
    return killed


async def terminate_all_async(procs: Iterable[subprocess.Popen], grace_s: float = 10.0,  # type: ignore[type-arg]
                              group: bool = True) -> list[subprocess.Popen]:  # type: ignore[type-arg]
    """`terminate_all` for an event loop: the waiting happens on a worker thread.

    `Popen.wait` in that thread and `Popen.poll` on the loop are safe together (Popen locks
    around waitpid; a poll that finds the lock taken answers "still running").
    """
    return await asyncio.to_thread(terminate_all, list(procs), grace_s, group)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str,
             interval: float = 0.2) -> Any:
    """Poll `predicate` until it returns something true, and return that; after `timeout`
    seconds raise TimeoutError naming `what` and the last value seen (tests and benchmarks
    that drive real daemons wait on them this way)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")
