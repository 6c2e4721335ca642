"""A recovery learns from the pair whose connection failed (issue 40): "each recovery
rescheduled the same placement and the same paths". The second failure of a pair relays it
(both ends, one peer table), the next places its two agents apart, the next fails the job with
a message naming both agents and what to open; a failure of another pair, or of no pair,
changes nothing. Driven through the real `Job` and planner with the fake agents of
test_job_states.py (no workers), and the coordinator's real relay on loopback.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from coordinator.daemon.config import JobConfig
from coordinator.daemon.jobstore import JobSnapshot, JobStore
from coordinator.job import failedpairs as fp
from coordinator.job.dataplane import PeerTable, peer_table
from coordinator.links import failure as lf
from dtfm.core.workerstate import WorkerState
from dtfm.net import reach
from protos.dtfm.v1 import common_pb2, coordinator_pb2
from tests.coordinator.test_job_states import FakeAgent, Harness, config, run, until
from tests.dtfm.test_relay_counters import hello_only

S = coordinator_pb2


def reachable(agent: FakeAgent) -> FakeAgent:
    """A fake agent found reachable from everywhere, serving its data plane on port 7072."""
    agent.reach = common_pb2.ReachStatus(verdict=reach.EVERYWHERE)
    agent.info.data_port = 7072
    agent.data_port = 7072  # type: ignore[attr-defined]  # AgentRecord's property
    agent.data_port_refused = ""  # type: ignore[attr-defined]
    return agent


def scheduled() -> JobConfig:
    """The job of test_job_states.py placed by the search, so a pair can be placed apart."""
    return replace(config(max_restarts=10), placement="scheduled", search_seconds=0.2)


def table(assignment: common_pb2.Assignment) -> PeerTable:
    plane = assignment.data_plane
    return PeerTable(list(plane.listen), set(plane.limited),
                     {(d.dialer, d.listener) for d in plane.direct})


def test_a_peer_error_names_the_rank_it_lost() -> None:
    assert fp.named_rank("PeerError: stage 2: waiting for gradients (micro-batch 3) from rank "
                         "7 ... [Errno 104] Connection reset by peer") == 7
    assert fp.named_rank("exchange the gradient norm and loss with [0, 1, 2, 3]: receive from "
                         "rank 0 failed: timed out") == 0
    assert fp.named_rank("send to rank 3 failed") == 3
    assert fp.named_rank("Connection closed by peer") is None
    failed = coordinator_pb2.ProgressReport(worker_state=WorkerState.FAILED.to_wire(),
                                            error_kind="peer", error="receive from rank 0 failed")
    other = coordinator_pb2.ProgressReport(worker_state=WorkerState.FAILED.to_wire(),
                                           error_kind="internal", error="from rank 0: a bug")
    assert fp.failed_pairs(["a", "b", "c"], {"b": failed, "c": other}) == {frozenset("ab")}


def test_a_relayed_pair_dials_neither_way_and_every_other_pair_as_before() -> None:
    agents = [reachable(FakeAgent(None, k)) for k in range(4)]  # type: ignore[arg-type]
    plain = peer_table(agents, set())  # type: ignore[arg-type]
    assert plain.relayed_pairs() == []
    cut = peer_table(agents, set(), [frozenset(("agent-1", "agent-0"))])  # type: ignore[arg-type]
    assert cut.relayed_pairs() == [(0, 1)]  # the one pair both ends read as relayed
    assert not cut.can_dial(0, 1) and not cut.can_dial(1, 0)
    assert all(cut.can_dial(a, b) for a in range(4) for b in range(4)
               if a != b and {a, b} != {0, 1})


def shared(plane: common_pb2.DataPlane) -> bytes:
    """The data plane every rank is told alike: all but its own row of pair keys."""
    copy = common_pb2.DataPlane()
    copy.CopyFrom(plane)
    copy.ClearField("pair_keys")
    return copy.SerializeToString()


async def fail_pair(h: Harness, low: int, high: int) -> tuple[str, str]:
    """Rank `high`'s worker times out receiving from rank `low`; their agent ids."""
    a, b = h.job.members[low], h.job.members[high]
    h.report(b, WorkerState.FAILED, error_kind="peer",
             error=f"PeerError: receive from rank {low} failed: timed out")
    return a, b


def test_a_pair_that_fails_twice_is_relayed_then_placed_apart_then_named(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="coordinator.job.failedpairs")

    async def body(h: Harness) -> None:
        for agent in h.registry.agents.values():
            reachable(agent)
        await h.job.dataplane.start_relay("127.0.0.1", 0)
        await h.running_epoch(1)
        first = h.job.plan.grid
        pair = frozenset(await fail_pair(h, 0, 1))
        await h.running_epoch(2)  # the first failure: noted only
        assert h.job.plan.grid == first
        last = h.registry.agents[h.job.members[1]].assignments()[-1]
        assert last.backend == "gloo", "nothing relayed after one failure"
        assert frozenset(await fail_pair(h, 0, 1)) == pair
        await h.running_epoch(3)  # the same pair again, direct both times: relayed
        ranks = {a: k for k, a in enumerate(h.job.members)}
        x, y = sorted(ranks[a] for a in pair)
        plane = [h.registry.agents[a].assignments()[-1] for a in h.job.members]
        assert {p.backend for p in plane} == {"dtfm"}
        assert len({shared(p.data_plane) for p in plane}) == 1  # both ends agree
        assert table(plane[0]).relayed_pairs() == [(x, y)]
        assert not plane[0].data_plane.hole_punch  # a punch would open the same path
        assert "failed 2 times on the direct path; relaying it" in caplog.text
        await fail_pair(h, x, y)
        await h.running_epoch(4)  # failed on the relay too: the two placed apart
        grid = [list(row.agent_ids) for row in h.job.plan.grid]
        assert pair not in lf.connected_pairs(grid), grid
        assert "placing them apart" in caplog.text
        ranks = {a: k for k, a in enumerate(h.job.members)}
        x, y = sorted(ranks[a] for a in pair)
        await fail_pair(h, x, y)
        await until(lambda: h.job.state == S.JOB_STATE_FAILED)
        assert "after it was relayed and placed apart" in h.job.message
        for agent_id in pair:
            assert f"{agent_id} at {h.registry.agents[agent_id].info.host}:7072" in h.job.message
        assert "open inbound TCP" in h.job.message
    run(scheduled(), body)


def test_another_pair_or_no_pair_changes_nothing() -> None:
    async def body(h: Harness) -> None:
        for agent in h.registry.agents.values():
            reachable(agent)
        await h.job.dataplane.start_relay("127.0.0.1", 0)
        await h.running_epoch(1)
        await fail_pair(h, 0, 1)
        await h.running_epoch(2)
        await fail_pair(h, 2, 3)  # a different pair
        await h.running_epoch(3)
        h.report(h.job.members[1], WorkerState.FAILED, error_kind="internal",
                 error="a bug, not from rank 0")  # a worker's own failure
        await h.running_epoch(4)
        assert h.job.dataplane.relay_only == set() and h.job.failed_pairs.apart() == set()
        assert h.registry.agents[h.job.members[0]].assignments()[-1].backend == "gloo"
    run(config(max_restarts=10), body)


def test_a_pair_with_no_relay_is_placed_apart_at_its_second_failure() -> None:
    async def body(h: Harness) -> None:
        await h.running_epoch(1)  # the coordinator's relay off, no relay agent
        pair = frozenset(await fail_pair(h, 1, 3))
        await h.running_epoch(2)
        await fail_pair(h, 1, 3)
        await h.running_epoch(3)
        grid = [list(row.agent_ids) for row in h.job.plan.grid]
        assert pair not in lf.connected_pairs(grid), grid
        assert h.job.dataplane.relay_only == set()
    run(scheduled(), body)


def test_the_memory_of_failed_pairs_is_kept_with_the_job() -> None:
    pairs = fp.FailedPairs()
    members = ["a", "b"]
    for _ in range(2):
        pairs.learn(1, {frozenset("ab")}, members, lambda x, y: fp.DIRECT, True, {})
    snap = JobSnapshot(job_id="j", fingerprint="f", failed_pairs=pairs.to_json())
    again = fp.FailedPairs(JobSnapshot.from_json(snap.to_json()).failed_pairs)
    assert again.relay_only() == {frozenset("ab")} and again.pairs[frozenset("ab")].failures == 2


def test_no_restart_budget_says_so_rather_than_zero_restarts() -> None:
    async def body(h: Harness) -> None:
        await h.running_epoch(1)
        await fail_pair(h, 0, 1)
        await until(lambda: h.job.state == S.JOB_STATE_FAILED)
        assert "not restarted: --max-restarts is 0" in h.job.message
        assert "0 restarts" not in h.job.message
    run(config(max_restarts=0), body)


def test_a_restarted_coordinator_keeps_relaying_the_pair(tmp_path: Path) -> None:
    async def main() -> None:
        first = Harness(config(max_restarts=10), JobStore(tmp_path))
        first.registry.add(4)
        for agent in first.registry.agents.values():
            reachable(agent)
        await first.job.dataplane.start_relay("127.0.0.1", 0)
        task = asyncio.get_running_loop().create_task(first.job.run())
        await first.running_epoch(1)
        pair = frozenset(await fail_pair(first, 0, 1))
        await first.running_epoch(2)
        await fail_pair(first, 0, 1)
        await first.running_epoch(3)
        task.cancel()
        await first.job.dataplane.close()
        second = Harness(config(max_restarts=10), JobStore(tmp_path))
        assert second.job.dataplane.relay_only == {pair}
        assert second.job.failed_pairs.pairs[pair].failures == 2
        # the adopted epoch's key died with the first process: its members' dials to the new
        # relay are stale, not intrusions (test_wan_nat8 in CI counted them as refused)
        assert second.job.epoch == 3
        relay = await second.job.dataplane.start_relay("127.0.0.1", 0)
        try:
            await asyncio.to_thread(hello_only, f"127.0.0.1:{relay}", second.job.job_id, 3)
            assert second.job.dataplane.relay is not None
            assert second.job.dataplane.relay.stale_dials == 1
            assert second.job.dataplane.relay.refused_bytes == 0
        finally:
            await second.job.dataplane.close()
    asyncio.run(main())


class _Plane:
    """The two things `after_epoch` reads of the epoch's data plane: each pair's path and
    whether a relay serves the job (the real `DataPlanes` is driven in the tests above)."""

    relay_only: set[fp.Pair] = set()

    @staticmethod
    def path_of(a: int, b: int) -> str:
        return fp.DIRECT

    @staticmethod
    def can_relay(records: object) -> bool:
        return True


class _Records:
    def __init__(self, states: dict[str, int]) -> None:
        self.states = states

    def get(self, agent_id: str) -> object:
        from types import SimpleNamespace
        return SimpleNamespace(agent_id=agent_id, state=self.states[agent_id], host="h",
                               port=1, data_port=1)


def _peer_failure(low: int) -> coordinator_pb2.ProgressReport:
    return coordinator_pb2.ProgressReport(worker_state=WorkerState.FAILED.to_wire(),
                                          error_kind="peer",
                                          error=f"receive from rank {low} failed: closed")


def test_the_peer_errors_a_lost_agent_caused_teach_nothing() -> None:
    """An agent killed mid-epoch (churn) closes its neighbours' connections, and gloo passes
    the close on: honest pairs report peer errors, often before the registry hears the agent
    is gone. Counting them relayed, then separated, honest pairs after every churn (a CI run
    of test_churn never finished its grown-back epoch). A member found gone at the recovery
    teaches nothing; one found gone after it (`forget`) takes back what it taught."""
    members = ["a", "b", "c"]
    alive = {m: S.AGENT_STATE_ALIVE for m in members}
    progress = {"b": _peer_failure(0)}
    pairs = fp.FailedPairs()
    gone = _Records({**alive, "c": S.AGENT_STATE_LOST})
    assert pairs.after_epoch(1, members, progress, _Plane(), gone) == ""  # type: ignore[arg-type]
    assert pairs.pairs == {}
    # heard of only after the recovery began: what the recovery noted is taken back
    pairs.after_epoch(2, members, progress, _Plane(), _Records(alive))  # type: ignore[arg-type]
    assert set(pairs.pairs) == {frozenset("ab")}
    pairs.forget(2)
    assert pairs.pairs == {}
    # a real second failure of the pair still relays it; forgetting a later churn keeps that
    for n in (3, 4):
        pairs.after_epoch(n, members, progress, _Plane(), _Records(alive))  # type: ignore[arg-type]
    assert pairs.relay_only() == {frozenset("ab")}
    pairs.after_epoch(5, members, progress, _Plane(), _Records(alive))  # type: ignore[arg-type]
    assert pairs.apart() == {frozenset("ab")}
    pairs.forget(5)
    assert pairs.relay_only() == {frozenset("ab")} and pairs.apart() == set()
    assert pairs.pairs[frozenset("ab")].failures == 2
