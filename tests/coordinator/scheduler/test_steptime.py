"""The step-time model replays the runtime's schedule: pinned on cases small enough to work
out by hand, and against the paper's cost model where the two must agree."""

from __future__ import annotations

import time

import numpy as np
import pytest

from coordinator.scheduler import Network, scenarios
from coordinator.scheduler.dpshares import group_shares
from coordinator.scheduler.steptime import (
    StepShape,
    _descend,
    _dp_seconds,
    placed_step_s,
    polish,
    simulate_step,
    step_shape,
)
from dtfm.core.buckets import dp_bucket_count
from dtfm.core.presets import get_preset


def line(n: int, delay_ms: float, gbps: float) -> Network:
    delay = np.full((n, n), delay_ms)
    bw = np.full((n, n), gbps)
    np.fill_diagonal(delay, 0.0)
    return Network(delay, bw)


def test_one_device_is_its_compute() -> None:
    shape = StepShape(micro_batches=4, act_bytes=1e6, grad_bytes=[1e6])
    got = simulate_step(line(1, 0, 1), [[0]], shape, compute_s=[[0.5]])
    assert got.step_s == pytest.approx(2.0) and got.compute_s == pytest.approx(2.0)


def test_two_stages_gpipe_by_hand() -> None:
    # 4 micro-batches of 1 MB over 8 Mbit/s (1 s each) and 50 ms: forwards serialise on the
    # link (4 s + 50 ms), then the gradients do the same back, then stage 1 learns stage 0's
    # gradient norm one delay later.
    net = line(2, 50.0, 0.008)
    shape = StepShape(micro_batches=4, act_bytes=1e6, grad_bytes=[0.0, 0.0])
    got = simulate_step(net, [[0], [1]], shape)
    assert got.pipeline_s == pytest.approx(2 * (4 + 0.05))
    assert got.step_s == pytest.approx(2 * (4 + 0.05) + 0.05)
    assert got.sync_s == pytest.approx(0.05)


def test_compute_overlaps_transfers() -> None:
    # 1 s per transfer, 0.3 s compute per micro-batch: the link, not compute, sets the pace
    net = line(2, 0.0, 0.008)
    shape = StepShape(micro_batches=4, act_bytes=1e6, grad_bytes=[0.0, 0.0])
    busy = simulate_step(net, [[0], [1]], shape, compute_s=[[0.3], [0.3]])
    idle = simulate_step(net, [[0], [1]], shape)
    assert idle.step_s < busy.step_s < idle.step_s + 4 * 0.3


def test_data_parallel_terms_follow_the_workers_two_ways() -> None:
    # three replicas: 0 and 1 10 ms apart, 2 is 100 ms from both; 8 Mbit/s everywhere and
    # 3 MB of gradients, so each shard message (1 MB) takes 1 s on the wire
    delay = np.array([[0, 10, 100], [10, 0, 100], [100, 100, 0]], dtype=float)
    net = Network(delay, np.full((3, 3), 0.008))
    hop_far = 0.1 + 1.0  # the slowest pair's delay + one shard on the wire
    sharded = StepShape(micro_batches=1, act_bytes=0.0, grad_bytes=[3e6])
    got = simulate_step(net, [[0, 1, 2]], sharded)
    # every owner is 100 ms from someone both ways: equal shares. Each link carries its
    # copies (1 s), then the averages (1 s); in 8 buckets each average waits behind the
    # copies still on its link, so only the last bucket's delay shows
    assert dp_bucket_count(3e6) == 8
    assert group_shares(net, [0, 1, 2], 3e6) == pytest.approx([1 / 3] * 3)
    assert got.dp_s == pytest.approx(2 * 1.0 + 0.1)
    # in one bucket (60 kB: 20 ms a shard) nothing overlaps: scatter, then average back
    one = simulate_step(net, [[0, 1, 2]], StepShape(micro_batches=1, act_bytes=0.0,
                                                    grad_bytes=[6e4]))
    assert dp_bucket_count(6e4) == 1
    assert one.dp_s == pytest.approx(2 * (0.1 + 0.02))
    ring = StepShape(micro_batches=1, act_bytes=0.0, grad_bytes=[3e6], dp_mode="allreduce")
    got = simulate_step(net, [[0, 1, 2]], ring)
    assert got.dp_s == pytest.approx(4 * hop_far)  # 2(R-1) steps at the slowest ring link


def test_a_replica_near_everyone_owns_more_and_the_exchange_is_faster() -> None:
    # 0 and 1 are 200 ms apart, 2 is 50 ms from both: with equal shares every shard pays
    # 0 <-> 1's delay twice; the shares give 2 most, and 0 and 1 (whose own shards must
    # cross 200 ms) less, so the group finishes sooner
    delay = np.array([[0, 200, 50], [200, 0, 50], [50, 50, 0]], dtype=float)
    net = Network(delay, np.full((3, 3), 0.008))
    shares = group_shares(net, [0, 1, 2], 3e5)
    assert shares[2] > 1 / 3 > shares[0] == pytest.approx(shares[1])
    assert sum(shares) == pytest.approx(1.0)
    fitted = _dp_seconds(net, [0, 1, 2], 3e5, "sharded")
    equal = _dp_seconds(net, [0, 1, 2], 3e5, "sharded", shares=[1 / 3] * 3)
    assert fitted < 0.9 * equal


def test_shares_are_close_to_the_best_a_search_finds_and_equal_on_equal_links() -> None:
    # every 3-replica group of the 16-agent world: water-filling against the best shares on
    # a 2 % grid of the simplex, replayed by the same exchange model
    net = scenarios.world(per_city=2)
    grid = [(a / 50, b / 50, 1 - (a + b) / 50) for a in range(51) for b in range(51 - a)]
    rng = np.random.default_rng(0)
    for _ in range(6):
        group = rng.choice(16, 3, replace=False).tolist()
        got = _dp_seconds(net, group, 1.6e6, "sharded")
        best = min(_dp_seconds(net, group, 1.6e6, "sharded", shares=f) for f in grid)
        equal = _dp_seconds(net, group, 1.6e6, "sharded", shares=[1 / 3] * 3)
        assert got <= 1.05 * best and got <= equal * (1 + 1e-9)
    assert group_shares(line(4, 30.0, 0.1), [0, 1, 2, 3], 1e6) == pytest.approx([0.25] * 4)


def test_1f1b_waits_on_round_trips_that_gpipe_overlaps() -> None:
    # 1F1B runs a micro-batch's backward before the next forward, so on long links each
    # stage waits a round trip per micro-batch; GPipe keeps every link streaming.
    net = scenarios.world(per_city=1)
    grid = np.arange(8).reshape(4, 2).tolist()
    spec = get_preset("gpt-mini")
    gp = simulate_step(net, grid, step_shape(spec, 4, 2, 16, 4, "gpipe"))
    ofob = simulate_step(net, grid, step_shape(spec, 4, 2, 16, 4, "1f1b"))
    assert 0 < gp.step_s < ofob.step_s


def test_step_shape_counts_the_runtimes_messages() -> None:
    spec = get_preset("gpt-mini")
    shape = step_shape(spec, 3, 2, 16, 4)
    assert shape.act_bytes == 2 * spec.seq_len * spec.d_model * 4  # 16 / 2 / 4 sequences
    assert sum(shape.grad_bytes) == spec.param_count() * 4
    with pytest.raises(ValueError, match="does not split"):
        step_shape(spec, 3, 2, 10, 4)


def test_bad_compute_grid_is_refused() -> None:
    shape = StepShape(micro_batches=1, act_bytes=1.0, grad_bytes=[1.0, 1.0])
    with pytest.raises(ValueError, match="2x1 grid"):
        simulate_step(line(2, 1, 1), [[0], [1]], shape, compute_s=[[1.0, 2.0]])
    with pytest.raises(ValueError, match="2x1 grid"):
        simulate_step(line(2, 1, 1), [[0], [1]], shape, compute_s=[[float("nan")], [1.0]])


def test_polish_never_loses_to_its_starts_and_keeps_a_permutation() -> None:
    net = scenarios.world(per_city=2)
    spec = get_preset("gpt-mini")
    shape = step_shape(spec, 4, 4, 16, 4)
    starts = [np.arange(16).reshape(4, 4).tolist(),
              np.random.default_rng(3).permutation(16).reshape(4, 4).tolist()]
    grid, step = polish(net, starts, shape, seconds=5.0)
    assert sorted(d for row in grid for d in row) == list(range(16))
    assert step == pytest.approx(simulate_step(net, grid, shape).step_s)
    assert step < min(simulate_step(net, g, shape).step_s for g in starts)


def test_polish_kicks_its_best_grid_out_of_a_local_optimum() -> None:
    # a plain swap descent from rank order stops in a local optimum of the world matrix;
    # the kicked restarts find a grid the descent alone does not, and repeatably so.
    # (The stale-restart limit ends it long before the generous deadline.)
    net = scenarios.world(per_city=2)
    shape = step_shape(get_preset("gpt-mini"), 4, 4, 16, 4)
    start = np.arange(16).reshape(4, 4)
    _, descended = _descend(net, start, placed_step_s(net, start, shape), shape, None,
                            time.perf_counter() + 120.0)
    grid, step = polish(net, [start.tolist()], shape, seconds=120.0, seed=0)
    assert step < descended * 0.9
    assert step == pytest.approx(simulate_step(net, grid, shape).step_s)
    assert polish(net, [start.tolist()], shape, seconds=120.0, seed=0) == (grid, step)


def test_polish_counts_compute_and_gives_the_heavier_stage_the_faster_device() -> None:
    # two stages on two devices over identical links: only compute tells the grids apart.
    # Device 0 is twice as slow; stage 1 (with the head) costs three times stage 0.
    compute = np.array([[1.0, 3.0], [0.5, 1.5]])  # [device][stage], one micro-batch
    shape = StepShape(micro_batches=1, act_bytes=1e3, grad_bytes=[0.0, 0.0])
    net = line(2, 1.0, 1.0)
    grid, step = polish(net, [[[1], [0]]], shape, seconds=2.0, compute=compute)
    assert grid == [[0], [1]]
    assert step == pytest.approx(simulate_step(net, grid, shape, [[1.0], [1.5]]).step_s)
    # without compute the two grids are the same step: nothing to swap for
    assert polish(net, [[[1], [0]]], shape, seconds=2.0)[0] == [[1], [0]]
