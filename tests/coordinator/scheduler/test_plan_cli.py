"""`coordinator plan` run for real as a subprocess: JSON output, table, exit code 2 errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator.scheduler import scenarios
from tests.coordinator.scheduler.reference import grid_cost, random_net

ROOT = Path(__file__).resolve().parents[3]


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coordinator.commands.plan", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )


def write_links(path: Path, delay: object, bw: object, **extra: object) -> str:
    obj = {"delay_ms": delay, "bandwidth_gbps": bw, **extra}
    path.write_text(json.dumps(obj))
    return str(path)


def test_scenario_json_is_the_cost_of_its_grid() -> None:
    p = plan("--scenario", "world", "--budget", "150", "--random", "20", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    for key in ("cost", "dp_cost", "pp_cost", "stages", "replicas", "grid", "seconds"):
        assert key in out
    assert set(out["baselines"]) == {"random", "rank_order"}
    assert out["stages"] == out["replicas"] == 8
    net = scenarios.world()
    ref = grid_cost(net.delay_ms, net.bandwidth_gbps, out["grid"], 0.65, 0.471)
    assert (out["cost"], out["dp_cost"], out["pp_cost"]) == pytest.approx(ref, rel=1e-9)
    assert out["cost"] <= 49.22
    assert out["baselines"]["rank_order"] == pytest.approx(75.26, abs=0.01)


def test_links_file_picks_shape_and_carries_agents(tmp_path: Path) -> None:
    delay, bw = random_net(12, np.random.default_rng(4), symmetric=True)
    agents = [f"agent-{i}" for i in range(12)]
    f = write_links(tmp_path / "l.json", delay.tolist(), bw.tolist(), agents=agents)
    p = plan("--links", f, "--budget", "100", "--random", "10", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert (out["stages"], out["replicas"]) == (4, 3)
    assert "4 stages x 3 replicas" in p.stderr
    assert out["agents"] == agents
    ref = grid_cost(delay, bw, out["grid"], 0.65, 0.471)
    assert out["cost"] == pytest.approx(ref[0], rel=1e-9)
    sized = plan("--links", f, "--stages", "6", "--dp-gb", "0.1", "--pp-gb", "0.05",
                 "--budget", "50", "--random", "5", "--json")
    out = json.loads(sized.stdout)
    assert (out["stages"], out["replicas"]) == (6, 2)
    assert out["cost"] == pytest.approx(grid_cost(delay, bw, out["grid"], 0.1, 0.05)[0])


def test_table_output_and_model_sizes() -> None:
    p = plan("--scenario", "dc-ondemand", "--model", "gpt-1.3b", "--budget", "100",
             "--random", "10")
    assert p.returncode == 0, p.stderr
    assert "allocation" in p.stdout and "rank-order" in p.stdout and "DP-COST" in p.stdout
    assert "gpt-1.3b" in p.stdout


def test_same_seed_same_plan() -> None:
    args = ("--scenario", "regional", "--budget", "120", "--random", "5", "--json", "--seed", "4")
    a, b = json.loads(plan(*args).stdout), json.loads(plan(*args).stdout)
    assert a["grid"] == b["grid"] and a["cost"] == b["cost"]


BAD = [
    ({"delay_ms": [[0, 1, 2], [1, 0, 1]], "bandwidth_gbps": [[0, 1, 1], [1, 0, 1]]}, [],
     "square"),
    ({"delay_ms": [[0, 1], [1, 0]], "bandwidth_gbps": [[0, 1, 1], [1, 0, 1], [1, 1, 0]]}, [],
     "3x3"),
    ({"delay_ms": [[0, 1], [1, 0]], "bandwidth_gbps": [[0, 0], [1, 0]]}, [], "positive"),
    ({"delay_ms": [[0, 1], [1, 0]], "bandwidth_gbps": [[0, -1], [1, 0]]}, [], "positive"),
    ({"delay_ms": [[0, 1], [1, 0]], "bandwidth_gbps": [[0, 1], [1, 0]]},
     ["--stages", "2", "--replicas", "2"], "devices"),
]


@pytest.mark.parametrize(("obj", "extra", "match"), BAD)
def test_bad_links_exit_2(tmp_path: Path, obj: dict, extra: list[str], match: str) -> None:
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(obj))
    p = plan("--links", str(f), "--budget", "10", *extra)
    assert p.returncode == 2
    assert match in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and p.stdout == ""


def test_other_errors_exit_2(tmp_path: Path) -> None:
    cases = [
        (["--scenario", "world", "--stages", "8", "--replicas", "4"], "devices"),
        (["--scenario", "world", "--model", "gpt-tiny", "--stages", "16"], "layers"),
        (["--links", str(tmp_path / "missing.json")], "cannot read"),
        (["--scenario", "world", "--dp-gb", "0.5"], "both"),
        (["--scenario", "world", "--model", "gpt-1.3b", "--batch", "100"], "split evenly"),
        (["--scenario", "world", "--model", "gpt-1.3b", "--micro-batches", "3"], "split evenly"),
        (["--scenario", "world", "--polish"], "--polish needs --model"),
    ]
    for args, match in cases:
        p = plan(*args, "--budget", "10")
        assert p.returncode == 2, args
        assert match in p.stderr and len(p.stderr.strip().splitlines()) == 1
    bad_json = tmp_path / "x.json"
    bad_json.write_text("{nope")
    assert plan("--links", str(bad_json)).returncode == 2


def test_polish_prints_the_grid_coordinator_start_would_run() -> None:
    """`--polish` is the job's `scheduled`: the search, then the step-model descent; its grid
    is a permutation, its cost is that grid's, and the model rates it no slower."""
    args = ["--scenario", "world", "--per-city", "2", "--model", "gpt-mini", "--stages", "4",
            "--replicas", "4", "--batch", "16", "--micro-batches", "4", "--dtype", "fp32",
            "--budget", "300", "--search-seconds", "2", "--random", "5"]
    p = plan(*args, "--polish", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert sorted(d for row in out["grid"] for d in row) == list(range(16))
    assert out["polish"]["polished_step_s"] <= out["polish"]["searched_step_s"]
    net = scenarios.world(per_city=2)
    ref = grid_cost(net.delay_ms, net.bandwidth_gbps, out["grid"], out["dp_gb"], out["pp_gb"])
    assert (out["cost"], out["dp_cost"], out["pp_cost"]) == pytest.approx(ref, rel=1e-9)
    table = plan(*args, "--polish")
    assert "polished against the step model: predicted step" in table.stdout


def test_pick_shape() -> None:
    from dtfm.core.shape import pick_shape

    assert pick_shape(64) == (8, 8)
    assert pick_shape(12) == (4, 3)
    assert pick_shape(32) == (8, 4)
    assert pick_shape(7) == (7, 1)
    assert pick_shape(1) == (1, 1)
    assert pick_shape(64, max_stages=4) == (4, 16)
    assert pick_shape(6, max_stages=2) == (2, 3)
