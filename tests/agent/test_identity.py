"""One identity per agent: the secret issued at Join guards the id, its stream and its reports."""

from __future__ import annotations

import asyncio
import shutil
import stat
from pathlib import Path
from typing import Any

import grpc
import pytest

from protos.dtfm.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.daemons import Daemons, wait_for

pytestmark = pytest.mark.timeout(180)

CLASH = "a second agent uses the id"


def _secret(state_dir: Path) -> str:
    return (state_dir / "agent-secret").read_text().strip()


def _alive_ids(daemons: Daemons, address: str) -> set[str]:
    return {a["id"] for a in daemons.agents_in(address, "alive")}


def _info(agent_id: str) -> common_pb2.AgentInfo:
    return common_pb2.AgentInfo(agent_id=agent_id, host="127.0.0.1", port=9,
                                device=common_pb2.DeviceInfo(kind="cpu"))


def test_a_copied_agent_id_is_refused_and_the_live_agent_kept(daemons: Daemons) -> None:
    _, address = daemons.coordinator()
    original = daemons.agent(address, "agent-0")
    agent_id = wait_for(lambda: _alive_ids(daemons, address), 30, "the agent")
    state = daemons.tmp / "agent-0"
    secret = wait_for(lambda: (state / "agent-secret").exists() and _secret(state), 10, "secret")
    assert len(secret) == 64 and int(secret, 16) >= 0
    assert stat.S_IMODE((state / "agent-secret").stat().st_mode) == 0o600
    # A cloned VM that kept the id but not the secret: refused, and says what to do.
    (daemons.tmp / "clone").mkdir(mode=0o700)
    shutil.copy(state / "agent-id", daemons.tmp / "clone" / "agent-id")
    clone = daemons.agent(address, "clone")
    assert clone.wait(timeout=30) == 2
    assert CLASH in daemons.log(clone) and "delete the agent-id" in daemons.log(clone)
    assert original.poll() is None and _alive_ids(daemons, address) == agent_id
    assert _secret(state) == secret, "the live agent was made to re-join"
    # A copy with the secret too: the later Join holds the id, the earlier agent is refused.
    shutil.copytree(state, daemons.tmp / "copy", ignore=shutil.ignore_patterns("work"))
    copy = daemons.agent(address, "copy")
    assert original.wait(timeout=30) == 2 and CLASH in daemons.log(original)
    assert copy.poll() is None and _alive_ids(daemons, address) == agent_id


async def until_eof(call: Any) -> list[Any]:
    """What a server stream still sends before it ends."""
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


def test_reports_need_the_agents_secret(daemons: Daemons) -> None:
    _, address = daemons.coordinator()
    metadata = (("authorization", f"Bearer {daemons.token}"),)

    async def check() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            first = stub.Join(coordinator_pb2.JoinRequest(agent=_info("raw-1")),
                              metadata=metadata)
            s1 = (await first.read()).welcome.agent_secret
            for secret in ("", "0" * 64):
                for call in (stub.ReportProgress(coordinator_pb2.ProgressReport(
                                 agent_id="raw-1", worker_state=common_pb2.WORKER_STATE_DONE,
                                 agent_secret=secret), metadata=metadata, timeout=10),
                             stub.ReportLinks(coordinator_pb2.LinkReport(
                                 agent_id="raw-1", round_id="r", agent_secret=secret),
                                 metadata=metadata, timeout=10),
                             stub.Leave(coordinator_pb2.LeaveRequest(
                                 agent_id="raw-1", agent_secret=secret),
                                 metadata=metadata, timeout=10)):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call
                    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            await stub.ReportProgress(coordinator_pb2.ProgressReport(
                agent_id="raw-1", worker_state=common_pb2.WORKER_STATE_IDLE, agent_secret=s1),
                metadata=metadata, timeout=10)
            # The same agent re-joining ends its old stream and gets a fresh secret.
            second = stub.Join(coordinator_pb2.JoinRequest(agent=_info("raw-1"),
                                                           agent_secret=s1), metadata=metadata)
            s2 = (await second.read()).welcome.agent_secret
            assert s2 and s2 != s1
            # the old stream ends; before that it may carry the dial-back's verdict (reach)
            leftover = await asyncio.wait_for(until_eof(first), 10)
            assert all(m.WhichOneof("kind") == "reach" for m in leftover), leftover
            stale = stub.Join(coordinator_pb2.JoinRequest(agent=_info("raw-1"),
                                                          agent_secret=s1), metadata=metadata)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stale.read()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert CLASH in (err.value.details() or "")
            second.cancel()

    asyncio.run(check())


def test_a_restarted_coordinator_accepts_and_reissues(daemons: Daemons) -> None:
    coordinator, address = daemons.coordinator()
    daemons.agent(address, "agent-0")
    wait_for(lambda: _alive_ids(daemons, address), 30, "the agent")
    state = daemons.tmp / "agent-0"
    before = wait_for(lambda: (state / "agent-secret").exists() and _secret(state), 10, "secret")
    coordinator.terminate()
    coordinator.wait(timeout=20)
    daemons.coordinator(port=int(address.rsplit(":", 1)[1]))
    wait_for(lambda: _alive_ids(daemons, address), 60, "the agent to re-join")
    wait_for(lambda: _secret(state) != before, 10, "a re-issued secret")
