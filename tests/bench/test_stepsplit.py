"""bench/stepsplit.py without the emulator: a job's measured split from its step events, the
step model's network-free split from their compute, the cores bound, and the lost time."""

from __future__ import annotations

import pytest

from bench import stepsplit


def events() -> list[dict[str, object]]:
    """Two steady steps of a 2 x 1 job (step 1, the start-up, is left out)."""
    out: list[dict[str, object]] = []
    for step in (1, 2, 3):
        for stage in (0, 1):
            out.append({"event": "step", "step": step, "stage": stage, "replica": 0,
                        "step_s": 9.0 if step == 1 else 1.0, "compute_s": 0.4,
                        "recv_wait_s": 0.3, "send_wait_s": 0.0, "dp_s": 0.0, "sync_s": 0.1,
                        "codec_s": 0.0, "cpu_s": 0.5})
    return out


def test_the_measured_split_leaves_out_the_first_step_and_adds_up() -> None:
    b = stepsplit.measured_split(events())
    assert (b.step_s, b.compute, b.pipeline_wait, b.norm_wait) == (1.0, 0.4, 0.3, 0.1)
    assert b.other == pytest.approx(0.2)
    assert stepsplit.cores_bound(events(), 2) == pytest.approx(0.5)  # 2 x 0.5 s over 2 cores


def test_the_network_free_prediction_and_the_lost_time() -> None:
    free = stepsplit.free_prediction(events(), "gpt-tiny", 2, 1, 8, 2, 1)
    # GPipe, 2 stages, 2 micro-batches of 0.2 s: 3 slots a step, 2 busy
    assert free.step_s == pytest.approx(0.6, rel=1e-3)
    assert free.compute == pytest.approx(0.4)
    wan = stepsplit.measured_split(events())
    out = stepsplit.report(wan, None, stepsplit.measured_split(events()), free)
    assert out["lost"]["step_s"] == 0.0 and out["ratio"] == 1.0
    assert "lost to the network, measured" in out["table"]
