"""The step model prices the replica checks (`--verify`, issue 43 item 8): off adds nothing;
the default adds, per stage's data-parallel group, the owner's scoring and a tenth of a
weights digest; local steps pay the digest once a round and no scoring."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.scheduler import Network
from coordinator.scheduler.steptime import (
    DIGEST_GBPS,
    SCORE_GBPS,
    simulate_step,
    step_shape,
    verify_seconds,
)
from dtfm.core.presets import get_preset
from dtfm.core.verify import DIGEST_EVERY


def test_the_default_level_costs_its_scoring_and_a_tenth_of_a_digest() -> None:
    spec = get_preset("gpt-mini")
    net = Network(np.full((4, 4), 10.0), np.full((4, 4), 1.0))
    grid = [[0, 1], [2, 3]]
    off = step_shape(spec, 2, 2, 8, 2)
    auto = step_shape(spec, 2, 2, 8, 2, verify="auto")
    assert off.verify_s == () and len(auto.verify_s) == 2
    extra = simulate_step(net, grid, auto).step_s - simulate_step(net, grid, off).step_s
    assert extra == pytest.approx(max(auto.verify_s), rel=1e-6)
    grads, weights = [1e9], [2e9]
    assert verify_seconds("full", "sharded", grads, weights) == pytest.approx(
        (1 / SCORE_GBPS + 2 / DIGEST_GBPS / DIGEST_EVERY,))
    assert verify_seconds("auto", "allreduce", grads, weights) == pytest.approx(
        (2 / DIGEST_GBPS / DIGEST_EVERY,))  # digest only
    assert verify_seconds("auto", "sharded", grads, weights, sync_every=8) == pytest.approx(
        (2 / DIGEST_GBPS / 8,))  # a digest per round, no scoring
    assert verify_seconds("off", "sharded", grads, weights) == ()
