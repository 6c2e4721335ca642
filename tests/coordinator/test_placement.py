"""`--placement`: what each spelling means, and bad input refused with the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.daemon.config import JobConfig
from coordinator.scheduler.placement import Placement, address_key, fixed_grid, random_grid
from dtfm.rpc import ConfigError


def test_spellings() -> None:
    assert Placement.parse("scheduled").label == "scheduled"
    assert Placement.parse("rank-order").label == "rank-order"
    assert Placement.parse("random").label == "random:0"
    assert Placement.parse("random:12").seed == 12
    for bad in ("random:x", "random:-1", ""):
        with pytest.raises(ValueError, match="placement"):
            Placement.parse(bad)


def test_random_is_a_permutation_fixed_by_its_seed() -> None:
    grid = random_grid(4, 2, 5)
    assert sorted(d for row in grid for d in row) == list(range(8))
    assert grid == random_grid(4, 2, 5) and grid != random_grid(4, 2, 6)


def test_rank_order_is_stage_major() -> None:
    assert fixed_grid(Placement("rank-order"), 2, 3, []) == [[0, 1, 2], [3, 4, 5]]
    assert fixed_grid(Placement("scheduled"), 2, 3, []) is None


def test_addresses_sort_numerically_then_names() -> None:
    hosts = ["10.0.0.10", "10.0.0.9", "b.example", "a.example"]
    assert sorted(hosts, key=lambda h: address_key(h, 1)) == [
        "10.0.0.9", "10.0.0.10", "a.example", "b.example"]


def _plan(tmp_path: Path, obj: object) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(obj))
    return str(path)


def test_plan_file_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        Placement.parse(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="not JSON"):
        (tmp_path / "x.json").write_text("{")
        Placement.parse(str(tmp_path / "x.json"))
    with pytest.raises(ValueError, match="grid"):
        Placement.parse(_plan(tmp_path, {"cost": 1}))
    with pytest.raises(ValueError, match="exactly once"):
        Placement.parse(_plan(tmp_path, {"grid": [[0, 0], [1, 2]]}))
    with pytest.raises(ValueError, match="distinct agent ids"):
        Placement.parse(_plan(tmp_path, {"grid": [[0, 1]], "agents": ["a", "a"]}))


def test_a_pinned_plan_sets_the_shape_and_must_match_the_flags(tmp_path: Path) -> None:
    path = _plan(tmp_path, {"grid": [[0, 1], [2, 3], [4, 5]]})
    cfg = JobConfig(model="gpt-tiny", agents=6, placement=path)
    cfg.validate()
    assert (cfg.stages, cfg.replicas) == (3, 2)
    with pytest.raises(ConfigError, match="--agents is 4"):
        JobConfig(model="gpt-tiny", agents=4, placement=path).validate()
    with pytest.raises(ConfigError, match="--stages 2 disagrees"):
        JobConfig(model="gpt-tiny", agents=6, stages=2, placement=path).validate()


def test_plan_json_output_is_a_valid_pinned_plan(tmp_path: Path) -> None:
    from coordinator.cli import build_parser
    from coordinator.commands import plan as plan_cmd

    parser, _ = build_parser()
    args = parser.parse_args(["plan", "--scenario", "world", "--per-city", "1", "--stages", "4",
                              "--replicas", "2", "--budget", "50", "--json"])
    out = plan_cmd.compute(args)
    path = _plan(tmp_path, out)
    pinned = Placement.parse(path).pinned
    assert pinned is not None and pinned.grid == out["grid"]
