"""The step model's prediction split as a measured step is (`steptime.step_breakdown`): the
parts add up to the predicted step, and each is the time its cause costs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from coordinator.scheduler import Network, scenarios
from coordinator.scheduler.compression import Compression
from coordinator.scheduler.steptime import simulate_step, step_breakdown, step_shape
from dtfm.core.presets import get_preset


@pytest.mark.parametrize("h", [1, 16])
@pytest.mark.parametrize("codecs", [None, ("int4", "int3")])
def test_the_parts_add_up_to_the_predicted_step(h: int, codecs: tuple[str, str] | None) -> None:
    net = scenarios.world(per_city=1)
    grid = np.arange(8).reshape(4, 2).tolist()
    shape = step_shape(get_preset("gpt-mini"), 4, 2, 64, 4, sync_every=h,
                       compression=Compression(*codecs) if codecs else None)
    compute = np.full((4, 2), 0.05)
    b = step_breakdown(net, grid, shape, compute)
    assert b.step_s == pytest.approx(simulate_step(net, grid, shape, compute).step_s)
    assert b.total() == pytest.approx(b.step_s)
    assert b.compute == pytest.approx(0.2)
    assert b.transfer > 0.0 and b.latency_bubble > 0.0 and b.sync_wait > 0.0
    assert b.other == 0.0
    assert (b.codec > 0.0) == bool(codecs)


def test_without_a_network_only_compute_and_the_bubble_remain() -> None:
    n = 8
    net = Network(np.zeros((n, n)), np.full((n, n), 1e9))
    grid = np.arange(n).reshape(4, 2).tolist()
    shape = step_shape(get_preset("gpt-mini"), 4, 2, 64, 4)
    b = step_breakdown(net, grid, shape, np.full((4, 2), 0.1))
    # GPipe, 4 stages, 4 micro-batches: (4 + 3) micro-batches' compute a step, 4 of them busy
    assert b.step_s == pytest.approx(0.7, rel=1e-6)
    assert b.compute == pytest.approx(0.4)
    assert b.latency_bubble == pytest.approx(0.3, rel=1e-6)
    assert b.transfer == pytest.approx(0.0, abs=1e-6)
    assert b.sync_wait == pytest.approx(0.0, abs=1e-6)


def test_a_slower_pipeline_link_shows_as_transfer() -> None:
    net = scenarios.world(per_city=1)
    grid = np.arange(8).reshape(4, 2).tolist()
    shape = step_shape(get_preset("gpt-mini"), 4, 2, 64, 4)
    slow = Network(net.delay_ms, net.bandwidth_gbps / 4)
    fast_b, slow_b = (step_breakdown(n, grid, replace(shape), np.full((4, 2), 0.05))
                      for n in (net, slow))
    assert slow_b.transfer > 2 * fast_b.transfer
    assert slow_b.compute == fast_b.compute
