"""A `torch.distributed.Work` the dtfm backend returns: finished by the transport's threads.

`wait(timeout)` behaves as gloo's does for the worker (`agent/worker/errors.wait_all`): it
raises RuntimeError when the operation failed (the message says which peer and why) or when
the timeout passed; a zero timeout means the group's own timeout. A receive staged through a
host buffer (`staging.py`) copies it into place in `finish`, before anyone hears "done".
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import torch
from torch._C._distributed_c10d import Work
from torch.futures import Future


class TransportWork(Work):
    """One send, receive or collective in flight."""

    def __init__(self, default_timeout: timedelta, what: str,
                 tensors: list[torch.Tensor], land: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._done = threading.Event()
        self._lock = threading.Lock()  # finish() against get_future(): no callback is lost
        self._error: BaseException | None = None
        self._timeout = default_timeout
        self._what = what
        self._tensors = tensors  # kept alive until finished: the transport reads or writes them
        self._callbacks: list[Future] = []
        self._land = land  # run once on success, before done: the staged copy into place

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
        if not self._done.wait(limit):
            raise RuntimeError(f"dtfm transport: {self._what} timed out after {limit:.3g} s")
        if self._error is not None:
            raise RuntimeError(f"dtfm transport: {self._what} failed: {self._error}")
        return True

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
