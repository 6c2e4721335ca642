"""Hostile input at the coordinator: bounded fields, real addresses, a registry that forgets.

Every over-long string, over-long list, bad address or non-finite number is refused with
INVALID_ARGUMENT and a message; agents gone for longer than --evict-after leave the registry;
GetStatus fits a gRPC message at any number of agents.
"""

from __future__ import annotations

import asyncio
import json
import math

import grpc
import pytest

from coordinator.daemon.registry import LOST, Registry
from coordinator.daemon.validate import validate_agent_info
from dtfm.core.limits import MAX_AGENTS, MAX_STATUS_AGENTS, OMITTED_METADATA, clip, is_host
from dtfm.rpc import MAX_MESSAGE_BYTES
from protos.dtfm.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.daemons import Daemons, wait_for

pytestmark = pytest.mark.timeout(180)


def _info(agent_id: str = "limits-1", host: str = "127.0.0.1", **device: object
          ) -> common_pb2.AgentInfo:
    return common_pb2.AgentInfo(agent_id=agent_id, host=host, port=9, version="0.1.0",
                                device=common_pb2.DeviceInfo(kind="cpu", **device))


def _bad_joins() -> list[tuple[common_pb2.AgentInfo, str]]:
    return [
        (_info(host="127.0.0.1\x00evil"), "host"),
        (_info(host="256.256.256.256"), "host"),
        (_info(host="a" * 300), "host"),
        (_info(host="-dash-.example.org"), "host"),
        (_info(host="under_score.example"), "host"),
        (_info(agent_id="x" * 100_000), "agent_id"),
        (_info(name="n" * 10_000), "device name"),
        (_info(name="cpu\x07"), "device name"),
        (_info(flops=math.nan), "flops"),
        (common_pb2.AgentInfo(agent_id="v-1", host="h1", port=9, version="v" * 300,
                              device=common_pb2.DeviceInfo(kind="cpu")), "version"),
    ]


def _bad_reports() -> list[tuple[str, object, str]]:
    progress = coordinator_pb2.ProgressReport
    links = coordinator_pb2.LinkReport
    sample = common_pb2.LinkSample
    tuning = common_pb2.TuningAdvice
    many = [sample(peer_id=f"p{i}", reachable=True) for i in range(MAX_AGENTS + 1)]
    return [
        ("ReportProgress", progress(agent_id="limits-ok", error="e" * 100_000), "error"),
        ("ReportProgress", progress(agent_id="limits-ok", job_id="j" * 1000), "job_id"),
        ("ReportProgress", progress(agent_id="limits-ok", error_kind="k" * 100), "error_kind"),
        ("ReportProgress", progress(agent_id="limits-ok", step_s=math.inf), "step_s"),
        ("ReportProgress", progress(agent_id="limits-ok", tuning=[tuning(setting="s")] * 17),
         "tuning"),
        ("ReportProgress", progress(agent_id="limits-ok", tuning=[tuning(why="w" * 10**5)]),
         "why"),
        ("ReportProgress", progress(agent_id="limits-ok", tuning=[tuning(current="\x07")]),
         "current"),
        ("ReportProgress", progress(agent_id="y" * 1_000_000), "agent_id"),
        ("ReportProgress", progress(agent_id="limits-ok", agent_secret="s" * 10**5),
         "agent_secret"),
        ("ReportLinks", links(agent_id="limits-ok", samples=many), "samples"),
        ("ReportLinks", links(agent_id="limits-ok", round_id="r" * 1000), "round_id"),
        ("ReportLinks", links(agent_id="limits-ok", samples=[sample(peer_id="bad peer!")]),
         "peer_id"),
        ("ReportLinks", links(agent_id="limits-ok",
                              samples=[sample(peer_id="p", error="x" * 10**5)]), "error"),
        ("ReportLinks", links(agent_id="limits-ok", samples=[
            sample(peer_id="p", estimated=True, estimate_note="n" * 10**5)]), "estimate_note"),
    ]


def test_oversized_and_malformed_fields_are_refused(daemons: Daemons) -> None:
    _, address = daemons.coordinator()
    metadata = (("authorization", f"Bearer {daemons.token}"),)

    async def check() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            for host in ("gpu-box-1.example.org", "::1", "localhost", "10.0.0.7"):
                info = _info(agent_id=f"ok-{len(host)}", host=host)
                welcome = await _joinm(stub, info, metadata)
                assert welcome.HasField("welcome"), host
            await _joinm(stub, _info(agent_id="limits-ok"), metadata)
            for info, what in _bad_joins():
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _joinm(stub, info, metadata)
                _assert_refused(err.value, what)
            for method, request, what in _bad_reports():
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await getattr(stub, method)(request, metadata=metadata, timeout=10)
                _assert_refused(err.value, what)

    asyncio.run(check())
    status = daemons.status(address)
    assert {a["id"] for a in status["agents"]} == {"ok-21", "ok-3", "ok-9", "ok-8", "limits-ok"}


async def _joinm(stub: coordinator_pb2_grpc.CoordinatorStub, info: common_pb2.AgentInfo,
                 metadata: tuple[tuple[str, str], ...]) -> coordinator_pb2.Command:
    """Join, read the Welcome, hang up (the agent then goes lost like a crashed one)."""
    call = stub.Join(coordinator_pb2.JoinRequest(agent=info), metadata=metadata, timeout=10)
    try:
        async for command in call:
            return command
    finally:
        call.cancel()
    raise AssertionError("no welcome")


def _assert_refused(exc: grpc.aio.AioRpcError, what: str) -> None:
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, exc.code(), exc.details())
    details = exc.details() or ""
    assert what in details, (what, details)
    assert len(details) < 500, f"the refusal echoes the input back ({len(details)} chars)"


def test_status_is_capped_and_departed_agents_are_evicted(daemons: Daemons) -> None:
    joins = MAX_STATUS_AGENTS + 44
    # liveness 3 s, heartbeat 0.5 s; eviction 12 s later, so that the two CLI calls below see
    # every row even when each takes seconds to start on a busy machine
    _, address = daemons.coordinator("--evict-after", "12")
    metadata = (("authorization", f"Bearer {daemons.token}"),)

    async def flood() -> tuple[int, int, int]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            for i in range(joins):
                host = f"{'h' * 60}.{'a' * 60}.{'b' * 60}.node{i}.example"
                await _joinm(stub, _info(agent_id=f"churn-{i:05d}", host=host,
                                         name="n" * 200), metadata)
            call = stub.GetStatus(coordinator_pb2.StatusRequest(), metadata=metadata, timeout=10)
            status = await call
            trailers = dict(await call.trailing_metadata())
            return len(status.agents), int(trailers.get(OMITTED_METADATA, 0)), status.ByteSize()

    rows, omitted, size = asyncio.run(flood())
    assert (rows, omitted) == (MAX_STATUS_AGENTS, joins - MAX_STATUS_AGENTS)
    assert size < MAX_MESSAGE_BYTES
    out = daemons.cli("coordinator", "status", "--coordinator", address, "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert len(data["agents"]) + data["agents_omitted"] == joins
    text = daemons.cli("coordinator", "status", "--coordinator", address)
    assert "more agents not shown" in text.stdout, text.stdout
    wait_for(lambda: not daemons.status(address)["agents"], 60,
             "lost agents to be evicted after --evict-after")


def test_registry_evicts_by_time_and_ranks_status_rows() -> None:
    now = [1000.0]
    registry = Registry(liveness_timeout_s=5, clock=lambda: now[0], evict_after_s=60)

    async def run() -> None:
        secret = [registry.join(_info(agent_id=f"a{i}")).secret for i in range(4)][3]
        now[0] += 10
        registry.join(_info(agent_id="a3"), secret)  # a re-join keeps a3 alive
        assert {r.agent_id for r in registry.sweep()} == {"a0", "a1", "a2"}
        rows, omitted = registry.status_rows(2)
        assert omitted == 2 and rows[-1].agent_id == "a3"  # alive first, join order kept
        now[0] += 45
        assert registry.evict() == []  # silent 55 s: not yet past --evict-after 60
        now[0] += 10
        assert registry.evict() == ["a0", "a1", "a2"]
        assert [r.agent_id for r in registry.all()] == ["a3"]
        assert registry.get("a3") is not None and registry.get("a3").state != LOST

    asyncio.run(run())


def test_host_rules_and_clipping() -> None:
    for host in ("127.0.0.1", "::1", "fe80::1", "gpu-1", "gpu-1.example.org.", "a" * 63):
        assert is_host(host), host
    for host in ("", "127.0.0.1\x00evil", "256.256.256.256", "1.2.3", "a b", "-a", "a-",
                 "a..b", "a" * 64, "under_score", "x." * 127 + "x", "[::1]"):
        assert not is_host(host), host
    assert validate_agent_info(_info()) is None
    assert "host" in (validate_agent_info(_info(host="256.256.256.256")) or "")
    long = "line\n" * 5000
    assert len(clip(long)) <= 4096 and clip(long).endswith("line\n")
