"""`--pipeline-delay 1` in the step model: the steps between two flushes replayed as the
worker runs them (`layout.delayed_step_ops`), priced per step."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from coordinator.scheduler import Network, scenarios
from coordinator.scheduler.compute import Workload
from coordinator.scheduler.steptime import FLUSH_FREE_RUN, simulate_step, step_shape
from dtfm.core.presets import get_preset


def _chain(stages: int, delay_ms: float) -> Network:
    delay = np.full((stages, stages), delay_ms)
    return Network.measured(delay, np.full((stages, stages), 1e6))  # bytes take no time


@pytest.mark.parametrize("h", [2, 4, 8])
def test_without_latency_the_bubble_is_paid_once_per_flush(h: int) -> None:
    """Even stages, no delays, no bytes: 1F1B's step is (M + S - 1) micro-batch slots;
    h steps without a flush between them take (h M + S - 1), one bubble for all."""
    s, m, c = 4, 4, 0.01
    net = _chain(s, 0.0)
    grid = [[j] for j in range(s)]
    shape = step_shape(get_preset("gpt-mini"), s, 1, 16, m, "1f1b")
    flushed = simulate_step(net, grid, shape, [[c]] * s)
    delayed = simulate_step(net, grid, replace(shape, flush_every=h), [[c]] * s)
    assert flushed.step_s == pytest.approx((m + s - 1) * c)
    assert delayed.step_s == pytest.approx((h * m + s - 1) * c / h)


def test_on_slow_links_the_delays_are_paid_once_per_flush_too() -> None:
    net = scenarios.world(per_city=1)  # 8 cities: tens of ms between them
    grid = np.arange(8).reshape(4, 2).tolist()
    work = Workload(get_preset("gpt-mini"), 4, 2, 64, 4, "1f1b", sync_every=4)
    compute = [[0.05, 0.05]] * 4
    flushed = simulate_step(net, grid, work.step_shape(None), compute)
    delayed = simulate_step(net, grid, replace(work, pipeline_delay=1).step_shape(None),
                            compute)
    assert replace(work, pipeline_delay=1).step_shape(None).flush_every == 4
    # a flushed step waits for 3 hops forward and 3 back; here that is most of the step
    assert flushed.step_s - flushed.compute_s > 0.2
    assert delayed.step_s < flushed.step_s - 0.1
    assert delayed.step_s >= flushed.compute_s  # the busiest device's compute still counts


def test_the_flush_interval_follows_the_worker() -> None:
    spec = get_preset("gpt-mini")
    assert step_shape(spec, 4, 2, 64, 4, "1f1b", sync_every=4, pipeline_delay=1
                      ).flush_every == 4
    assert step_shape(spec, 4, 1, 64, 4, "1f1b", pipeline_delay=1
                      ).flush_every == FLUSH_FREE_RUN
    assert step_shape(spec, 4, 2, 64, 4, "1f1b", sync_every=4).flush_every == 1
    with pytest.raises(ValueError, match="1f1b"):
        replace(step_shape(spec, 4, 1, 64, 4, "gpipe"), flush_every=4)
