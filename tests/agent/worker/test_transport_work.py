"""TransportWork: a future asked for while another thread finishes the work still completes."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

from agent.worker.transport.work import TransportWork


@pytest.mark.timeout(60)
def test_get_future_racing_finish_always_completes() -> None:
    """Each round races get_future() against finish() on another thread: before the lock a
    future added between finish()'s check and its callback loop was never completed."""
    for i in range(2000):
        t0 = torch.zeros(1)
        work = TransportWork(timedelta(seconds=5), "race", [t0])
        go = threading.Barrier(2)
        error = RuntimeError("peer lost") if i % 2 else None

        def finisher(w: TransportWork = work, e: BaseException | None = error,
                     b: threading.Barrier = go) -> None:
            b.wait()
            w.finish(e)

        t = threading.Thread(target=finisher)
        t.start()
        go.wait()
        fut = work.get_future()
        t.join()
        assert fut.done(), f"round {i}: the future was never completed"
        if error is None:
            assert fut.value()[0] is t0
        else:
            with pytest.raises(RuntimeError, match="peer lost"):
                fut.wait()
