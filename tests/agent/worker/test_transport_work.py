"""TransportWork: a future asked for while another thread finishes the work still completes;
a staged receive lands in its tensor before anyone hears it is done."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

from agent.worker.transport import staging
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


def test_a_staged_receive_lands_before_done_and_a_failed_landing_is_the_error() -> None:
    """The view (what a GPU tensor is to the mesh) is written once the work finishes, before
    wait() returns or a future resolves; a failed receive leaves it untouched; a copy that
    fails becomes the work's error, not a silent success."""
    base = torch.zeros(3, 4)
    view = base.t()
    wire, land = staging.incoming(view)
    assert land is not None and wire.is_contiguous() and wire.device.type == "cpu"
    work = TransportWork(timedelta(seconds=5), "receive from rank 1", [view], land)
    wire.copy_(torch.arange(12.).reshape(4, 3))  # what the reader thread writes
    assert torch.equal(base, torch.zeros(3, 4))  # not landed before finish
    fut = work.get_future()
    work.finish()
    assert work.wait() and torch.equal(view, torch.arange(12.).reshape(4, 3))
    assert fut.value()[0] is view
    contiguous = torch.zeros(5)
    assert staging.incoming(contiguous) == (contiguous, None)
    assert staging.outgoing(contiguous) is contiguous
    snap = staging.outgoing(view)
    view.add_(1)
    assert torch.equal(snap, torch.arange(12.).reshape(4, 3))  # the value when posted

    untouched = torch.zeros(2, 2).t()
    wire2, land2 = staging.incoming(untouched)
    failed = TransportWork(timedelta(seconds=5), "receive from rank 2", [untouched], land2)
    wire2.fill_(7)
    failed.finish(ConnectionError("connection to rank 2 lost"))
    with pytest.raises(RuntimeError, match="rank 2 lost"):
        failed.wait()
    assert torch.equal(untouched, torch.zeros(2, 2))

    def broken() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    bad = TransportWork(timedelta(seconds=5), "receive from rank 3", [view], broken)
    bad.finish()
    with pytest.raises(RuntimeError, match="copying it into the receiving tensor failed"):
        bad.wait()
