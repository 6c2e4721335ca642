"""`coordinator plan` speaks the job's flags: one `--search-seconds` with `coordinator start`
(plan's old `--seconds` still works), and the job's `--dtype` (fp32 by default, no fp16), so a
plan made with the defaults prices the messages the default job sends. Its default budget
returns promptly on the small clustered instances that once searched for minutes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from agent.cli import build_parser as agent_parser
from coordinator.cli import build_parser as coordinator_parser
from coordinator.scheduler import comm_gb
from dtfm import flags
from dtfm.core.presets import get_preset
from dtfm.core.spec import TRAIN_DTYPES
from dtfm.rpc import ConfigError
from tests.coordinator.scheduler.reference import clustered_net
from tests.coordinator.scheduler.test_plan_cli import plan, write_links


def _subs() -> dict[str, argparse.ArgumentParser]:
    return coordinator_parser()[1]


def _action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


def _definition(a: argparse.Action) -> tuple[object, ...]:
    return (tuple(a.option_strings), a.dest, tuple(a.choices or ()), a.metavar, type(a).__name__,
            getattr(a.type, "__name__", a.type))


def _clustered_links(tmp_path: Path, n: int, sites: int) -> str:
    delay, bw = clustered_net(n, sites, np.random.default_rng(n))
    return write_links(tmp_path / f"links{n}.json", delay.tolist(), bw.tolist())


def test_plan_and_start_share_one_search_seconds_flag() -> None:
    subs = _subs()
    start, plan_parser = subs["start"], subs["plan"]
    for flag in ("--search-seconds", "--seconds"):
        assert _definition(_action(start, flag)) == _definition(_action(plan_parser, flag))
    assert _action(start, "--search-seconds").default == 5.0  # the job's, from JobConfig
    assert _action(plan_parser, "--search-seconds").default is None  # a candidate budget
    for parser, needed in ((start, []), (plan_parser, ["--scenario", "world"])):
        text = parser.format_help()
        assert "--search-seconds SECONDS" in text and "--seconds" not in text  # hidden
        assert parser.parse_args([*needed, "--seconds", "3"]).search_seconds == 3.0  # old name
        assert parser.parse_args([*needed, "--search-seconds", "4"]).search_seconds == 4.0
    with pytest.raises(ConfigError, match="--search-seconds.*> 0 seconds"):
        start.parse_args(["--search-seconds", "0"])


def test_the_environment_reaches_search_seconds_not_the_hidden_old_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    plan_parser = _subs()["plan"]
    monkeypatch.setenv("DTFM_SEARCH_SECONDS", "7")
    flags.layered_defaults(plan_parser, [])
    assert plan_parser.parse_args(["--scenario", "world"]).search_seconds == 7.0


def test_the_old_seconds_spelling_still_runs_a_plan(tmp_path: Path) -> None:
    links = _clustered_links(tmp_path, 8, 2)
    p = plan("--links", links, "--stages", "4", "--seconds", "2", "--random", "5", "--json")
    assert p.returncode == 0, p.stderr
    assert "--seconds is the old name of --search-seconds" in p.stderr
    assert json.loads(p.stdout)["stages"] == 4


def test_one_dtype_flag_for_plan_start_and_agent_local() -> None:
    subs = _subs()
    local = agent_parser()[1]["local"]
    actions = [_action(p, "--dtype") for p in (subs["plan"], subs["start"], local)]
    assert len({(_definition(a), a.default, a.help) for a in actions}) == 1
    assert actions[0].default == "fp32" and actions[0].choices == list(TRAIN_DTYPES)
    with pytest.raises(ConfigError, match="--dtype.*'fp16'"):
        subs["plan"].parse_args(["--scenario", "world", "--dtype", "fp16"])


def test_plan_prices_the_default_job_in_fp32(tmp_path: Path) -> None:
    """The README's form on the issue's instance (9 devices in 3 sites, 3 x 3, no budget
    flag): it returns, having enumerated every placement, and sizes messages in fp32."""
    links = _clustered_links(tmp_path, 9, 3)
    p = plan("--links", links, "--stages", "3", "--replicas", "3", "--model", "gpt-tiny",
             "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["sizes_from"] == "gpt-tiny, batch 192, fp32"
    assert (out["dp_gb"], out["pp_gb"]) == pytest.approx(
        comm_gb(get_preset("gpt-tiny"), 3, 3, 192, "fp32"), rel=1e-12)
    assert out["exhaustive"] and out["evaluated"] == out["candidates"] == 280
    bf16 = json.loads(plan("--links", links, "--stages", "3", "--model", "gpt-tiny",
                           "--dtype", "bf16", "--json").stdout)
    assert bf16["dp_gb"] == pytest.approx(out["dp_gb"] / 2, rel=1e-12)
    refused = plan("--links", links, "--model", "gpt-tiny", "--dtype", "fp16")
    assert refused.returncode == 2 and "--dtype" in refused.stderr
    assert "fp32" in refused.stderr and "bf16" in refused.stderr


def test_the_readme_forms_from_the_issue_return(tmp_path: Path) -> None:
    """`--dp-gb/--pp-gb` on 3 x 3 (enumerated) and `--model gpt-mini --polish` on 4 x 2 of 8
    devices in 4 sites (105 placements): both return without a budget flag."""
    nine = plan("--links", _clustered_links(tmp_path, 9, 3), "--stages", "3", "--replicas",
                "3", "--dp-gb", "0.236", "--pp-gb", "0.2", "--json")
    assert nine.returncode == 0, nine.stderr
    assert json.loads(nine.stdout)["exhaustive"]
    eight = plan("--links", _clustered_links(tmp_path, 8, 4), "--stages", "4", "--replicas",
                 "2", "--model", "gpt-mini", "--polish", "--random", "20", "--json")
    assert eight.returncode == 0, eight.stderr
    out = json.loads(eight.stdout)
    assert out["exhaustive"] and out["candidates"] == 105
    assert out["polish"]["polished_step_s"] <= out["polish"]["searched_step_s"]
    table = plan("--links", _clustered_links(tmp_path, 9, 3), "--stages", "3", "--dp-gb",
                 "0.236", "--pp-gb", "0.2", "--random", "5")
    assert "search: all 280 placements (the exact optimum)" in table.stdout
