"""The job state machine with a real registry and fake agents (no grpc, no workers).

Pins what a placement puts where, what each rank is told to bind to, when a failure is final
instead of another round of measuring and re-planning, and how predicted and measured step
times are reported.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from coordinator.commands.status import status_to_text
from coordinator.daemon.config import JobConfig
from coordinator.daemon.registry import Registry
from coordinator.job.machine import Job
from coordinator.links.measure import LinkMeasurer
from coordinator.links.store import LinkStore
from dtfm.core.spec import TrainConfig
from dtfm.core.workerstate import WorkerState
from protos.dtfm.v1 import common_pb2, coordinator_pb2

S = coordinator_pb2
HOSTS = ["10.0.0.4", "10.0.0.2", "10.0.0.10", "10.0.0.3"]  # joined in this order


class Cluster:
    def __init__(self, config: JobConfig,
                 devices: list[common_pb2.DeviceInfo] | None = None) -> None:
        self.registry = Registry(liveness_timeout_s=60.0)
        store = LinkStore()
        self.job = Job(config, self.registry, LinkMeasurer(self.registry, store), store)
        self.ids = []
        self.asked: dict[str, list[S.Command]] = {}  # the commands before each assignment
        for i, host in enumerate(HOSTS):
            device = devices[i] if devices else common_pb2.DeviceInfo(kind="cpu", flops=1e10)
            info = common_pb2.AgentInfo(agent_id=f"agent-{i}", host=host, port=7071,
                                        device=device)
            self.ids.append(self.registry.join(info).agent_id)

    async def assignments(self) -> dict[str, common_pb2.Assignment]:
        out = {}
        for agent_id in self.ids:
            rec = self.registry.get(agent_id)
            assert rec is not None
            cmd = await asyncio.wait_for(rec.commands.get(), 20)
            # the end of the previous epoch, or a re-plan's ask for a checkpoint before it
            while cmd.WhichOneof("kind") in ("stop", "checkpoint"):
                self.asked.setdefault(agent_id, []).append(cmd)
                cmd = await asyncio.wait_for(rec.commands.get(), 20)
            assert cmd.WhichOneof("kind") == "assign", cmd
            out[agent_id] = cmd.assign
        return out

    async def heartbeats(self) -> None:
        """The agents' heartbeats (live agents send one every interval): the job plans a
        recovery only on agents heard from since the fault."""
        while True:
            for agent_id in self.ids:
                rec = self.registry.get(agent_id)
                if rec is not None:
                    rec.last_seen = self.registry.now()
            await asyncio.sleep(0.05)

    def report(self, agent_id: str, worker_state: WorkerState = WorkerState.IDLE,
               **fields: object) -> None:
        rec = self.registry.get(agent_id)
        assert rec is not None
        report = S.ProgressReport(agent_id=agent_id, job_id=self.job.job_id,
                                  worker_state=worker_state.to_wire(),  # type: ignore[arg-type]
                                  epoch=self.job.epoch, **fields)  # type: ignore[arg-type]
        self.job.on_progress(rec, report)


def config(**kw: object) -> JobConfig:
    train = TrainConfig(global_batch=8, micro_batches=2, steps=5)
    shape = {"stages": 2, "replicas": 2, **kw}
    cfg = JobConfig(model="gpt-tiny", agents=4, train=train, measure_links=False,
                    **shape)  # type: ignore[arg-type]
    cfg.validate()
    return cfg


def run(body: Callable[[Cluster], Awaitable[None]], cfg: JobConfig,
        devices: list[common_pb2.DeviceInfo] | None = None) -> None:
    """Run `body(cluster)` while the cluster's job runs; the job stops afterwards."""
    async def main() -> None:
        c = Cluster(cfg, devices)
        task = asyncio.get_running_loop().create_task(c.job.run())
        beats = asyncio.get_running_loop().create_task(c.heartbeats())
        try:
            await body(c)
        finally:
            task.cancel()
            beats.cancel()
    asyncio.run(main())


async def _until(pred: Callable[[], bool], timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.02)


def test_rank_order_places_agents_in_address_order_and_binds_each_to_its_host() -> None:
    async def body(c: Cluster) -> None:
        got = await c.assignments()
        plan = c.job.plan
        assert plan is not None and plan.placement == "rank-order"
        by_address = sorted(c.ids, key=lambda a: [int(x) for x in
                                                  HOSTS[c.ids.index(a)].split(".")])
        assert [list(row.agent_ids) for row in plan.grid] == [by_address[:2], by_address[2:]]
        rank0_host = HOSTS[c.ids.index(by_address[0])]  # rank 0 = stage 0 of replica 0
        for agent_id, a in got.items():
            assert a.bind_addr == HOSTS[c.ids.index(agent_id)]
            assert a.master_addr == rank0_host
        assert plan.predicted_step_s > 0 and c.job.status().placement == "rank-order"
    run(body, config(placement="rank-order"))


def test_random_placement_is_reproducible_by_seed() -> None:
    grids: list[list[list[str]]] = []

    async def body(c: Cluster) -> None:
        await c.assignments()
        assert c.job.plan is not None and c.job.plan.placement == "random:7"
        grids.append([list(r.agent_ids) for r in c.job.plan.grid])
    run(body, config(placement="random:7"))
    run(body, config(placement="random:7"))
    assert grids[0] == grids[1]


def test_a_pinned_plan_file_names_its_agents(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"grid": [[3, 0], [2, 1]],
                                "agents": ["agent-0", "agent-1", "agent-2", "agent-3"]}))

    async def body(c: Cluster) -> None:
        await c.assignments()
        assert c.job.plan is not None and c.job.plan.placement == f"file:{path}"
        assert [list(r.agent_ids) for r in c.job.plan.grid] == [["agent-3", "agent-0"],
                                                                 ["agent-2", "agent-1"]]
    run(body, config(placement=str(path)))


def test_a_config_error_fails_the_job_at_once() -> None:
    async def body(c: Cluster) -> None:
        await c.assignments()
        c.report(c.ids[1], worker_state=WorkerState.FAILED, error="ValueError: bad layer range",
                 error_kind="config")
        await _until(lambda: c.job.state == S.JOB_STATE_FAILED)
        assert "invalid" in c.job.message and c.job.epoch == 1
    run(body, config(placement="rank-order"))


def test_rendezvous_failing_twice_without_a_step_fails_the_job() -> None:
    async def body(c: Cluster) -> None:
        for epoch in (1, 2):
            await c.assignments()  # a second epoch: once may be a passing fault
            assert c.job.epoch == epoch and c.job.state == S.JOB_STATE_RUNNING
            c.report(c.ids[0], worker_state=WorkerState.FAILED, error_kind="rendezvous",
                     error="RuntimeError: Gloo connectFullMesh failed ... remote=[127.0.0.1]")
        await _until(lambda: c.job.state == S.JOB_STATE_FAILED)
        assert "twice in a row" in c.job.message and "--advertise" in c.job.message
    run(body, config(placement="rank-order", max_restarts=5))


def test_a_peer_failure_is_retried() -> None:
    async def body(c: Cluster) -> None:
        await c.assignments()
        for _ in range(2):
            c.report(c.ids[0], worker_state=WorkerState.FAILED, error_kind="peer",
                     error="peer died")
            await c.assignments()
        assert c.job.epoch == 3 and c.job.state == S.JOB_STATE_RUNNING
    run(body, config(placement="rank-order", max_restarts=5))


def test_step_times_measured_and_predicted_from_reported_compute() -> None:
    async def body(c: Cluster) -> None:
        await c.assignments()
        assert c.job.plan is not None
        comm_only = c.job.plan.predicted_comm_s
        for step in (1, 2, 3):
            for agent_id in c.ids:  # step 1 is warm-up and must not count
                c.report(agent_id, worker_state=WorkerState.TRAINING, step=step,
                         step_s=9.0 if step == 1 else 2.0, compute_s=0.5, loss=3.0)
        status = c.job.status()
        assert status.measured_step_s == pytest.approx(2.0)
        assert status.tokens_per_s == pytest.approx(8 * 64 / 2.0)  # batch x seq / step
        # two micro-batches of 0.25 s each, on top of the communication-only prediction
        assert status.predicted_step_s > comm_only + 0.5
        assert c.job.plan.predicted_compute_s == pytest.approx(0.5)
    run(body, config(placement="rank-order"))


def test_a_links_file_without_the_members_fails_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "links.json"
    path.write_text(json.dumps({"agents": ["x", "y"], "delay_ms": [[0, 1], [1, 0]],
                                "bandwidth_gbps": [[None, 1], [1, None]]}))

    async def body(c: Cluster) -> None:
        await _until(lambda: c.job.state == S.JOB_STATE_FAILED)
        assert "no row for agent" in c.job.message
    run(body, config(links_file=str(path)))


def test_a_replica_near_everyone_owns_more_of_the_gradient_exchange(tmp_path: Path) -> None:
    # one stage, four replicas: agents 0 and 1 are 5 ms apart, agent-2 is 200 ms from both,
    # agent-3 is 60 ms from everyone. A shard owned by 0, 1 or 2 crosses 200 ms twice; one
    # owned by agent-3 crosses 60 ms twice, so agent-3 owns the most
    ms = {(0, 1): 5, (0, 2): 200, (1, 2): 200, (0, 3): 60, (1, 3): 60, (2, 3): 60}
    delay = [[0 if i == j else ms[min(i, j), max(i, j)] for j in range(4)] for i in range(4)]
    bandwidth = [[None if i == j else 1.0 for j in range(4)] for i in range(4)]
    path = tmp_path / "links.json"
    path.write_text(json.dumps({"agents": [f"agent-{i}" for i in range(4)],
                                "delay_ms": delay, "bandwidth_gbps": bandwidth}))

    async def body(c: Cluster) -> None:
        got = await c.assignments()
        shares = {agent: list(a.dp_shares) for agent, a in got.items()}
        group = shares[c.ids[0]]
        assert all(s == group for s in shares.values())  # one stage: one group, one list
        assert sum(group) == pytest.approx(1.0)
        owner = {agent: group[a.replica] for agent, a in got.items()}
        assert owner["agent-3"] > 0.5 > max(v for a, v in owner.items() if a != "agent-3")
        # the plan carries them and `coordinator status` says who owns what
        assert c.job.plan is not None and list(c.job.plan.grid[0].dp_shares) == group
        text = status_to_text(coordinator_pb2.ClusterStatus(job=c.job.status(),
                                                            plan=c.job.plan))
        assert f"agent-3 ({owner['agent-3']:.0%} of gradients)" in text, text
    run(body, config(stages=1, replicas=4, links_file=str(path)))


def _devices(flops: list[float], memory: list[int] | None = None) -> list[common_pb2.DeviceInfo]:
    return [common_pb2.DeviceInfo(kind="cpu", flops=f, memory_bytes=m)
            for f, m in zip(flops, memory or [0] * len(flops), strict=True)]


def test_faster_agents_get_more_layers() -> None:
    async def body(c: Cluster) -> None:
        got = await c.assignments()
        layers = {a: x.layer_end - x.layer_begin for a, x in got.items()}
        fast, slow = {layers[c.ids[0]], layers[c.ids[1]]}, {layers[c.ids[2]], layers[c.ids[3]]}
        assert len(fast) == len(slow) == 1 and fast.pop() > slow.pop(), layers
        assert c.job.plan is not None and sorted(c.job.plan.layer_splits) == [1, 3]
        assert list(got[c.ids[0]].layer_splits) == list(c.job.plan.layer_splits)
        fast_stage = got[c.ids[0]].stage
        assert got[c.ids[1]].stage == fast_stage and got[c.ids[2]].stage != fast_stage
    run(body, config(search_seconds=0.3), _devices([2e10, 2e10, 1e10, 1e10]))


def test_even_split_when_asked_or_when_devices_are_alike() -> None:
    async def body(c: Cluster) -> None:
        got = await c.assignments()
        assert {x.layer_end - x.layer_begin for x in got.values()} == {2}
    run(body, config(search_seconds=0.3, layer_split="even"),
        _devices([2e10, 2e10, 1e10, 1e10]))
    run(body, config(placement="rank-order"), _devices([1.1e10, 1e10, 1.05e10, 1e10]))


def test_a_stage_too_big_for_an_agents_memory_fails_the_job_with_the_numbers() -> None:
    async def body(c: Cluster) -> None:
        await _until(lambda: c.job.state == S.JOB_STATE_FAILED)
        msg = c.job.message
        assert "does not fit" in msg and "agent-2" in msg and "100000 bytes" in msg, msg
        assert re.search(r"needs [\d.]+ GiB \((\d+) bytes\)", msg), msg
        assert "short" in msg and c.job.epoch == 0
    run(body, config(placement="rank-order"),
        _devices([1e10] * 4, [2**34, 2**34, 100_000, 2**34]))


def test_only_members_reports_count() -> None:
    """An agent outside the plan cannot fail the job or finish it, even with its id and epoch."""
    async def body(c: Cluster) -> None:
        await c.assignments()
        outsider = c.registry.join(common_pb2.AgentInfo(
            agent_id="outsider", host="10.0.0.99", port=7071,
            device=common_pb2.DeviceInfo(kind="cpu", flops=1e10)))
        c.report(outsider.agent_id, worker_state=WorkerState.FAILED, error="forged")
        for agent_id in c.ids:
            c.report(agent_id, worker_state=WorkerState.DONE, step=5)
        await _until(lambda: c.job.state == S.JOB_STATE_DONE)
        assert c.job.restarts == 0 and "outsider" not in c.job.members
    run(body, config(placement="rank-order"))


def test_a_recovering_job_keeps_the_split_its_checkpoints_hold(tmp_path: Path) -> None:
    # epoch 1 sees alike devices (even split); by epoch 2 two agents measure twice as fast,
    # but the checkpoints hold 2 + 2 layers, so a 3 + 1 split could not resume from them
    async def body(c: Cluster) -> None:
        first = await c.assignments()
        assert {x.layer_end - x.layer_begin for x in first.values()} == {2}
        for agent_id in c.ids[:2]:
            rec = c.registry.get(agent_id)
            assert rec is not None
            rec.info.device.flops = 2e10
        c.report(c.ids[3], worker_state=WorkerState.FAILED, error_kind="peer", error="peer died")
        second = await c.assignments()
        assert c.job.epoch == 2
        assert {x.layer_end - x.layer_begin for x in second.values()} == {2}
    cfg = config(search_seconds=0.3, max_restarts=3)
    cfg.train.checkpoint_dir = str(tmp_path)
    run(body, cfg)
