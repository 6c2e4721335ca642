"""The loss falls clearly over 100+ steps on the embedded default corpus (real processes)."""

from __future__ import annotations

import pytest

from tests.agent.worker.testlib import run_local


@pytest.mark.timeout(120)
def test_loss_falls_on_default_corpus() -> None:
    run = run_local(
        "--model", "gpt-tiny", "--stages", "1", "--replicas", "1", "--batch", "8",
        "--steps", "120", "--lr", "3e-3", "--eval-batches", "2",
    )
    assert run.rc == 0, run.stderr
    losses = run.losses
    assert len(losses) == 120
    start = sum(losses[:5]) / 5
    end = sum(losses[-20:]) / 20
    # ln(256) = 5.55 is a uniform guess over bytes; real Python source is far below that.
    assert start > 5.0
    assert end < start - 2.0, (start, end)
    assert run.done is not None and run.done["val_loss"] < start - 2.0
