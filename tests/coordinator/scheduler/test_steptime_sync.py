"""Local steps in the step model: the data-parallel exchange, once every H steps, is priced
amortised over the round, so a large H leaves the pipelines to decide the placement."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from coordinator.scheduler import Network, scenarios
from coordinator.scheduler.steptime import StepShape, polish, simulate_step, step_shape
from dtfm.core.presets import get_preset


@pytest.mark.parametrize("h", [2, 4, 16, 64])
def test_the_data_parallel_part_scales_by_one_over_h(h: int) -> None:
    net = scenarios.world(per_city=2)
    grid = np.arange(16).reshape(4, 4).tolist()
    sync = step_shape(get_preset("gpt-mini"), 4, 4, 16, 4)
    every_step = simulate_step(net, grid, sync)
    local = simulate_step(net, grid, replace(sync, sync_every=h))
    assert every_step.dp_s > 0.1  # the world's groups cross oceans: not a rounding error
    assert local.dp_s == pytest.approx(every_step.dp_s / h)
    assert local.dp_exchange_s == pytest.approx(every_step.dp_s)
    assert local.pipeline_s == pytest.approx(every_step.pipeline_s)
    # the round's other steps are the step without the exchange, plus 1/H of it
    no_dp = local.step_s - local.dp_s
    assert no_dp == pytest.approx(local.pipeline_s + local.sync_s)
    assert local.step_s < every_step.step_s


def test_h_one_is_the_synchronous_model_unchanged() -> None:
    net = scenarios.world(per_city=2)
    grid = np.random.default_rng(1).permutation(16).reshape(4, 4).tolist()
    shape = step_shape(get_preset("gpt-mini"), 4, 4, 16, 4)
    assert simulate_step(net, grid, replace(shape, sync_every=1)) == \
        simulate_step(net, grid, shape)


def test_a_large_h_moves_the_slow_links_from_the_pipelines_to_the_groups() -> None:
    # two cities of two devices, 1 Gbit/s inside, 20 Mbit/s and 50 ms between. Synchronous,
    # each step's 20 MB of gradients outweigh 4 MB of activations: every data-parallel group
    # (a row) stays in a city and the pipelines cross. With H = 64 the exchange hardly
    # counts: the pipelines (columns) stay in a city and the groups cross.
    city = np.array([0, 0, 1, 1])
    same = city[:, None] == city[None, :]
    net = Network(np.where(same, 1.0, 50.0) * ~np.eye(4, dtype=bool),
                  np.where(same, 1.0, 0.02))
    shape = StepShape(micro_batches=4, act_bytes=1e6, grad_bytes=[20e6, 20e6])
    start = [[[0, 2], [1, 3]]]
    sync_grid, _ = polish(net, start, shape, seconds=2.0)
    local_grid, _ = polish(net, start, replace(shape, sync_every=64), seconds=2.0)
    assert all(len({city[d] for d in row}) == 1 for row in sync_grid), sync_grid
    assert all(len({city[row[k]] for row in local_grid}) == 1 for k in range(2)), local_grid


def test_sync_every_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="sync_every"):
        replace(step_shape(get_preset("gpt-mini"), 2, 2, 8, 2), sync_every=0)


def test_coordinator_plan_shows_the_amortised_step() -> None:
    from coordinator.commands.plan import main

    args = ["--scenario", "world", "--per-city", "2", "--model", "gpt-mini", "--stages", "4",
            "--replicas", "4", "--batch", "16", "--micro-batches", "4", "--seconds", "1",
            "--random", "5", "--budget", "20", "--sync-every", "8"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main([*args, "--json"]) == 0
    sync = json.loads(buf.getvalue())["sync"]
    got, plain = sync["predicted"], sync["synchronous"]
    assert sync["every"] == 8
    assert got["dp_s"] == pytest.approx(plain["dp_s"] / 8)
    assert got["step_s"] == pytest.approx(got["pipeline_s"] + got["sync_s"] + got["dp_s"])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(args) == 0
    assert "sync every 8 steps: predicted step" in buf.getvalue()
    assert "under the next round" not in buf.getvalue()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):  # the exchange under the next round's 7 steps
        assert main([*args, "--outer-delay", "1", "--json"]) == 0
    late = json.loads(buf.getvalue())["sync"]["predicted"]
    assert late["hidden_s"] == pytest.approx(plain["dp_s"]) and late["dp_s"] == 0
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main([*args, "--outer-delay", "1"]) == 0
    assert "of it under the next round" in buf.getvalue()
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert main(["--scenario", "world", "--sync-every", "8"]) == 2
    assert "--sync-every needs --model" in err.getvalue()


def test_coordinator_plan_prices_the_step_with_the_codecs_it_asks_for(tmp_path: Path) -> None:
    """`--pp-compress`/`--dp-compress` shrink the messages the polish and the predicted step
    replay, as `coordinator start` prices them: they once reached the paper's cost alone, so
    `plan` polished and predicted an int4 job as if it sent fp32 (on the benchmarks' world,
    Mbit/s links, 1.18 s a step against 0.57 s)."""
    from coordinator.commands.plan import main
    from coordinator.scheduler.compression import Compression

    delay, mbps, _ = scenarios.world_links(2, 25.0)  # bench/wan.py's 16-agent world
    net = Network(np.asarray(delay), np.asarray(mbps) / 1000.0)
    links = tmp_path / "links.json"
    links.write_text(json.dumps(net.to_json()))
    args = ["--links", str(links), "--model", "gpt-mini", "--stages", "4", "--replicas", "4",
            "--batch", "16", "--micro-batches", "4", "--random", "5", "--budget", "20",
            "--sync-every", "8", "--codec-device", "cpu", "--json"]
    outs = []
    for codecs in ((), ("--pp-compress", "int4", "--dp-compress", "int3")):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            assert main([*args, *codecs]) == 0
        outs.append(json.loads(buf.getvalue()))
    plain, packed = (out["sync"]["predicted"] for out in outs)
    comp = Compression("int4", "int3", codec_s_per_gb=3.0)
    shape = replace(step_shape(get_preset("gpt-mini"), 4, 4, 16, 4, compression=comp),
                    sync_every=8)
    want = simulate_step(net, outs[1]["grid"], shape)
    assert packed["dp_s"] == pytest.approx(want.dp_s)  # communication only: no compute
    assert packed["dp_s"] < plain["dp_s"] * 0.6  # int3: 9.1x fewer bytes, the same delays
    assert packed["pipeline_s"] < plain["pipeline_s"] * 0.8


@pytest.mark.parametrize("h", [2, 4, 16])
def test_a_delayed_outer_step_waits_only_for_what_outlasts_the_next_round(h: int) -> None:
    """--outer-delay 1: the exchange runs through the next round; the step model charges the
    round what outlasts its H - 1 inner steps, and counts the rest as hidden."""
    net = scenarios.world(per_city=2)
    grid = np.arange(16).reshape(4, 4).tolist()
    shape = replace(step_shape(get_preset("gpt-mini"), 4, 4, 16, 4), sync_every=h)
    waiting = simulate_step(net, grid, shape)
    late = simulate_step(net, grid, replace(shape, outer_delay=1))
    inner = waiting.step_s - waiting.dp_s
    exchange = waiting.dp_exchange_s
    assert late.step_s - late.dp_s == pytest.approx(inner)  # the inner step is unchanged
    assert late.dp_exchange_s == pytest.approx(exchange)  # the same exchange, partly hidden
    assert late.dp_s * h == pytest.approx(max(0.0, exchange - (h - 1) * inner))
    assert late.hidden_s == pytest.approx(exchange - late.dp_s * h)
    assert late.step_s <= waiting.step_s
    # the world's 0.5 s exchange against a 1 s inner step: one step hides all of it
    assert late.hidden_s == pytest.approx(exchange) and late.dp_s == 0


def test_auto_with_a_delayed_outer_step_takes_the_same_h_and_predicts_the_hidden_wait() -> None:
    """A smaller H that the delay makes cheap is not the more exact training (a round late
    loses more at H = 4 than waiting at H = 16): auto keeps the waiting rule's H, and prices
    the step with what the next round does not hide."""
    from coordinator.scheduler import sync_auto
    from coordinator.scheduler.compute import Workload

    net = scenarios.world(per_city=2)
    grid = np.arange(16).reshape(4, 4).tolist()
    work = Workload(get_preset("gpt-mini"), 4, 4, 16, 4)
    flops = [2e11] * 16
    plain = sync_auto.choose(net, grid, work, flops, None, steps=1000, overhead=0.02)
    late = sync_auto.choose(net, grid, replace(work, outer_delay=1), flops, None, steps=1000,
                            overhead=0.02)
    assert plain.every > 2, plain.note  # the budget is tight: waiting needs several steps
    assert late.every == plain.every, (late.note, plain.note)
    assert "one round late, the next round hides all but" in late.note
    assert late.step_s < plain.step_s
