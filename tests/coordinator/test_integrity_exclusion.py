"""A confirmed fault's consequences (issue 43, item 7).

First on the daemon's own `CoordinatorService` on a real gRPC server (loopback, the token
required) with a state directory: an agent joins through the real Join call, a confirmed
fault excludes it, and then its heartbeat and its re-join are refused saying how to admit it,
`coordinator status` (JSON and text) and the metrics show it, a restarted coordinator on the
same state directory still refuses it, and `coordinator admit` (the Admit call) lets it join.
Then the job state machine (the fake registry and agents of test_job_states): a member
excluded mid-run is left out of the next epoch, which shrinks within --min-agents and
resumes before the first step proven bad, until it writes a checkpoint of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest

from coordinator.cli import build_parser
from coordinator.commands.admit import admit
from coordinator.commands.status import status_to_json, status_to_text
from coordinator.daemon.metrics import coordinator_registry
from dtfm import rpc
from dtfm.core.workerstate import WorkerState
from protos.dtfm.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.agent.test_checkpoint_transfer import SECURITY
from tests.coordinator.test_checkpoint_copies import coordinator
from tests.coordinator.test_job_churn import churn_config, report_all
from tests.coordinator.test_job_states import Harness, run, until

pytestmark = pytest.mark.timeout(60)
S = coordinator_pb2


async def join(stub: coordinator_pb2_grpc.CoordinatorStub, agent_id: str
               ) -> tuple[grpc.aio.UnaryStreamCall, str]:
    """Join as `agent_id` (reachable by the operator's word: nothing dials it); the call and
    the secret of its Welcome."""
    call = stub.Join(coordinator_pb2.JoinRequest(agent=common_pb2.AgentInfo(
        agent_id=agent_id, host="127.0.0.1", port=9, device=common_pb2.DeviceInfo(kind="cpu"),
        reachable=common_pb2.REACH_OVERRIDE_YES)))
    async for command in call:
        if command.HasField("welcome"):
            return call, command.welcome.agent_secret
    raise AssertionError("no welcome")


async def refused(coro: object) -> str:
    """The details of the PERMISSION_DENIED that `coro` (a call) ends in."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        result = await coro  # type: ignore[misc]
        if isinstance(result, grpc.aio.UnaryStreamCall):
            async for _ in result:
                pass
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value
    return str(info.value.details())


def test_an_excluded_agent_is_shown_refused_kept_out_across_a_restart_and_admitted(
        tmp_path: Path) -> None:
    async def main() -> None:
        async with coordinator(tmp_path) as (target, svc), \
                rpc.open_channel(target, SECURITY) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            call, secret = await join(stub, "bad")
            await join(stub, "good")
            ledger = svc.job.integrity.ledger
            assert not ledger.record("good", "dial_vote", detail="a lone refusal",
                                     reporter="bad")
            assert ledger.record("bad", "weight_digest", 42, "odd one out of 3 replicas",
                                 reporter="good", confirmed=True)
            status = await stub.GetStatus(coordinator_pb2.StatusRequest())
            data = status_to_json(status)
            rows = {a["id"]: a for a in data["agents"]}
            x = rows["bad"]["exclusion"]
            assert rows["bad"]["state"] == "excluded" and x["step"] == 42
            assert "odd one out" in x["reason"] and x["evidence"][0]["kind"] == "weight_digest"
            assert rows["good"]["state"] == "alive" and rows["good"]["exclusion"] is None
            assert rows["good"]["evidence"][0]["kind"] == "dial_vote"  # shown, not excluded
            assert data["job"]["exclusions"] == 1 and data["job"]["rollback_before"] == 42
            text = status_to_text(status)
            assert "bad: EXCLUDED from step 42" in text and "coordinator admit bad" in text
            assert "good: 1 piece(s) of evidence, not excluded" in text
            scrape = generate_latest(coordinator_registry(svc.registry, svc.job, svc.links))
            assert b'dtfm_integrity_exclusions_total{job_id="' in scrape
            assert b'dtfm_integrity_evidence{kind="weight_digest"} 1.0' in scrape
            assert b'dtfm_integrity_disputes{done="pending",job_id="' in scrape  # none
            why = await refused(stub.ReportProgress(coordinator_pb2.ProgressReport(
                agent_id="bad", agent_secret=secret)))
            assert "coordinator admit bad" in why
            assert "coordinator admit bad" in await refused(join(stub, "bad"))
            with contextlib.suppress(grpc.aio.AioRpcError):  # its stream was ended
                async for _ in call:
                    pass
        async with coordinator(tmp_path) as (target, svc), \
                rpc.open_channel(target, SECURITY) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            assert "coordinator admit bad" in await refused(join(stub, "bad"))
            assert svc.job.integrity.ledger.evidence("good")  # the evidence outlived it
            rows = {a["id"]: a for a in status_to_json(
                await stub.GetStatus(coordinator_pb2.StatusRequest()))["agents"]}
            assert rows["bad"]["state"] == "excluded" and rows["bad"]["exclusion"]["step"] == 42
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Admit(coordinator_pb2.AdmitRequest(agent_id="good"))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            token = tmp_path / "token"
            token.write_text(SECURITY.token)
            token.chmod(0o600)
            parser, _ = build_parser()  # `coordinator admit bad`, as an operator types it
            assert await admit(parser.parse_args(["admit", "bad", "--coordinator", target,
                                                  "--token-file", str(token)])) == 0
            await join(stub, "bad")  # welcome again
            assert svc.job.integrity.ledger.excluded("bad") is None

    asyncio.run(main())


def excluding(h: Harness) -> None:
    """Give the fake registry `exclude` as the real one does it: the row is excluded, and a
    live one is lost to the job (`Registry.exclude`)."""
    def exclude(agent_id: str, reason: str) -> None:
        agent = h.registry.agents[agent_id]
        agent.why = reason  # type: ignore[attr-defined]
        alive = h.registry.states[agent_id] == S.AGENT_STATE_ALIVE
        h.registry.states[agent_id] = S.AGENT_STATE_EXCLUDED
        if alive:
            h.job.on_lost([agent])  # type: ignore[list-item]
    h.registry.exclude = exclude  # type: ignore[attr-defined]


def test_a_member_excluded_mid_run_is_replanned_without_and_rolled_back_before_the_bad_step(
        ) -> None:
    async def body(h: Harness) -> None:
        excluding(h)
        await h.running_epoch(1)
        report_all(h, 10)  # every member passed the checkpoint of step 8
        await until(lambda: h.job.checkpoint_step == 8)
        victim = h.job.members[2]
        h.job.integrity.ledger.record(victim, "gradient_outlier", 6, "norm 10x the median",
                                      reporter=h.job.members[0], confirmed=True)
        assert h.registry.agents[victim].kinds()[-1] == "stop"  # its worker stops at once
        await h.running_epoch(2)
        assert victim not in h.job.members and len(h.job.members) == 4  # shrunk to 2x2
        assigned = [h.registry.agents[a].assignments()[-1] for a in h.job.members]
        assert {a.resume_before for a in assigned} == {6}  # never from step 8: after 6
        assert h.job.checkpoint_step == 4
        rec = h.job.recoveries.items[-1]
        assert victim in rec.reason and "excluded" in rec.reason
        report_all(h, 5)  # resumed after step 4
        assert h.job.status().rollback_before == 6
        report_all(h, 9)  # the epoch's own checkpoint of step 8: the bound is lifted
        await until(lambda: h.job.status().rollback_before == 0)
        for a in h.job.members:
            h.report(a, WorkerState.TRAINING, step=9)

    run(churn_config(min_agents=4), body, agents=6)


def test_the_known_good_checkpoint_waits_for_every_members_evidence() -> None:
    """In a fast job a member's integrity records reach the coordinator a heartbeat after
    its steps. Vetted from the furthest step reported, the checkpoint of step 20 was called
    good at step 30 while records proving a fault at step 13 were still on their way: the
    agents let step 12 go, and the rollback found nothing before the bad step but step 0."""
    async def body(h: Harness) -> None:
        excluding(h)
        await h.running_epoch(1)
        late, *rest = h.job.members
        for a in rest:
            h.report(a, WorkerState.TRAINING, step=30, integrity_through=30)
        assert h.job.checkpoint_floor() == 1  # `late` has not reported: keep every step
        h.report(late, WorkerState.TRAINING, step=30, integrity_through=15)
        assert h.job.checkpoint_floor() == 4  # 10 steps before 15, not before 30
        h.job.integrity.ledger.record(rest[0], "gradient_outlier", 13, "norm 10x the median",
                                      reporter=late, confirmed=True)
        assert h.job.checkpoint_floor() == 12  # what the rollback resumes from is kept
        await h.running_epoch(2)
        assigned = [h.registry.agents[a].assignments()[-1] for a in h.job.members]
        assert {a.resume_before for a in assigned} == {13}

    run(churn_config(min_agents=4), body, agents=6)
