"""The job state machine alone: a fake registry, fake agents, a fake measurer and link store.

No grpc, no processes, no scheduler pool (rank-order placement on alike devices): each test
drives `Job` through its states by adding agents and feeding worker reports, and reads what it
did from the commands the fake agents received and the states it passed through. The fake
agents' liveness is read-only outside the fake registry, so a job that changed an agent's state
behind the registry's back would crash here instead of passing.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest

from coordinator.daemon.config import JobConfig
from coordinator.daemon.jobstore import JobStore
from coordinator.job.machine import Job
from dtfm.core.spec import TrainConfig
from dtfm.core.workerstate import WorkerState
from protos.dtfm.v1 import common_pb2, coordinator_pb2

S = coordinator_pb2
FAILED, RECOVERING = S.JOB_STATE_FAILED, S.JOB_STATE_RECOVERING


class FakeAgent:
    """What the job reads of an agent record; its state belongs to the registry."""

    def __init__(self, registry: FakeRegistry, index: int) -> None:
        self._registry = registry
        self.info = common_pb2.AgentInfo(
            agent_id=f"agent-{index}", host=f"10.0.0.{index + 1}", port=7071,
            device=common_pb2.DeviceInfo(kind="cpu", flops=1e10, memory_bytes=2**34))
        self.inbox: list[coordinator_pb2.Command] = []
        self.silent_since: float | None = None  # a dead agent the registry has not swept
        self.reach = common_pb2.ReachStatus()  # not checked: the job keeps gloo

    @property
    def agent_id(self) -> str:
        return self.info.agent_id

    @property
    def last_seen(self) -> float:  # a live fake agent heartbeats all the time
        return self.silent_since if self.silent_since is not None else time.monotonic()

    @property
    def state(self) -> int:  # no setter: only the registry changes it
        return self._registry.states[self.agent_id]

    def kinds(self) -> list[str]:
        return [str(c.WhichOneof("kind")) for c in self.inbox]

    def assignments(self) -> list[common_pb2.Assignment]:
        return [c.assign for c in self.inbox if c.WhichOneof("kind") == "assign"]


class FakeRegistry:
    """The registry's surface the job uses; every state change is recorded."""

    def __init__(self) -> None:
        self.agents: dict[str, FakeAgent] = {}
        self.states: dict[str, int] = {}
        self.marked_lost: list[tuple[str, str]] = []
        self.job: Job | None = None
        self.heartbeat_interval_s = 0.05

    def add(self, n: int) -> None:
        for _ in range(n):
            agent = FakeAgent(self, len(self.agents))
            self.agents[agent.agent_id] = agent
            self.states[agent.agent_id] = S.AGENT_STATE_ALIVE
        self._changed()

    def _changed(self) -> None:
        if self.job is not None:
            self.job.poke()

    def now(self) -> float:
        return time.monotonic()

    def alive(self) -> list[FakeAgent]:
        return [a for a in self.agents.values() if a.state == S.AGENT_STATE_ALIVE]

    def get(self, agent_id: str) -> FakeAgent | None:
        return self.agents.get(agent_id)

    def send(self, agent_id: str, command: coordinator_pb2.Command) -> None:
        self.agents[agent_id].inbox.append(command)

    def mark_lost(self, agent_id: str, reason: str) -> FakeAgent | None:
        self.marked_lost.append((agent_id, reason))
        self.states[agent_id] = S.AGENT_STATE_LOST
        self._changed()
        return self.agents[agent_id]


class FakeMeasurer:
    """Answers every measurement at once with a uniform matrix over the agents asked for."""

    def __init__(self, links: FakeLinks) -> None:
        self.links = links
        self.rounds: list[list[str]] = []
        self.asked: list[dict[str, Any]] = []
        self.running = False

    def missing_links(self, ids: list[str]) -> set[tuple[str, str]]:
        return {(a, b) for a in ids for b in ids
                if a != b and not self.links.complete_for([a, b])}

    async def measure(self, agents: list[FakeAgent], only_missing: bool = False,
                      **kw: Any) -> common_pb2.LinkMatrix:
        """`kw`: what else the job asked for (`bandwidth_links` after peer errors), kept in
        `asked`; the links in `links.dead_after_measure` fail from then on."""
        ids = [a.agent_id for a in agents]
        self.rounds.append(ids)
        self.asked.append(kw)
        self.links.dead |= self.links.dead_after_measure
        self.links.known.update(ids)
        return self.links.matrix(ids)


class FakeLinks:
    def __init__(self) -> None:
        self.unreachable: list[str] = []
        # False: every epoch measures, so each recovery shows as a measuring round; True:
        # links measured once are known, as in the real LinkStore
        self.remember = False
        self.known: set[str] = set()

        self.dead: set[tuple[str, str]] = set()  # links that fail, between live agents
        self.dead_after_measure: set[tuple[str, str]] = set()  # they fail from a measurement on

    def unreachable_agents(self, ids: list[str]) -> list[str]:
        return [a for a in self.unreachable if a in ids]

    @property
    def entries(self) -> dict[tuple[str, str], Any]:
        """The failed links, as the real store keeps them: every link to and from an agent in
        `unreachable`, and those in `dead`."""
        failed = common_pb2.LinkSample(reachable=False)
        out: dict[tuple[str, str], Any] = {link: failed for link in self.dead}
        for a in self.unreachable:
            for b in self.known - {a}:
                out[(a, b)] = out[(b, a)] = failed
        return out

    def complete_for(self, ids: list[str]) -> bool:
        return (self.remember and set(ids) <= self.known
                and not any({a, b} <= set(ids) for a, b in self.dead))

    def matrix(self, ids: list[str]) -> common_pb2.LinkMatrix:
        """10 ms and 1 Gbit/s everywhere, NaN (no figure) on a dead link."""
        n = len(ids)
        cells = [math.nan if (a, b) in self.dead else v for a in ids for b in ids
                 for v in (1.0,)]
        return common_pb2.LinkMatrix(agent_ids=ids, delay_ms=[10.0 * c for c in cells],
                                     bandwidth_gbps=cells[: n * n])


class RecordingJob(Job):
    """A job that keeps every state it enters, in order (the seam: its one state setter)."""

    def __init__(self, *args: Any) -> None:
        self.entered: list[int] = []
        super().__init__(*args)

    def _set(self, state: int, message: str) -> None:
        if not self.entered or self.entered[-1] != state:
            self.entered.append(state)
        super()._set(state, message)


class Harness:
    def __init__(self, cfg: JobConfig, store: JobStore | None = None) -> None:
        """`store`: the job keeps its state there (`coordinator start --state-dir`)."""
        self.registry = FakeRegistry()
        self.links = FakeLinks()
        self.measurer = FakeMeasurer(self.links)
        self.job = RecordingJob(cfg, self.registry, self.measurer, self.links, store)
        self.registry.job = self.job

    def report(self, agent_id: str, state: WorkerState, **fields: Any) -> None:
        """A member's heartbeat for the running epoch, as the server hands it to the job."""
        rec = self.registry.agents[agent_id]
        self.job.on_progress(rec, S.ProgressReport(  # type: ignore[arg-type]
            agent_id=agent_id, job_id=self.job.job_id, epoch=self.job.epoch,
            worker_state=state.to_wire(), **fields))

    async def running_epoch(self, epoch: int) -> None:
        await until(lambda: self.job.state == S.JOB_STATE_RUNNING and self.job.epoch == epoch)


def config(agents: int = 4, **kw: Any) -> JobConfig:
    cfg = JobConfig(model="gpt-tiny", agents=agents, stages=2, replicas=agents // 2,
                    train=TrainConfig(global_batch=8, micro_batches=2, steps=5),
                    measure_links=True, placement="rank-order", **kw)
    cfg.validate()
    return cfg


async def until(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.01)


def run(cfg: JobConfig, body: Callable[[Harness], Awaitable[None]], agents: int = 4,
        store: JobStore | None = None) -> None:
    """Run the job with `agents` fake agents joined, and `body` beside it."""
    async def main() -> None:
        h = Harness(cfg, store)
        h.registry.add(agents)
        task = asyncio.get_running_loop().create_task(h.job.run())
        try:
            await body(h)
        finally:
            try:
                if not task.done():
                    task.cancel()
                elif task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            finally:
                # a body may have started the job's relay: its listening socket would outlive
                # the loop and show in a later test of this process's ports (test_front.py)
                await h.job.dataplane.close()
    asyncio.run(main())


def test_waits_for_enough_agents_then_measures_schedules_and_runs() -> None:
    async def body(h: Harness) -> None:
        await until(lambda: "2 of 4 alive" in h.job.message)
        await asyncio.sleep(0.05)  # time enough to do something wrong
        assert h.job.state == S.JOB_STATE_WAITING and h.job.epoch == 0
        assert h.measurer.rounds == [] and all(not a.inbox for a in h.registry.agents.values())
        h.registry.add(2)
        await h.running_epoch(1)
        assert h.job.entered == [S.JOB_STATE_WAITING, S.JOB_STATE_MEASURING,
                                 S.JOB_STATE_SCHEDULING, S.JOB_STATE_RUNNING]
        assert h.measurer.rounds == [list(h.registry.agents)]
        got = [a.assignments() for a in h.registry.agents.values()]
        assert all(len(x) == 1 and x[0].epoch == 1 for x in got), got
        assert sorted(x[0].rank for x in got) == [0, 1, 2, 3]
        assert sorted(h.job.members) == sorted(h.registry.agents)
    run(config(), body, agents=2)


def test_a_failed_worker_stops_everyone_and_recovers_in_a_new_epoch() -> None:
    async def body(h: Harness) -> None:
        await h.running_epoch(1)
        h.report("agent-2", WorkerState.FAILED, error="peer died", error_kind="peer")
        await h.running_epoch(2)
        assert h.job.entered[-4:] == [RECOVERING, S.JOB_STATE_MEASURING,
                                      S.JOB_STATE_SCHEDULING, S.JOB_STATE_RUNNING]
        assert h.job.restarts == 1 and len(h.measurer.rounds) == 2
        for agent in h.registry.agents.values():  # stop, then the new epoch's assignment
            assert agent.kinds() == ["assign", "stop", "assign"], agent.kinds()
            assert [a.epoch for a in agent.assignments()] == [1, 2]
        assert "agent-2 failed: peer died" in agent.inbox[1].stop.reason
    run(config(max_restarts=3), body)


def test_the_job_is_done_only_when_every_member_is_done() -> None:
    async def body(h: Harness) -> None:
        await h.running_epoch(1)
        *first, last = h.job.members
        for agent_id in first:
            h.report(agent_id, WorkerState.DONE, step=5)
        h.report(last, WorkerState.TRAINING, step=4)
        await asyncio.sleep(0.05)
        assert h.job.state == S.JOB_STATE_RUNNING
        h.report(last, WorkerState.DONE, step=5)
        await until(lambda: h.job.state == S.JOB_STATE_DONE)
        assert h.job.restarts == 0 and h.job.epoch == 1
    run(config(), body)


def test_a_config_error_fails_the_job_without_another_epoch() -> None:
    async def body(h: Harness) -> None:
        await h.running_epoch(1)
        h.report("agent-1", WorkerState.FAILED, error="ValueError: bad layer range",
                 error_kind="config")
        await until(lambda: h.job.state == FAILED)
        await asyncio.sleep(0.05)
        assert h.job.epoch == 1 and len(h.measurer.rounds) == 1
        assert RECOVERING not in h.job.entered and "invalid" in h.job.message
    run(config(max_restarts=3), body)


def test_the_job_fails_once_restarts_run_out() -> None:
    async def body(h: Harness) -> None:
        for epoch in (1, 2):
            await h.running_epoch(epoch)
            h.report("agent-0", WorkerState.FAILED, error="peer died", error_kind="peer")
        await until(lambda: h.job.state == FAILED)
        assert h.job.entered.count(RECOVERING) == 1 and h.job.restarts == 2
        assert h.job.epoch == 2 and "gave up after 1 restart in a row" in h.job.message
    run(config(max_restarts=1), body)


def test_a_lost_member_fails_the_epoch_and_the_job_waits_for_a_replacement() -> None:
    async def body(h: Harness) -> None:
        await h.running_epoch(1)
        h.registry.states["agent-3"] = S.AGENT_STATE_LOST  # the registry's sweep did this
        h.job.on_lost([h.registry.agents["agent-3"]])
        await until(lambda: "3 of 4 alive" in h.job.message)
        assert h.job.state == RECOVERING and h.job.restarts == 1
        assert h.registry.agents["agent-3"].kinds() == ["assign"]  # no stop to a lost agent
        h.registry.add(1)
        await h.running_epoch(2)
        assert "agent-3" not in h.job.members and "agent-4" in h.job.members
    run(config(max_restarts=3), body)


def test_an_unreachable_agent_is_marked_lost_through_the_registry() -> None:
    async def body(h: Harness) -> None:
        h.links.unreachable = ["agent-3"]
        await until(lambda: "3 of 4 alive" in h.job.message)
        assert [a for a, _ in h.registry.marked_lost] == ["agent-3"]
        assert "unreachable" in h.registry.marked_lost[0][1]
        assert h.job.state == S.JOB_STATE_WAITING and h.job.epoch == 0
        assert all(not a.inbox for a in h.registry.agents.values())
        h.registry.states["agent-3"] = S.AGENT_STATE_ALIVE  # its next heartbeat arrives
        h.registry._changed()
        await asyncio.sleep(0.1)
        assert len(h.measurer.rounds) == 1, "the unreachable agent was measured again"
        assert h.job.state == S.JOB_STATE_WAITING and "3 of 4 alive" in h.job.message
        h.links.unreachable = []
        h.registry.add(1)
        await h.running_epoch(1)
        assert "agent-3" not in h.job.members
        h.job.on_join(h.registry.agents["agent-3"])  # re-joined: measured again next time
        assert "agent-3" not in h.job.membership.unreachable
    run(config(), body)


def test_a_coordinator_error_while_planning_is_retried_then_fails_the_job_loudly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler process killed under the job (BrokenProcessPool) used to end the job's
    task silently, leaving it in "scheduling" for ever with no message."""
    from concurrent.futures.process import BrokenProcessPool

    import coordinator.job.machine as job_module
    from coordinator.job.epochplan import EpochPlanner

    monkeypatch.setattr(job_module, "INTERNAL_RETRY_S", 0.05)
    original = EpochPlanner.in_pool
    calls = {"n": 0, "fail": 1}

    async def flaky(fn: Any, *args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] <= calls["fail"]:
            raise BrokenProcessPool("a child process terminated abruptly")
        return await original(fn, *args)

    monkeypatch.setattr(EpochPlanner, "in_pool", staticmethod(flaky))

    async def once(h: Harness) -> None:
        await h.running_epoch(1)
        assert calls["n"] >= 2
        assert S.JOB_STATE_WAITING in h.job.entered[h.job.entered.index(S.JOB_STATE_SCHEDULING):]
    searched = replace(config(), placement="scheduled", search_seconds=0.2)
    run(searched, once)

    calls.update(n=0, fail=100)

    async def always(h: Harness) -> None:
        await until(lambda: h.job.state == S.JOB_STATE_FAILED)
        assert "BrokenProcessPool" in h.job.message and "gave up" in h.job.message
    run(replace(searched, max_restarts=2), always)
