"""Two jobs side by side: how many agents each gets (coordinator/daemon/jobsplit.py) and
the view of the registry each sees (coordinator/daemon/share.py)."""

from __future__ import annotations

import asyncio

from coordinator.daemon.jobsplit import Ask, ask_of, job_cost, split, why
from coordinator.daemon.registry import Registry
from coordinator.daemon.share import AgentPool
from coordinator.jobflags import parse_submitted
from protos.dtfm.v1 import common_pb2


def test_each_job_gets_its_need_and_the_rest_goes_by_predicted_cost() -> None:
    cheap, costly = Ask("a", 2, 8, 1.0), Ask("b", 2, 8, 3.0)
    assert split(3, [cheap, costly]) is None  # their needs do not both fit
    assert split(4, [cheap, costly]) == [2, 2]
    assert split(12, [cheap, costly]) == [4, 8]  # 8 spare: 2 and 6, by cost
    assert split(20, [cheap, costly]) == [8, 8]  # none past what it wants
    assert split(5, [Ask("a", 1, 1, 5.0), Ask("b", 2, 4, 1.0)]) == [1, 4]
    assert split(3, [Ask("a", 1, 4, 0.0), Ask("b", 1, 4, 0.0)]) in ([2, 1], [1, 2])
    lines = why([cheap, costly], [4, 8])
    assert "4 agent(s) of 8 wanted (at least 2)" in lines[0] and "75 %" in lines[1]


def test_the_cost_is_a_steps_flops_times_the_steps() -> None:
    small = parse_submitted(["--model", "gpt-tiny", "--agents", "2", "--steps", "3"])
    long = parse_submitted(["--model", "gpt-tiny", "--agents", "4", "--min-agents", "2",
                            "--steps", "6"])
    assert job_cost(long) == 2 * job_cost(small) > 0
    assert ask_of("j", long) == Ask("j", 2, 4, job_cost(long))


def _join(registry: Registry, n: int) -> list[str]:
    for i in range(n):
        registry.join(common_pb2.AgentInfo(agent_id=f"a{i}", host="127.0.0.1", port=7000 + i))
    return [f"a{i}" for i in range(n)]


def test_a_job_alone_sees_every_agent_and_side_by_side_only_its_own() -> None:
    registry = Registry(10.0)
    ids = _join(registry, 5)
    pool = AgentPool(registry)
    first = pool.share("j1")
    assert [a.agent_id for a in first.alive()] == ids  # alone: spares and all, as before
    members = ["a3", "a4"]
    first.members = lambda: members
    assert [a.agent_id for a in pool.free()] == ["a0", "a1", "a2"]
    second = pool.share("j2", ["a0", "a1"])
    assert [a.agent_id for a in first.alive()] == ["a2", *members]  # the oldest: spares too
    assert [a.agent_id for a in second.alive()] == ["a0", "a1"]
    assert [a.agent_id for a in pool.free()] == ["a2"]  # idle: held by no job
    # everything else is the registry's own
    assert second.get("a3") is registry.get("a3") and len(second) == 5
    assert second.heartbeat_interval_s == registry.heartbeat_interval_s
    pool.release("j1")  # it ended: its agents are free, and the other job runs alone
    assert [a.agent_id for a in pool.free()] == ["a2", "a3", "a4"]
    assert len(second.alive()) == 5


def test_two_queued_jobs_start_side_by_side_split_by_cost_each_seeing_only_its_agents(
        ) -> None:
    from coordinator.daemon.config import CoordinatorConfig
    from coordinator.daemon.server import CoordinatorService
    from tests.agent.test_checkpoint_transfer import SECURITY
    from tests.coordinator.served import stop_driving

    async def main() -> None:
        svc = CoordinatorService(CoordinatorConfig(security=SECURITY))
        ids = _join(svc.registry, 6)
        job = ["--model", "gpt-tiny", "--agents", "4", "--min-agents", "2", "--stages", "2"]
        small = svc.queue.submit([*job, "--steps", "3"])
        big = svc.queue.submit([*job, "--steps", "9"])  # three times the work
        svc.start_what_fits()
        assert not svc.queue.waiting and len(svc.runs) == 2  # both started at once
        try:
            held = {j: s.held() for j, s in svc.pool.shares.items()}
            assert len(held[small.job_id]) == 2 and len(held[big.job_id]) == 4
            assert held[small.job_id] | held[big.job_id] == set(ids)
            for job_id, run in svc.runs.items():  # each job's own membership sees its share
                assert {a.agent_id for a in run.job.membership.reachable()} == held[job_id]
            rows = {r.job_id: r for r in (await svc.ListJobs(None, None)).jobs}  # type: ignore[arg-type]
            assert "holds 4 agent(s): 4 agent(s) of 4 wanted (at least 2)" in \
                rows[big.job_id].message and "75 %" in rows[big.job_id].message
            assert svc.job is svc.runs[small.job_id].job  # the first is the one status shows
            # their rank 0s may share a host: neither draws the other's rendezvous port
            first, second = svc.runs[small.job_id].job, svc.runs[big.job_id].job
            port = second.planner.rendezvous_port(1)
            assert first.planner.taken_ports() == {port}
            first.planner.taken_ports = lambda: set(range(29500, 30500, 2)) - {29998}
            assert first.planner.rendezvous_port(1) == 29998
        finally:
            await stop_driving(svc)

    asyncio.run(main())
