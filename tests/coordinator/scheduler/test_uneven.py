"""Uneven devices: the layer split search, the compute-aware placement and the memory check.

The split search must find the brute-force optimum of the extended cost (the simulated step
with per-device compute, with memory shortfall first) on small instances; devices that are
alike must leave the paper's plan untouched; memory failures must name the device and the
bytes it is short.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator.scheduler import Network, scenarios, search_plan
from coordinator.scheduler.compute import (
    Devices,
    Workload,
    all_splits,
    best_split,
    plan_split,
    score,
    stage_flops,
)
from coordinator.scheduler.memory import (
    DoesNotFit,
    MemoryShape,
    check_fit,
    micro_batches_held,
    stage_bytes,
    stages_bytes,
)
from coordinator.scheduler.steptime import StepShape, simulate_step
from dtfm.core.presets import get_preset
from dtfm.core.spec import ModelSpec

ROOT = Path(__file__).resolve().parents[3]


def _instance(seed: int, memory: bool) -> tuple[Network, list[list[int]], Workload, Devices]:
    rng = np.random.default_rng(seed)
    layers, stages, replicas = int(rng.integers(5, 11)), int(rng.integers(2, 5)), 2
    spec = ModelSpec("t", vocab_size=int(rng.choice([64, 4096])), n_layers=layers,
                     d_model=64, n_heads=4, seq_len=64)
    n, m = stages * replicas, int(rng.integers(1, 6))
    delay, bw = rng.uniform(0, 30, (n, n)), rng.uniform(0.05, 2, (n, n))
    np.fill_diagonal(delay, 0)
    np.fill_diagonal(bw, 1)
    work = Workload(spec, stages, replicas, global_batch=replicas * m * 2, micro_batches=m,
                    schedule=str(rng.choice(["gpipe", "1f1b"])),
                    dtype=str(rng.choice(["fp32", "bf16"])))
    flops = rng.choice([1e9, 2e9, 4e9], n) * rng.uniform(0.9, 1.1, n)
    mem = None
    if memory:
        mem = (rng.uniform(0.6, 1.5, n) * max(stages_bytes(work.memory()))).astype(int)
    grid = rng.permutation(n).reshape(stages, replicas).tolist()
    return Network(delay_ms=delay, bandwidth_gbps=bw), grid, work, Devices.of(flops, mem)


@pytest.mark.parametrize("memory", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_split_search_equals_brute_force(seed: int, memory: bool) -> None:
    net, grid, work, dev = _instance(seed, memory)
    brute = min((score(net, grid, work, dev, s)
                 for s in all_splits(work.spec.n_layers, work.stages)), key=lambda c: c.key)
    found = best_split(net, grid, work, dev, exhaustive=0)  # the heuristic, not enumeration
    assert found.missing_bytes == brute.missing_bytes
    assert found.step.step_s == pytest.approx(brute.step.step_s, rel=1e-12)


def test_all_splits_are_the_compositions() -> None:
    splits = all_splits(5, 3)
    assert len(splits) == 6 and all(sum(s) == 5 and min(s) >= 1 for s in splits)


def _two_speed_job(schedule: str = "gpipe") -> tuple[Network, Workload, Devices]:
    spec = get_preset("gpt-small")  # 8 layers
    net = Network(delay_ms=np.full((4, 4), 1.0), bandwidth_gbps=np.full((4, 4), 10.0))
    work = Workload(spec, 2, 2, global_batch=32, micro_batches=8, schedule=schedule)
    return net, work, Devices.of([2e11, 1e11, 2e11, 1e11])  # compute-bound


def test_faster_devices_share_a_stage_and_get_more_layers() -> None:
    net, work, dev = _two_speed_job()
    mixed = [[0, 1], [2, 3]]  # every stage has a slow device: the paper's grid here
    even = score(net, mixed, work, dev, [4, 4])
    placed = plan_split(net, mixed, work, dev)
    fast_row = next(j for j, row in enumerate(placed.best.grid) if set(row) == {0, 2})
    assert placed.best.splits[fast_row] > placed.best.splits[1 - fast_row]
    assert placed.best.step.step_s < even.step.step_s / 1.3
    kept = plan_split(net, mixed, work, dev, move=False)  # a pinned grid: split only
    assert kept.best.grid == mixed and kept.best.splits == [4, 4]


def test_devices_alike_keep_the_papers_grid_and_the_even_split() -> None:
    net = scenarios.world()
    res = search_plan(net, 8, 8, 0.65, 0.471, seed=0, budget=200)
    work = Workload(get_preset("gpt-1.3b"), 8, 8, 512, 4, dtype="bf16")
    flops = np.random.default_rng(0).uniform(1.0, 1.15, 64) * 1e14  # measurement noise
    placed = plan_split(net, res.grid, work, Devices.of(flops))
    assert placed.best.grid == res.grid and placed.best.splits == [3] * 8


def test_stage_flops_is_six_per_weight_and_token_plus_attention() -> None:
    spec = get_preset("gpt-tiny")
    d, ff, v = spec.d_model, spec.d_ff, spec.vocab_size
    per_layer = 6 * (4 * d * d + 2 * d * ff) + 12 * spec.seq_len * d
    assert stage_flops(spec, 0, 1, 10) == 10 * per_layer  # the embedding lookup is free
    assert stage_flops(spec, 3, 4, 10) == 10 * (per_layer + 6 * d * v)


def test_stage_flops_counts_the_llama_blocks_matrices() -> None:
    """SwiGLU's three MLP matrices and grouped-query attention's narrower k and v."""
    spec = get_preset("llama-1b")
    d, ff, hd = spec.d_model, spec.d_ff, spec.head_size
    weights = 2 * d * 32 * hd + 2 * d * 8 * hd + 3 * d * ff
    per_layer = 6 * weights + 12 * spec.seq_len * 32 * hd
    assert stage_flops(spec, 0, 1, 10) == 10 * per_layer
    assert stage_flops(spec, 15, 16, 10) == 10 * (per_layer + 6 * d * spec.vocab_size)


# --- the benchmark's setting (bench/uneven.py), worked out by hand ---

def _compute_only(n: int) -> Network:
    """Links that cost nothing: only compute and the schedule's order are left."""
    return Network(delay_ms=np.zeros((n, n)), bandwidth_gbps=np.full((n, n), 1e12))


def test_an_uneven_pipeline_is_paced_by_its_slowest_stage_by_hand() -> None:
    # One unit: one layer's forward + backward of a micro-batch on the fast device; 6 layers,
    # 2 stages, 4 micro-batches, GPipe. Even split, slow device on stage 1 (3 and 6 units per
    # micro-batch): stage 1's forwards end at 1 + 2(i+1) -> 9, its backwards 4 each -> 25,
    # stage 0's last backward 2 more: 27. The slow device first gives 27 as well. Split 2:4
    # with the slow device on the 2 (4 units each, 4/3 forward, 8/3 backward): stage 1's
    # forwards end at 4/3 (i+2) -> 20/3, its backwards at 20/3 + 4 x 8/3, stage 0's last
    # backward at 20: 1.35x, not the 1.5x of the slowest stage alone (the fill and drain).
    shape = StepShape(micro_batches=4, act_bytes=0.0, grad_bytes=[0.0, 0.0])
    net = _compute_only(2)
    assert simulate_step(net, [[0], [1]], shape, [[3.0], [6.0]]).step_s == pytest.approx(27)
    assert simulate_step(net, [[0], [1]], shape, [[6.0], [3.0]]).step_s == pytest.approx(27)
    assert simulate_step(net, [[0], [1]], shape, [[4.0], [4.0]]).step_s == pytest.approx(20)


def test_every_replica_waits_for_the_slowest_pipeline_by_hand() -> None:
    # 2 x 2, even split: a slow device in each stage, one per pipeline (the grid of the
    # issue's first run), paces both pipelines at 27 units; both slow devices in one pipeline
    # make that pipeline 30 (stage 1's forwards end at 10, 4 backwards of 4, one more of 4),
    # and the data-parallel sync holds the fast pipeline until then.
    shape = StepShape(micro_batches=4, act_bytes=0.0, grad_bytes=[0.0, 0.0])
    net = _compute_only(4)
    mixed = simulate_step(net, [[0, 1], [2, 3]], shape, [[3.0, 6.0], [6.0, 3.0]])
    apart = simulate_step(net, [[0, 1], [2, 3]], shape, [[6.0, 3.0], [6.0, 3.0]])
    assert mixed.step_s == pytest.approx(27) and apart.step_s == pytest.approx(30)


def test_the_benchmarks_plan_gives_the_slow_device_two_layers_of_six() -> None:
    # gpt-mini, 2 stages x 1 replica, batch 16 in 4 micro-batches, a 2:1 speed mix on the
    # loopback figures a job without measured links uses: 2:4 (or 4:2), whichever stage the
    # slow device holds, and the model expects ~1.3x (27/20 less the head on the fast stage)
    spec = get_preset("gpt-mini")
    delay = np.ones((2, 2))
    np.fill_diagonal(delay, 0.0)
    net = Network(delay_ms=delay, bandwidth_gbps=np.ones((2, 2)))
    work = Workload(spec, 2, 1, global_batch=16, micro_batches=4)
    dev = Devices.of([2.6e10, 1.3e10])
    for grid, want in (([[1], [0]], [2, 4]), ([[0], [1]], [4, 2])):
        found = best_split(net, grid, work, dev)
        even = score(net, grid, work, dev, [3, 3])
        assert found.splits == want
        assert 1.25 < even.step.step_s / found.step.step_s < 27 / 20


# --- memory ---

def test_memory_counts_optimizer_state_buckets_and_held_micro_batches() -> None:
    spec = get_preset("gpt-mini")
    alone = MemoryShape(spec, 2, 1, micro_size=2, micro_batches=4)
    peers = MemoryShape(spec, 2, 2, micro_size=2, micro_batches=4)
    a, b = stage_bytes(alone, 0, 0, 3), stage_bytes(peers, 0, 0, 3)
    assert b - a == 4 * spec.stage_params(0, 3)  # the data-parallel gradient buckets
    assert micro_batches_held("gpipe", 0, 4, 8) == 8
    assert [micro_batches_held("1f1b", j, 4, 8) for j in range(4)] == [4, 3, 2, 1]
    # without flushes: the deeper warm-up's (layout.delayed_warmup), the worker's peak
    # (tests/agent/worker/test_delayed.py)
    assert [micro_batches_held("1f1b", j, 4, 8, 1) for j in range(4)] == [9, 8, 7, 1]
    one_f = MemoryShape(spec, 2, 1, micro_size=2, micro_batches=4, schedule="1f1b")
    assert stage_bytes(one_f, 1, 3, 6) < stage_bytes(alone, 1, 3, 6)


def test_check_fit_passes_or_names_the_device_and_its_shortfall() -> None:
    need = [1000, 3000]
    check_fit([[0, 1], [2, 3]], need, [1000, 1000, 3000, 0])  # 0: unknown, not checked
    with pytest.raises(DoesNotFit) as err:
        check_fit([[0, 1], [2, 3]], need, [1000, 999, 2500, 3000], names=list("abcd"))
    msg = str(err.value)
    assert msg.startswith("c cannot hold stage 1") and "(3000 bytes)" in msg
    assert "(2500 bytes)" in msg and "1 other device(s)" in msg
    assert err.value.worst.missing == 500


def test_the_split_avoids_a_device_too_small_for_the_even_split() -> None:
    net, work, _ = _two_speed_job()
    need = stages_bytes(work.memory())
    small = int(need[0] * 0.8)
    dev = Devices.of([1e12] * 4, [small, 2**40, 2**40, 2**40])
    placed = plan_split(net, [[0, 1], [2, 3]], work, dev, move=False)
    assert placed.best.missing_bytes == 0 and placed.best.splits[0] < 4


# --- coordinator plan ---

def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator.commands.plan", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)


def test_plan_prints_the_split_for_speeds(tmp_path: Path) -> None:
    links = tmp_path / "links.json"
    links.write_text(json.dumps({"delay_ms": np.full((4, 4), 1.0).tolist(),
                                 "bandwidth_gbps": np.full((4, 4), 10.0).tolist()}))
    common = ("--links", str(links), "--model", "gpt-small", "--stages", "2", "--batch", "32",
              "--micro-batches", "8", "--budget", "50", "--random", "5", "--flops", "1e11")
    p = _plan(*common, "--speeds", "2,1,2,1")
    assert p.returncode == 0, p.stderr
    assert "layer split (compute-aware)" in p.stdout and "predicted step" in p.stdout
    out = json.loads(_plan(*common, "--speeds", "2,1,2,1", "--json").stdout)
    fast = next(j for j, row in enumerate(out["grid"]) if set(row) == {0, 2})
    assert out["layer_splits"][fast] > out["layer_splits"][1 - fast]
    bad = _plan(*common, "--memory", "1000000")
    assert bad.returncode == 2 and "cannot hold stage" in bad.stderr and "short" in bad.stderr
    assert _plan("--scenario", "world", "--speeds", "1,2").returncode == 2  # needs --model
