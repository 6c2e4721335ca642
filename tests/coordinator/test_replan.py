"""Re-planning a running job: the job with a real registry and fake agents (no grpc, no
workers), its links given by a `--links` file that the test degrades mid-run (the evaluation
reads the file again, as it would re-measure).

Pins that a lasting slowdown on the plan's busiest links makes the job weigh a re-plan, decide
to move, and move at the next checkpoint to a grid that avoids those links, resuming from that
checkpoint; that a steady job and a short blip cause none; that a move that does not pay is
declined with the figures; and how status shows it. The arithmetic helpers are pinned alone.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from coordinator.commands.status import status_to_json, status_to_text
from coordinator.job.weigh import (
    LINK_CHANGE_MS,
    REQUEST_MARGIN_S,
    SWEEP_NOISE_CAP_MS,
    changed_links,
    copy_seconds,
    links_to_probe,
    move_verdict,
    plan_links,
    request_lead,
    settle_remeasured,
)
from coordinator.scheduler import Network
from dtfm.core.workerstate import WorkerState
from protos.dtfm.v1 import common_pb2, coordinator_pb2
from tests.coordinator.test_job import Cluster, _until, config, run

S = coordinator_pb2
FAST = (10.0, 1.0)  # ms, Gbit/s
SLOW = (150.0, 0.0005)


def write_links(path: Path, slow_pairs: set[frozenset[int]], n: int = 4) -> None:
    delay = [[0.0] * n for _ in range(n)]
    bandwidth: list[list[float | None]] = [[None] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i != j:
                d, b = SLOW if frozenset((i, j)) in slow_pairs else FAST
                delay[i][j], bandwidth[i][j] = d, b
    path.write_text(json.dumps({"agents": [f"agent-{i}" for i in range(n)],
                                "delay_ms": delay, "bandwidth_gbps": bandwidth}))


def replan_config(links: Path, tmp_path: Path, **drift: object):  # noqa: ANN201
    cfg = config(links_file=str(links), search_seconds=0.3)
    cfg.train.steps = 400
    cfg.train.checkpoint_every = 10
    cfg.train.checkpoint_dir = str(tmp_path / "ckpt")
    cfg.drift.window = 4
    for k, v in drift.items():
        setattr(cfg.drift, k, v)
    cfg.validate()
    return cfg


def steps(c: Cluster, first: int, last: int, step_s: float, wait_s: float = 0.0) -> None:
    for step in range(first, last + 1):
        for agent in c.ids:
            c.report(agent, worker_state=WorkerState.TRAINING, step=step, step_s=step_s,
                     compute_s=0.2, pp_wait_s=wait_s, dp_s=0.0, loss=3.0)


def pipeline_pairs(got: dict[str, coordinator_pb2.Assignment]) -> set[frozenset[int]]:
    """The agents (by index) each pipeline joins: same replica, neighbouring stages."""
    by_place = {(a.stage, a.replica): int(agent.split("-")[1]) for agent, a in got.items()}
    return {frozenset((by_place[0, r], by_place[1, r])) for r in range(2)}


async def degrade_plan_links(c: Cluster, links: Path, *outcomes: str
                             ) -> tuple[coordinator_pb2.Replan, set[frozenset[int]]]:
    """Settle at 0.5 s/step, degrade both pipelines' links, step at 3 s until the job has
    weighed a re-plan to one of `outcomes`; the record and the degraded pairs."""
    used = pipeline_pairs(await c.assignments())
    steps(c, 1, 9, 0.5)
    write_links(links, used)
    steps(c, 10, 15, 3.0, wait_s=2.8)
    await _until(lambda: bool(c.job.replan.records)
                 and c.job.replan.records[-1].outcome in outcomes)
    return c.job.replan.records[-1], used


def test_a_degraded_plan_link_re_plans_and_moves_at_the_next_checkpoint(tmp_path: Path) -> None:
    links = tmp_path / "links.json"
    write_links(links, set())

    async def body(c: Cluster) -> None:
        rec, used = await degrade_plan_links(c, links, "pending", "declined")
        assert rec.decision == "move", rec.why
        assert {frozenset((int(x.src[-1]), int(x.dst[-1]))) for x in rec.links} == used
        assert rec.predicted_new_s < rec.predicted_stay_s and rec.gain_s > 2 * rec.cost_s > 0
        assert c.job.epoch == 1  # nothing moves before the checkpoint
        # no member reports the checkpoint asked for (its worker heard too late): the move
        # waits for the regular one, which every member passes at step 20
        steps(c, 15, 21, 3.0, wait_s=2.8)
        second = await c.assignments()
        assert c.job.epoch == 2
        assert c.job.plan is not None and c.job.plan.algorithm.startswith("re-planned")
        assert pipeline_pairs(second).isdisjoint(used)  # the new plan avoids the slow links
        assert all(a.train.steps == 400 for a in second.values())
        assert c.job.recoveries.items[-1].planned
        assert c.job.recoveries.items[-1].last_step == 21
        assert c.job.checkpoint_step == 20  # the workers resume from it: no step lost before
        assert rec.outcome == "moved" and rec.grid_after
        steps(c, 21, 27, 0.6)
        await _until(lambda: rec.step_after_s > 0)
        assert rec.step_after_s == pytest.approx(0.6)
        data = status_to_json(coordinator_pb2.ClusterStatus(job=c.job.status()))
        assert data["job"]["replans"][0]["outcome"] == "moved"
        assert data["job"]["replans"][0]["at_step"] == rec.at_step
        text = status_to_text(coordinator_pb2.ClusterStatus(job=c.job.status()))
        assert "1 re-plan(s) weighed" in text and "moved" in text, text
    run(body, replan_config(links, tmp_path))


def test_a_move_asks_for_a_checkpoint_ahead_and_moves_there_once_every_member_wrote_it(
        tmp_path: Path) -> None:
    """The decision comes at step 15 of 3 s steps: rather than train at the degraded speed to
    the checkpoint of step 20, every member is asked for one after step 17 (two steps ahead:
    the ask must reach each worker before it ends that step), and the job moves once every
    member reports it written; one member that had not is waited for."""
    links = tmp_path / "links.json"
    write_links(links, set())

    async def body(c: Cluster) -> None:
        rec, _ = await degrade_plan_links(c, links, "pending", "declined")
        assert rec.decision == "move", rec.why
        assert "asked the members for a checkpoint after step 17" in rec.why
        await _until(lambda: all(not c.registry.get(a).commands.empty() for a in c.ids))
        for a in c.ids:
            cmd = c.registry.get(a).commands.get_nowait()
            assert cmd.WhichOneof("kind") == "checkpoint", cmd
            assert (cmd.checkpoint.job_id, cmd.checkpoint.epoch, cmd.checkpoint.step) == \
                (c.job.job_id, 1, 17)
        for step in (16, 17, 18):
            for i, agent in enumerate(c.ids):
                c.report(agent, worker_state=WorkerState.TRAINING, step=step, step_s=3.0,
                         compute_s=0.2, pp_wait_s=2.8, loss=3.0,
                         checkpoint_step=17 if step == 18 and i else 0)
        await asyncio.sleep(0.2)
        assert c.job.epoch == 1 and c.job.checkpoint_step == 10  # one member has not written
        c.report(c.ids[0], worker_state=WorkerState.TRAINING, step=18, step_s=3.0,
                 compute_s=0.2, pp_wait_s=2.8, loss=3.0, checkpoint_step=17)
        await c.assignments()
        assert c.job.epoch == 2 and c.job.checkpoint_step == 17
        assert c.job.recoveries.items[-1].planned
        assert "at the checkpoint of step 17" in c.job.recoveries.items[-1].reason
    run(body, replan_config(links, tmp_path))


def test_a_steady_job_and_a_short_blip_never_re_plan(tmp_path: Path) -> None:
    links = tmp_path / "links.json"
    write_links(links, set())

    async def body(c: Cluster) -> None:
        await c.assignments()
        steps(c, 1, 30, 0.5)
        steps(c, 31, 33, 4.0, wait_s=3.8)  # a blip three steps long: under the window
        steps(c, 34, 80, 0.5)
        await asyncio.sleep(0.3)
        assert c.job.replan.records == [] and c.job.epoch == 1
    run(body, replan_config(links, tmp_path))


def test_a_move_that_does_not_pay_is_declined_and_said_why(tmp_path: Path) -> None:
    links = tmp_path / "links.json"
    write_links(links, set())

    async def body(c: Cluster) -> None:
        rec, _ = await degrade_plan_links(c, links, "declined")
        assert rec.decision == "stay" and "costs" in rec.why and rec.gain_s > 0
        steps(c, 16, 40, 3.0, wait_s=2.8)  # the new normal: no second verdict
        await asyncio.sleep(0.3)
        assert len(c.job.replan.records) == 1 and c.job.epoch == 1
    run(body, replan_config(links, tmp_path, margin=1e6))


def test_plan_links_are_pipeline_neighbours_and_replica_groups() -> None:
    assert plan_links([[0, 1], [2, 3]]) == {(0, 2), (2, 0), (1, 3), (3, 1), (0, 1), (1, 0),
                                            (2, 3), (3, 2)}


def test_changed_links_ignore_noise_and_report_both_figures() -> None:
    old = Network(delay_ms=np.array([[0, 10], [10, 0]], float),
                  bandwidth_gbps=np.array([[1, 1], [1, 1]], float))
    new = Network(delay_ms=np.array([[0, 12], [110, 0]], float),
                  bandwidth_gbps=np.array([[1, 1.1], [0.1, 1]], float))
    got = changed_links(old, new, ["a", "b"], 0.3)
    assert [(c.src, c.dst) for c in got] == [("b", "a")]
    assert got[0].delay_ms_before == 10 and got[0].gbps_after == pytest.approx(0.1)


def test_a_re_measurement_under_training_traffic_keeps_what_only_noise_moved() -> None:
    nan = float("nan")
    old = Network(delay_ms=np.array([[0, 10, 50], [10, 0, 40], [50, 40, 0]], float),
                  bandwidth_gbps=np.full((3, 3), 1.0))
    # a -> b read one-sidedly high (a busy core), a <-> c really 100 ms slower both ways,
    # b -> c failed to measure; bandwidths: noise on a -> b, a real drop on c -> a
    delay = np.array([[0, 300, 151], [11, 0, nan], [149, 43, 0]], float)
    rate = np.array([[1, 0.8, 1], [1, 1, nan], [0.1, 1, 1]], float)
    settled = settle_remeasured(old, delay, rate, threshold=0.3)
    got = settled.net
    # the lesser of the two ends' readings, then within noise: the plan's figure
    assert got.delay_ms[0, 1] == got.delay_ms[1, 0] == 10.0
    assert got.delay_ms[0, 2] == got.delay_ms[2, 0] == 149.0  # a real change goes through
    assert got.delay_ms[1, 2] == 40.0 and got.delay_ms[2, 1] == 40.0  # failed: the lesser/old
    assert got.bandwidth_gbps[0, 1] == 1.0 and got.bandwidth_gbps[1, 2] == 1.0
    assert got.bandwidth_gbps[2, 0] == pytest.approx(0.1)
    assert np.all(np.diag(got.delay_ms) == 0)
    # what moved is what changed: a <-> c's delay, c -> a's rate, nothing that noise moved
    assert {tuple(p) for p in np.argwhere(settled.delay_moved)} == {(0, 2), (2, 0)}
    assert {tuple(p) for p in np.argwhere(settled.rate_moved)} == {(2, 0)}


def test_a_sweep_under_load_counts_as_moved_only_what_moved_past_its_own_noise() -> None:
    """bench/drift.py run 4: most links read ~15 ms high beside the training traffic, the
    degraded pair 100+ ms; only the pair's bandwidth is worth probing."""
    rng = np.random.default_rng(0)
    n = 10
    base = rng.uniform(5, 100, (n, n))
    base = (base + base.T) / 2
    np.fill_diagonal(base, 0)
    old = Network(delay_ms=base, bandwidth_gbps=np.full((n, n), 0.02))
    noisy = np.triu(rng.random((n, n)) < 0.4)  # these pairs read 14-16 ms high, the rest 0-3
    noisy |= noisy.T
    shift = np.where(noisy, rng.uniform(14, 16, (n, n)), rng.uniform(0, 3, (n, n)))
    shift = np.minimum(shift, shift.T)  # the lesser end's reading stands for both
    delay = base + shift
    delay[0, 1] = delay[1, 0] = base[0, 1] + 120
    np.fill_diagonal(delay, 0)
    settled = settle_remeasured(old, delay, np.full((n, n), np.nan), threshold=0.3)
    assert {tuple(p) for p in np.argwhere(settled.delay_moved)} == {(0, 1), (1, 0)}
    assert 16.0 < settled.noise_ms < 50.0
    assert settled.net.delay_ms[0, 1] == pytest.approx(base[0, 1] + 120)
    assert settled.net.delay_ms[2, 3] == base[2, 3]  # noise keeps the plan's figure

    # a quiet sweep keeps the fixed floor: a 10 ms move on a 20 ms link is a change
    quiet = base.copy()
    quiet[2, 3] = quiet[3, 2] = base[2, 3] + max(10.0, 0.35 * base[2, 3])
    settled = settle_remeasured(old, quiet, np.full((n, n), np.nan), threshold=0.3)
    assert settled.noise_ms == LINK_CHANGE_MS
    assert {tuple(p) for p in np.argwhere(settled.delay_moved)} == {(2, 3), (3, 2)}

    # most links changed (a whole region re-routed): the floor stops at its cap
    far = base + np.where(rng.random((n, n)) < 0.6, 200.0, 0.0)
    far = np.minimum(far, far.T)
    np.fill_diagonal(far, 0)
    settled = settle_remeasured(old, far, np.full((n, n), np.nan), threshold=0.3)
    assert settled.noise_ms == SWEEP_NOISE_CAP_MS
    assert np.array_equal(settled.delay_moved, far - base > 100)


def test_copy_seconds_counts_only_members_that_change_stage() -> None:
    net = Network(delay_ms=np.zeros((4, 4)), bandwidth_gbps=np.full((4, 4), 0.008))
    assert copy_seconds([[0, 1], [2, 3]], [[1, 0], [3, 2]], [10**6, 10**6], net) == 0.0
    # agent 2 moves to stage 0: 1 MB over 8 Mbit/s from the best holder
    assert copy_seconds([[0, 1], [2, 3]], [[2, 1], [0, 3]], [10**6, 10**6], net) == \
        pytest.approx(1.0)


def test_move_verdict_weighs_gain_against_margin_times_cost() -> None:
    assert move_verdict(2.0, 1.0, 100, 40.0, 2.0)[:2] == (True, 100.0)
    assert move_verdict(2.0, 1.0, 100, 60.0, 2.0)[0] is False
    assert move_verdict(1.0, 1.2, 100, 1.0, 2.0)[0] is False


def test_a_slower_device_gets_fewer_layers(tmp_path: Path) -> None:
    links = tmp_path / "links.json"
    write_links(links, set())

    async def body(c: Cluster) -> None:
        first = await c.assignments()
        assert {a.layer_end - a.layer_begin for a in first.values()} == {2}
        steps(c, 1, 9, 0.5)
        slow = c.ids[0]
        for step in range(10, 16):  # agent-0's device computes 4x slower; the others wait
            for agent in c.ids:
                c.report(agent, worker_state=WorkerState.TRAINING, step=step, step_s=1.1,
                         compute_s=0.8 if agent == slow else 0.2,
                         pp_wait_s=0.3 if agent == slow else 0.9, dp_s=0.0, loss=3.0)
        await _until(lambda: bool(c.job.replan.records)
                     and c.job.replan.records[-1].outcome in ("pending", "declined"))
        rec = c.job.replan.records[-1]
        assert [d.agent for d in rec.devices] == [slow]
        assert rec.devices[0].compute_s_after == pytest.approx(0.8)
        assert rec.decision == "move", rec.why
        assert rec.predicted_new_s < rec.predicted_stay_s
        for step in range(16, 22):
            for agent in c.ids:
                c.report(agent, worker_state=WorkerState.TRAINING, step=step, step_s=1.1,
                         compute_s=0.8 if agent == slow else 0.2, loss=3.0)
        second = await c.assignments()
        layers = second[slow].layer_end - second[slow].layer_begin
        assert layers < 2  # its stage was cut shorter
        assert list(second[slow].checkpoint_splits) == [2, 2]  # re-cut from the checkpoint
    run(body, replan_config(links, tmp_path))


def test_a_spare_replaces_a_member_whose_uplink_degraded(tmp_path: Path) -> None:
    links = tmp_path / "links.json"
    write_links(links, set(), n=5)

    async def body(c: Cluster) -> None:
        first = await c.assignments()
        # a fifth agent joins while the job trains: a spare, fast to everyone
        info = common_pb2.AgentInfo(agent_id="agent-4", host="10.0.0.9", port=7071,
                                    device=common_pb2.DeviceInfo(kind="cpu", flops=1e10))
        spare = c.registry.join(info).agent_id
        c.ids.append(spare)  # its heartbeats; its progress reports are not a member's
        steps(c, 1, 9, 0.5)
        victim = next(a for a, x in first.items() if x.stage == 0 and x.replica == 0)
        k = int(victim[-1])
        write_links(links, {frozenset((k, j)) for j in range(5) if j != k}, n=5)
        steps(c, 10, 15, 3.0, wait_s=2.8)
        await _until(lambda: bool(c.job.replan.records)
                     and c.job.replan.records[-1].outcome in ("pending", "declined"))
        rec = c.job.replan.records[-1]
        assert rec.decision == "move", rec.why
        assert spare in rec.grid_after and victim not in rec.grid_after, rec.grid_after
        steps(c, 16, 21, 3.0, wait_s=2.8)
        await _until(lambda: c.job.epoch == 2)
        assert c.job.plan is not None
        members = {a for row in c.job.plan.grid for a in row.agent_ids}
        assert spare in members and victim not in members
        assert rec.outcome == "moved"
    run(body, replan_config(links, tmp_path))


def test_re_plans_outlive_a_coordinator_restart(tmp_path: Path) -> None:
    from coordinator.daemon.jobstore import JobStore
    from coordinator.daemon.registry import Registry
    from coordinator.job.machine import Job
    from coordinator.links.measure import LinkMeasurer
    from coordinator.links.store import LinkStore

    def job() -> Job:
        registry, links = Registry(liveness_timeout_s=60), LinkStore()
        return Job(config(), registry, LinkMeasurer(registry, links), links,
                   JobStore(tmp_path / "state"))

    first = job()
    first.replan.records.append(coordinator_pb2.Replan(
        at_step=40, decision="move", outcome="moved", gain_s=90.0, step_after_s=0.4))
    first.replan.records.append(coordinator_pb2.Replan(at_step=70, decision="move",
                                                       outcome="pending", why="faster"))
    first.persist()
    second = job()
    assert second.job_id == first.job_id
    moved, pending = second.replan.records
    assert (moved.at_step, moved.outcome, moved.gain_s) == (40, "moved", 90.0)
    assert pending.outcome == "dropped" and "restarted" in pending.why


@pytest.mark.parametrize(("change", "says"), [
    ({"placement": "rank-order"}, "the placement is fixed (rank-order)"),
    ({"no_replan": True}, "--no-replan: reported only"),
])
def test_a_fixed_placement_or_no_replan_reports_and_never_moves(
        tmp_path: Path, change: dict, says: str) -> None:
    links = tmp_path / "links.json"
    write_links(links, set())
    cfg = replan_config(links, tmp_path)
    cfg.placement = change.get("placement", cfg.placement)
    cfg.drift.replan = not change.get("no_replan", False)

    async def body(c: Cluster) -> None:
        rec, _ = await degrade_plan_links(c, links, "declined")
        assert says in rec.why and rec.links and rec.predicted_stay_s > 0
        steps(c, 16, 31, 3.0, wait_s=2.8)  # past two checkpoints: no move
        await asyncio.sleep(0.3)
        assert c.job.epoch == 1
    run(body, cfg)


def test_the_bandwidth_probed_is_of_links_whose_delay_moved_else_the_suspects_plan_links(
        ) -> None:
    """After the latency sweep: probe the pairs whose delay moved, in the plan or not (a new
    plan must not route over one with its old rate); where none moved, the suspects' plan
    links (a link can lose rate and keep its delay)."""
    ids = ["a", "b", "c", "d"]
    grid = [[0, 1], [2, 3]]  # pipelines a-c and b-d; replica groups {a, b} and {c, d}
    moved_delay = np.zeros((4, 4), dtype=bool)
    moved_delay[0, 3] = True  # a -> d (not a plan link) read longer; d -> a did not
    assert links_to_probe(grid, ids, moved_delay, {"a"}) == {("a", "d"), ("d", "a")}
    none = np.zeros((4, 4), dtype=bool)
    assert links_to_probe(grid, ids, none, {"c"}) == {
        ("c", "a"), ("a", "c"), ("c", "d"), ("d", "c")}


@pytest.mark.parametrize(("step_s", "heartbeat_s", "lead"),
                         [(3.0, 1.0, 2), (0.5, 1.0, 5), (3.0, 5.0, 3), (0.5, 5.0, 13)])
def test_a_requested_checkpoint_lies_a_heartbeat_and_a_margin_ahead(
        step_s: float, heartbeat_s: float, lead: int) -> None:
    """The newest report may be a heartbeat old: a sparse `--heartbeat-interval` asks further
    ahead, or every worker would hear too late and the move fall back to the regular
    checkpoint (the default 1 s heartbeat keeps the 2 s the drift benchmark ran with)."""
    assert request_lead(step_s, heartbeat_s) == lead
    assert (request_lead(step_s, heartbeat_s) - 1) * step_s >= heartbeat_s + REQUEST_MARGIN_S


def test_the_coordinator_tells_its_registry_the_heartbeat_interval() -> None:
    from coordinator.daemon.config import CoordinatorConfig
    from coordinator.daemon.server import CoordinatorService

    svc = CoordinatorService(CoordinatorConfig(heartbeat_interval_s=4.0, liveness_timeout_s=9.0))
    assert svc.registry.heartbeat_interval_s == 4.0
