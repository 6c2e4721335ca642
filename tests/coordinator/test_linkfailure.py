"""A dead link between two live agents: what a peer error blames, how failed links are sorted
into broken agents and dead links, and a plan that routes no traffic over a dead link.

The pure decisions (`coordinator/linkfailure.py`) first, then the job: a recovery after a peer
error re-measures the links it blames and plans around the one that carries nothing, instead of
restarting the same placement (or leaving out an agent the job needs).
"""

from __future__ import annotations

import numpy as np

from coordinator.links import failure as lf
from coordinator.scheduler import Network, plan_cost
from dtfm.core.workerstate import WorkerState
from protos.dtfm.v1 import coordinator_pb2
from tests.coordinator.test_job_states import Harness, config, run

S = coordinator_pb2


def test_workers_connect_along_pipelines_within_stages_and_to_rank_0() -> None:
    pairs = lf.connected_pairs([["a", "b"], ["c", "d"], ["e", "f"]])
    pipelines = {frozenset(p) for p in [("a", "c"), ("c", "e"), ("a", "e"),  # a whole group
                                        ("b", "d"), ("d", "f"), ("b", "f")]}
    stages = {frozenset(p) for p in [("a", "b"), ("c", "d"), ("e", "f")]}
    store = {frozenset(("a", x)) for x in "bcdef"}  # rank 0 (a) holds the store
    assert pairs == pipelines | stages | store
    assert frozenset(("c", "f")) not in pairs and frozenset(("d", "e")) not in pairs


def test_a_peer_error_blames_both_ways_of_every_link_its_worker_used() -> None:
    grid = [["a", "b"], ["c", "d"]]
    blamed = lf.blamed_links(grid, ["d"])
    assert blamed == {(x, y) for p in ("bd", "cd", "ad") for x, y in (p, p[::-1])}
    assert lf.blamed_links([], ["d"]) == set()  # no plan yet: nothing to blame
    progress = {
        "b": S.ProgressReport(worker_state=WorkerState.FAILED.to_wire(), error_kind="peer"),
        "c": S.ProgressReport(worker_state=WorkerState.FAILED.to_wire(), error_kind="config"),
        "d": S.ProgressReport(worker_state=WorkerState.TRAINING.to_wire(), step=3),
    }
    assert lf.peer_failed(progress) == ["b"]


def test_an_agent_that_reaches_nobody_is_left_out_and_a_single_dead_link_is_planned_around(
        ) -> None:
    ids = [f"a{i}" for i in range(8)]
    cut_off = [(x, "a3") for x in ids if x != "a3"] + [("a3", x) for x in ids if x != "a3"]
    got = lf.partition(ids, cut_off + [("a1", "a6"), ("a6", "a1")])
    assert got.leave_out == ["a3"] and got.dead == {frozenset(("a1", "a6"))}
    one_way = lf.partition(ids, [("a2", "a5")])  # one direction failed: the pair is dead
    assert one_way.leave_out == [] and one_way.dead == {frozenset(("a2", "a5"))}
    # with 4 agents, an agent that fails to reach two of its three peers is broken
    small = lf.partition(ids[:4], [("a0", "a1"), ("a0", "a2")])
    assert small.leave_out == ["a0"] and small.dead == set()


def test_a_dead_link_is_priced_so_the_cost_model_never_prefers_it() -> None:
    ids = ["a", "b", "c", "d"]
    delay, rate = np.full((4, 4), 10.0), np.full((4, 4), 1.0)
    delay[1, 3] = rate[1, 3] = np.nan  # b->d failed: no figure
    d, r = lf.priced(delay, rate, ids, {frozenset(("b", "d"))})
    assert d[1, 3] == d[3, 1] == lf.DEAD_DELAY_MS and r[1, 3] == r[3, 1] == lf.DEAD_GBPS
    net = Network.measured(d, r)  # passes the boundary checks: finite and positive
    across, around = [[0, 1], [2, 3]], [[0, 1], [3, 2]]  # b, d pipeline neighbours or not
    assert plan_cost(net, across, 0.5, 0.1)[0] > 1000 * plan_cost(net, around, 0.5, 0.1)[0]


def test_a_grid_over_a_dead_link_is_swapped_off_it_or_refused_when_none_avoids_it() -> None:
    dead = {frozenset((1, 3))}
    grid = [[0, 1], [2, 3]]  # 1 and 3: one pipeline
    assert lf.crossing(grid, dead) == dead
    fixed = lf.avoid(grid, dead)
    assert fixed is not None and not lf.crossing(fixed, dead)
    assert sorted(d for row in fixed for d in row) == [0, 1, 2, 3]
    assert sum(a != b for r, s in zip(grid, fixed, strict=True)
               for a, b in zip(r, s, strict=True)) == 2  # one swap
    assert lf.avoid([[0], [1]], {frozenset((0, 1))}) is None  # two agents, one pipeline


def test_a_recovery_after_a_peer_error_re_measures_its_links_and_plans_around_a_dead_one(
        ) -> None:
    async def body(h: Harness) -> None:
        await h.running_epoch(1)
        grid = [list(row.agent_ids) for row in h.job.plan.grid]
        a, b = grid[0][1], grid[1][1]  # pipeline neighbours, neither holds the store
        h.links.dead_after_measure = {(a, b), (b, a)}  # cut: the re-measurement finds it
        h.report(b, WorkerState.FAILED, error_kind="peer",
                 error=f"PeerError: pipeline receive from {a}: no answer within 10 s")
        await h.running_epoch(2)
        asked = h.measurer.asked[-1].get("bandwidth_links", set())
        assert {(a, b), (b, a)} <= asked, asked  # the links the error blamed
        new = [list(row.agent_ids) for row in h.job.plan.grid]
        assert frozenset((a, b)) not in lf.connected_pairs(new), new
        assert sorted(x for row in new for x in row) == sorted(h.registry.agents)
        assert h.registry.marked_lost == []  # both ends of the dead link still train
        assert "dead link(s)" in h.job.message and h.job.state == S.JOB_STATE_RUNNING
    cfg = config(max_restarts=3)
    cfg.placement = "scheduled"
    cfg.search_seconds = 0.2
    run(cfg, body)


def test_a_recovery_after_a_lost_agent_re_measures_nothing_it_has_figures_for() -> None:
    async def body(h: Harness) -> None:
        h.links.remember = True
        await h.running_epoch(1)
        h.report("agent-1", WorkerState.FAILED, error_kind="internal", error="a bug")
        await h.running_epoch(2)
        assert len(h.measurer.rounds) == 1  # the stored links served the recovery
    run(config(max_restarts=3), body)

