"""`--sync-every auto`: the smallest H whose amortised exchange costs at most the overhead of
the step, by the step model on the grid and links; and how `coordinator plan` shows it."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from coordinator.commands.status import status_to_text
from coordinator.daemon.jobstore import JobStore
from coordinator.daemon.registry import Registry
from coordinator.job.machine import Job
from coordinator.links.measure import LinkMeasurer
from coordinator.links.store import LinkStore
from coordinator.scheduler import Network, scenarios, sync_auto
from coordinator.scheduler.compute import Workload, tasklet_seconds
from coordinator.scheduler.steptime import simulate_step
from dtfm.core.presets import get_preset
from dtfm.core.spec import SYNC_AUTO
from protos.dtfm.v1 import common_pb2, coordinator_pb2
from tests.coordinator.test_job import Cluster, config

WORLD = scenarios.world(per_city=2)  # 16 devices in 8 cities: replica groups cross oceans
GRID = np.arange(16).reshape(4, 4).tolist()
FLOPS = [2e11] * 16


def _uniform(n: int, delay_ms: float, gbps: float) -> Network:
    return Network.measured(np.full((n, n), delay_ms), np.full((n, n), gbps))


def _work(replicas: int = 4) -> Workload:
    return Workload(get_preset("gpt-mini"), 4, replicas, 16 * replicas, 4)


def _inner_and_exchange(net: Network, grid: list[list[int]], work: Workload
                        ) -> tuple[float, float]:
    compute = tasklet_seconds(work, grid, FLOPS, None)
    t = simulate_step(net, grid, replace(work, sync_every=2).step_shape(None), compute)
    return t.step_s - t.dp_s, t.dp_exchange_s


@pytest.mark.parametrize("overhead", [0.05, 0.10, 0.30])
def test_auto_takes_the_smallest_power_of_two_within_the_overhead(overhead: float) -> None:
    work = _work()
    choice = sync_auto.choose(WORLD, GRID, work, FLOPS, None, steps=1000, overhead=overhead)
    inner, exchange = _inner_and_exchange(WORLD, GRID, work)
    h = choice.every
    assert h > 1 and h & (h - 1) == 0, choice
    assert exchange / h <= overhead * inner < exchange / (h // 2), (choice, inner, exchange)
    assert choice.inner_s == pytest.approx(inner)
    assert choice.step_s == pytest.approx(inner + exchange / h)
    assert f"within {100 * overhead:g} %" in choice.note


def test_a_larger_overhead_never_takes_a_larger_h() -> None:
    picks = [sync_auto.choose(WORLD, GRID, _work(), FLOPS, None, 1000, overhead=o).every
             for o in (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)]
    assert picks == sorted(picks, reverse=True), picks


def test_fast_links_keep_exact_synchronous_training() -> None:
    lan = _uniform(16, 0.1, 100.0)
    choice = sync_auto.choose(lan, GRID, _work(), FLOPS, None, steps=1000)
    assert choice.every == 1 and "every step (synchronous training's exchange adds" in \
        choice.note


def test_one_replica_or_one_step_syncs_every_step() -> None:
    one = sync_auto.choose(WORLD, np.arange(4).reshape(4, 1).tolist(), _work(1), FLOPS[:4],
                           None, steps=1000)
    assert (one.every, one.note) == (1, "auto: every step (one replica per stage: nothing to "
                                        "sync)")
    assert sync_auto.choose(WORLD, GRID, _work(), FLOPS, None, steps=1).every == 1


def test_h_is_capped_by_the_steps_and_by_max_auto_and_says_so() -> None:
    work = _work()
    assert sync_auto.choose(WORLD, GRID, work, FLOPS, None, steps=3, overhead=0.001).every == 3
    # fast pipelines (GRID's columns), replica groups (its rows) over a 10 kbit/s link
    delay, gbps = np.full((16, 16), 1.0), np.full((16, 16), 10.0)
    for row in GRID:
        delay[np.ix_(row, row)], gbps[np.ix_(row, row)] = 300.0, 1e-5
    slow_dp = Network.measured(delay, gbps)
    capped = sync_auto.choose(slow_dp, GRID, work, FLOPS, None, steps=10**6, overhead=0.01)
    assert capped.every == sync_auto.MAX_AUTO
    assert "over 1 % of the" in capped.note and "64 is the most auto takes" in capped.note


def test_coordinator_plan_shows_the_h_auto_would_choose(
        capsys: pytest.CaptureFixture[str]) -> None:
    from coordinator.commands import plan

    argv = ["--scenario", "world", "--per-city", "2", "--stages", "4", "--replicas", "4",
            "--model", "gpt-mini", "--sync-every", "auto", "--sync-overhead", "0.01"]
    assert plan.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    h = out["sync"]["every"]
    assert h > 1 and out["sync"]["note"].startswith(f"auto: every {h} steps"), out["sync"]
    assert plan.main(argv) == 0
    text = capsys.readouterr().out
    assert f"--sync-every auto: every {h} steps" in text and f"sync every {h} steps" in text


@pytest.mark.parametrize("delay", [0, 1])
def test_a_job_chooses_h_once_sends_it_to_every_worker_and_keeps_it_on_restart(
        tmp_path: Path, delay: int) -> None:
    """The first plan resolves auto; every assignment carries that H (never auto, which a
    worker would read as synchronous), the plan says why, and a restarted coordinator that
    adopts the job keeps the same H (the rounds, and the checkpoints' sync points, stay).
    With `--outer-delay 1` the assignments and the status say the outer step is late."""
    links = tmp_path / "links.json"
    n = 4
    links.write_text(json.dumps({
        "agents": [f"agent-{i}" for i in range(n)],
        "delay_ms": [[0.0 if i == j else 50.0 for j in range(n)] for i in range(n)],
        "bandwidth_gbps": [[None if i == j else 0.01 for j in range(n)] for i in range(n)]}))
    cfg = config(links_file=str(links), search_seconds=0.3, sync_overhead=0.01)
    cfg.train.sync_every, cfg.train.steps, cfg.train.outer_delay = SYNC_AUTO, 400, delay
    cfg.validate()
    store = JobStore(tmp_path / "state")

    async def first() -> tuple[int, str, dict[str, common_pb2.Assignment]]:
        c = Cluster(cfg)
        c.job.store = store
        task = asyncio.get_running_loop().create_task(c.job.run())
        try:
            got = await c.assignments()
        finally:
            task.cancel()
        text = status_to_text(coordinator_pb2.ClusterStatus(job=c.job.status(),
                                                            plan=c.job.plan))
        return c.job.plan.sync_every, c.job.plan.sync_note, got, text

    h, note, got, text = asyncio.run(first())
    assert h > 1 and note.startswith(f"auto: every {h} steps"), note
    assert f"  replicas sync {note}" in text, text
    assert {a.train.sync_every for a in got.values()} == {h}
    assert {a.train.outer_delay for a in got.values()} == {delay}
    late = f"outer step one round late (--outer-delay 1): each sync's exchange overlaps " \
        f"the next {h} steps"
    assert (late in text) == bool(delay), text
    registry, store_links = Registry(liveness_timeout_s=60), LinkStore()
    again = Job(cfg, registry, LinkMeasurer(registry, store_links), store_links, store)
    assert again.planner.sync_every == h and f"every {h} steps" in again.planner.sync_note


def test_the_flag_takes_auto_or_a_count_and_says_so_otherwise(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from coordinator.cli import build_parser as coordinator_parser
    from dtfm import flags
    from dtfm.rpc import ConfigError

    start = coordinator_parser()[1]["start"]
    assert flags.train_config_from_args(start.parse_args(["--sync-every", "auto"])) \
        .sync_every == SYNC_AUTO
    assert flags.train_config_from_args(start.parse_args(["--sync-every", "16"])).sync_every == 16
    for bad in ("0", "-4", "often"):
        with pytest.raises(ConfigError, match="expected an integer from 1 to .* or auto"):
            start.parse_args(["--sync-every", bad])
    toml = tmp_path / "job.toml"
    toml.write_text('sync_every = "auto"\n')
    flags.layered_defaults(start, ["--config", str(toml)])
    assert flags.train_config_from_args(start.parse_args([])).sync_every == SYNC_AUTO
    assert start.parse_args(["--sync-overhead", "0.2"]).sync_overhead == 0.2
    with pytest.raises(ConfigError, match="--sync-overhead"):
        start.parse_args(["--sync-overhead", "0"])


def test_agent_local_refuses_auto_it_has_no_measured_links(tmp_path: Path) -> None:
    from agent.cli import build_parser as agent_parser
    from agent.commands.local import LocalJob

    args = agent_parser()[1]["local"].parse_args(["--sync-every", "auto", "--replicas", "2"])
    with pytest.raises(ValueError, match="--sync-every auto picks H from the links the "
                                         "coordinator measured"):
        LocalJob(args, open(tmp_path / "out", "w"))  # noqa: SIM115


def test_without_measured_links_auto_keeps_synchronous_training_and_says_why() -> None:
    """`--no-measure`: the step model sees made-up equal links, which picked H = 16 before."""
    slow = _uniform(16, 200.0, 0.001)  # the links that would make auto pick a large H
    assert sync_auto.choose(slow, GRID, _work(), FLOPS, None, 1000).every > 1
    got = sync_auto.choose(slow, GRID, _work(), FLOPS, None, 1000, measured=False)
    assert got.every == 1 and "no measured links" in got.note and "--sync-every N" in got.note

    cfg = config(search_seconds=0.3)  # measure_links=False: `coordinator start --no-measure`
    cfg.train.sync_every, cfg.train.steps = SYNC_AUTO, 400
    cfg.validate()

    async def body() -> tuple[int, str, set[int]]:
        c = Cluster(cfg)
        task = asyncio.get_running_loop().create_task(c.job.run())
        try:
            got = await c.assignments()
        finally:
            task.cancel()
        return c.job.plan.sync_every, c.job.plan.sync_note, {
            a.train.sync_every for a in got.values()}

    h, note, sent = asyncio.run(body())
    assert h == 1 and sent == {1}
    assert "no measured links to choose from (--no-measure)" in note, note
