"""A `torch.distributed.Work` the dtfm backend returns: finished by the transport's threads.

`wait(timeout)` behaves as gloo's does for the worker (`agent/worker/errors.wait_all`): it
raises RuntimeError when the operation failed (the message says which peer and why) or when
the timeout passed; a zero timeout means the group's own timeout. A timeout that passes while
the connection the operation needs is being made again (`stalled`: a resume, or a move to the
relay, each bounded in `resume.py`), or made for the first time while the peer's worker starts
(`peer.Peer.joining`, bounded by the ceiling), waits for that to settle, then gives the
operation its timeout once more: the peer was not slow, its path was being mended or made.
`stalled_s` says how long that took, so a caller's deadline over several works moves by as
much (`errors.wait_all`). A receive staged through a host buffer (`staging.py`) copies it
into place in `finish`, before anyone hears "done".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
from torch._C._distributed_c10d import Work
from torch.futures import Future

STALL_POLL_S = 0.25


class TransportWork(Work):
    """One send, receive or collective in flight."""

    def __init__(self, default_timeout: timedelta, what: str,
                 tensors: list[torch.Tensor], land: Callable[[], None] | None = None,
                 stalled: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self._done = threading.Event()
        self._lock = threading.Lock()  # finish() against get_future(): no callback is lost
        self._error: BaseException | None = None
        self._timeout = default_timeout
        self._what = what
        self._tensors = tensors  # kept alive until finished: the transport reads or writes them
        self._callbacks: list[Future] = []
        self._land = land  # run once on success, before done: the staged copy into place
        self._stalled = stalled  # whether the connection it needs is being made again
        self.stalled_s = 0.0  # how long a wait of it sat out such a reconnection

    def finish(self, error: BaseException | None = None) -> None:
        land, self._land = self._land, None
        if error is None and land is not None and not self._done.is_set():
            try:
                land()
            except Exception as exc:  # noqa: BLE001 - the waiter hears why
                error = RuntimeError(f"the message arrived but copying it into the "
                                     f"receiving tensor failed: {exc}")
        with self._lock:
            if self._done.is_set():
                return
            self._error = error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fut in callbacks:  # outside the lock: a callback may call back into this work
            if error is None:
                fut.set_result(self._tensors)
            else:
                fut.set_exception(error)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        limit = (timeout if timeout.total_seconds() > 0 else self._timeout).total_seconds()
        if not self._done.wait(limit) and not self._sit_out_reconnection(limit):
            mended = (f" (and {self.stalled_s:.3g} s while its connection was being made)"
                      if self.stalled_s else "")
            raise RuntimeError(f"dtfm transport: {self._what} timed out after {limit:.3g} s"
                               f"{mended}")
        if self._error is not None:
            raise RuntimeError(f"dtfm transport: {self._what} failed: {self._error}")
        return True

    def _sit_out_reconnection(self, limit: float) -> bool:
        """After a timeout: whether the work finished once its connection, found being made
        again, settled and `limit` more passed."""
        if self._stalled is None or not self._stalled():
            return False
        t0 = time.monotonic()
        while self._stalled() and not self._done.wait(STALL_POLL_S):
            pass
        self.stalled_s += time.monotonic() - t0
        return self._done.wait(limit)

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def get_future(self) -> Future:
        fut: Future = Future()
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fut)
                return fut
        if self._error is None:
            fut.set_result(self._tensors)
        else:
            fut.set_exception(self._error)
        return fut
