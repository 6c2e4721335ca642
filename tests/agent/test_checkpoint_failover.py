"""The agent holding the only local copy of a stage dies: the stage comes from its peer copy.

Two agents run a 2-stage, 1-replica job with checkpoints in their own state directories (no
shared storage); the assignments come from `build_assignments(members=...)`, so each agent
mirrors the other's stage. The agent of stage 1 then dies with its disk, a new agent with an
empty state directory takes stage 1, and its worker resumes from the step the surviving
agent mirrored: the new agent fetched it over gRPC before its worker started.

Each agent is the daemon's own parts in this process (its `AgentService` on a loopback port
with the token, a `Supervisor` with a `CheckpointCopier`); the workers are real processes
training gpt-tiny over gloo, reaped by the supervisor (and killed with it on any failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.daemon.server import AgentService, registrar
from agent.daemon.statedir import checkpoint_dir
from agent.daemon.supervisor import Supervisor
from dtfm import rpc
from dtfm.checkpoints.copies import CheckpointCopier, CheckpointStore
from dtfm.core import checkpoints as ondisk
from dtfm.core.assignment import build_assignments
from dtfm.core.layout import Layout
from dtfm.core.presets import get_preset
from dtfm.core.spec import TrainConfig
from dtfm.core.workerstate import WorkerState
from protos.dtfm.v1 import common_pb2
from tests.daemons import TOKEN

JOB = "job-failover"
SECURITY = rpc.Security(token=TOKEN)


@dataclass
class Agent:
    address: str
    state: Path
    supervisor: Supervisor

    @property
    def member(self) -> tuple[str, int]:
        host, port = self.address.rsplit(":", 1)
        return host, int(port)

    def holds(self, stage: int) -> list[int]:
        """Steps of `stage` this agent holds intact."""
        root = ondisk.job_dir(checkpoint_dir(self.state), JOB)
        return [s for s in ondisk.steps_available(root, stage)
                if ondisk.verify(root, stage, s, job_id=JOB) is None]

    def worker_steps(self, a: common_pb2.Assignment) -> list[int]:
        path = self.state / "work" / f"{a.job_id}-e{a.epoch}-r{a.rank}.progress.jsonl"
        events = [json.loads(line) for line in path.read_text().splitlines()]
        return [e["step"] for e in events if e["event"] == "step"]

    def worker_log(self, a: common_pb2.Assignment) -> str:
        return (self.state / "work" / f"{a.job_id}-e{a.epoch}-r{a.rank}.log").read_text()


@contextlib.asynccontextmanager
async def agent(state: Path) -> AsyncIterator[Agent]:
    """One agent's server and supervisor; its worker is stopped on the way out."""
    root = checkpoint_dir(state)
    service = AgentService(common_pb2.AgentInfo(agent_id=state.name, host="127.0.0.1"),
                           CheckpointStore(root))
    server, port, _ = await rpc.start_server("127.0.0.1:0", SECURITY, registrar(service),
                                             state.name)
    supervisor = Supervisor(state / "work", checkpoints=CheckpointCopier(
        root, SECURITY, budget_s=60, mirror_interval_s=0.2))
    try:
        yield Agent(f"127.0.0.1:{port}", state, supervisor)
    finally:
        await supervisor.stop("test over")
        await server.stop(0)


def assignments(epoch: int, steps: int, members: list[Agent]) -> list[common_pb2.Assignment]:
    train = TrainConfig(global_batch=2, micro_batches=1, steps=steps, eval_batches=0,
                        checkpoint_every=2)
    return build_assignments(job_id=JOB, epoch=epoch, layout=Layout(2, 1),
                             spec=get_preset("gpt-tiny"), train=train,
                             master_addr="127.0.0.1", master_port=rpc.free_port(),
                             members=[a.member for a in members])


async def run_job(agents: list[Agent], orders: list[common_pb2.Assignment]) -> None:
    for a, order in zip(agents, orders, strict=True):
        await a.supervisor.start(order)

    def ended() -> bool:
        return all(a.supervisor.progress.state in (WorkerState.DONE, WorkerState.FAILED)
                   for a in agents)

    while not ended():
        await asyncio.sleep(0.2)
    for a, order in zip(agents, orders, strict=True):
        assert a.supervisor.progress.state == WorkerState.DONE, (
            a.supervisor.progress.error, a.worker_log(order))


async def eventually(check: object, what: str, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


@pytest.mark.timeout(240)
def test_the_only_holder_of_a_stage_dies_and_its_mirror_copy_resumes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("DTFM_NUM_THREADS", "1")
    monkeypatch.setenv("DTFM_TIMEOUT_S", "60")

    async def main() -> None:
        async with agent(tmp_path / "a") as a:
            async with agent(tmp_path / "b") as b:
                first = assignments(0, 4, [a, b])
                # one replica per stage: each agent mirrors the other's stage
                assert [(m.stage, m.peer) for m in first[0].mirrors] == [(1, b.address)]
                assert [(m.stage, m.peer) for m in first[1].mirrors] == [(0, a.address)]
                assert list(first[1].checkpoint_peers) == [a.address]
                await run_job([a, b], first)
                await eventually(lambda: a.holds(1) == [2, 4] and b.holds(0) == [2, 4],
                                 "each stage's steps 2 and 4 mirrored by the other agent")
            shutil.rmtree(b.state)  # agent b is gone, and its disk with it
            async with agent(tmp_path / "c") as c:
                assert c.holds(1) == []
                second = assignments(1, 6, [a, c])
                await run_job([a, c], second)
                assert c.holds(1) == [4, 6]  # fetched 2 and 4, trained on to 6, pruned to 2
                for who, order in ((a, second[0]), (c, second[1])):
                    assert who.worker_steps(order) == [5, 6], who.worker_log(order)
                    assert "resumed at step 4" in who.worker_log(order)

    with caplog.at_level("INFO", logger="dtfm.checkpoints.copies"):
        asyncio.run(main())
    assert "copied stage 1 step 4 of job job-failover from 127.0.0.1:" in caplog.text
    assert "fetching steps [2, 4] before the worker starts" in caplog.text
