"""The emulated slow device is the device the step model assumes.

`bench/uneven.py` makes an agent F times slower with `DTFM_COMPUTE_SLOWDOWN=F` and has it
report FLOP/s / F; the step model (`compute.tasklet_seconds`) then expects F times the compute
of each forward and backward. The worker must idle for exactly that extra time after each
pass, and report as compute the time that really passed, so that the prediction refreshed
with measured compute sees what held the pipeline. Uses torch (the worker's pipeline), like
`test_memory_torch.py`.
"""

from __future__ import annotations

import time

import pytest
import torch

from agent.worker.pipeline import Links, Pipeline, Timings
from agent.worker.stage import Stage
from dtfm.core.presets import get_preset


def _pipeline(slowdown: float) -> Pipeline:
    spec = get_preset("gpt-tiny")
    return Pipeline(Stage(spec, 0, spec.n_layers, seed=0), Links(), stage_index=0, stages=1,
                    micro_size=1, device=torch.device("cpu"), slowdown=slowdown)


def _busy(seconds: float) -> float:
    """Spin for `seconds` (the pass being timed); returns when it started."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass
    return t0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("factor", [1.0, 3.0])
def test_a_slowed_pass_takes_and_reports_factor_times_its_compute(factor: float) -> None:
    pipe, times = _pipeline(factor), Timings()
    t0 = _busy(0.05)
    pipe._computed(times, t0)
    passed = time.perf_counter() - t0
    assert times.compute_s >= factor * 0.05  # it idled (at least) the difference
    assert times.compute_s == pytest.approx(passed, abs=2e-3)  # and counted what passed


@pytest.mark.timeout(120)
def test_a_slowed_step_idles_factor_minus_one_times_each_passs_compute(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a whole single-stage step: forward + backward of 2 micro-batches, as the worker runs it.
    # Compared within the one step (what it asked to idle against what it computed), not
    # against another step's time: on a shared machine two steps' compute differ by 2x.
    spec = get_preset("gpt-tiny")
    x = torch.randint(0, spec.vocab_size, (2, 1, spec.seq_len))
    inputs, targets = list(x), list(x)
    slowed = _pipeline(2.0)
    asked: list[float] = []
    slept: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        asked.append(seconds)
        t0 = time.perf_counter()
        real_sleep(seconds)
        slept.append(time.perf_counter() - t0)

    monkeypatch.setattr("agent.worker.pipeline.time.sleep", sleep)
    t0 = time.perf_counter()
    counted = slowed.train_step("gpipe", inputs, targets)[1].compute_s
    assert counted <= time.perf_counter() - t0
    assert len(asked) == 4  # 2 forwards + 2 backwards, each idled after its own compute
    computed = counted - sum(slept)  # what the passes themselves took
    assert sum(asked) == pytest.approx(computed * (2.0 - 1.0), rel=0.02, abs=1e-3)
    assert counted >= 2.0 * computed  # it reports the idle as compute, oversleep included
