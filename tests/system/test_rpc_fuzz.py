"""Malformed and random messages at every RPC: refused with a reason, never a crash."""

from __future__ import annotations

import asyncio
import math
import random

import grpc
import pytest

from protos.dtfm.v1 import agent_pb2, common_pb2, coordinator_pb2
from tests.daemons import Daemons, wait_for
from tests.system.test_security import _call_raw, _methods

pytestmark = pytest.mark.timeout(180)
ACCEPTABLE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED}


def _malformed() -> list[tuple[str, bytes, grpc.StatusCode]]:
    """Well-formed protobuf that breaks a rule, with the code it must get."""
    good = common_pb2.AgentInfo(agent_id="fuzz-1", host="127.0.0.1", port=9,
                                device=common_pb2.DeviceInfo(kind="cpu"))
    cases = []
    for field, value in (("agent_id", ""), ("agent_id", "bad id!"), ("host", ""),
                         ("host", "a b"), ("port", 0), ("port", 70000)):
        info = common_pb2.AgentInfo()
        info.CopyFrom(good)
        setattr(info, field, value)
        cases.append(("/dtfm.v1.Coordinator/Join",
                      coordinator_pb2.JoinRequest(agent=info).SerializeToString(),
                      grpc.StatusCode.INVALID_ARGUMENT))
    bad_kind = common_pb2.AgentInfo()
    bad_kind.CopyFrom(good)
    bad_kind.device.kind = "tpu"
    cases.append(("/dtfm.v1.Coordinator/Join",
                  coordinator_pb2.JoinRequest(agent=bad_kind).SerializeToString(),
                  grpc.StatusCode.INVALID_ARGUMENT))
    dancing = max(common_pb2.WorkerState.values()) + 1  # no such state (proto3 enums are open)
    cases.append(("/dtfm.v1.Coordinator/ReportProgress", coordinator_pb2.ProgressReport(
        agent_id="x", worker_state=dancing).SerializeToString(),  # type: ignore[arg-type]
        grpc.StatusCode.INVALID_ARGUMENT))
    cases.append(("/dtfm.v1.Coordinator/ReportProgress", coordinator_pb2.ProgressReport(
        agent_id="x", loss=math.nan).SerializeToString(), grpc.StatusCode.INVALID_ARGUMENT))
    cases.append(("/dtfm.v1.Coordinator/ReportProgress", coordinator_pb2.ProgressReport(
        agent_id="never-joined").SerializeToString(), grpc.StatusCode.FAILED_PRECONDITION))
    cases.append(("/dtfm.v1.Coordinator/MeasureLinks", coordinator_pb2.MeasureRequest(
        timeout_s=-1).SerializeToString(), grpc.StatusCode.INVALID_ARGUMENT))
    for spread in (-1.0, math.nan, 3600.0):  # a latency pass held for an hour, or NaN
        cases.append(("/dtfm.v1.Coordinator/MeasureLinks", coordinator_pb2.MeasureRequest(
            ping_spread_s=spread).SerializeToString(), grpc.StatusCode.INVALID_ARGUMENT))
    cases.append(("/dtfm.v1.Coordinator/ReportLinks", coordinator_pb2.LinkReport(
        agent_id="ghost").SerializeToString(), grpc.StatusCode.FAILED_PRECONDITION))
    cases.append(("/dtfm.v1.Coordinator/GetPlan", b"", grpc.StatusCode.FAILED_PRECONDITION))
    cases.append(("/dtfm.v1.Coordinator/GetStatus", b"\xff\xff\xff",
                  grpc.StatusCode.INVALID_ARGUMENT))
    return cases


def test_malformed_and_random_messages_are_refused_and_daemons_keep_serving(
        daemons: Daemons) -> None:
    _, address = daemons.coordinator()
    daemons.agent(address, "agent-0")
    agent = wait_for(lambda: daemons.agents_in(address, "alive"), 30, "the agent")[0]
    auth = (("authorization", f"Bearer {daemons.token}"),)
    rng = random.Random(1234)
    targets = [(address, _methods(coordinator_pb2, "Coordinator")),
               (agent["address"], _methods(agent_pb2, "Agent"))]

    async def fuzz() -> list[tuple[str, grpc.StatusCode]]:
        seen = []
        for method, payload, want in _malformed():
            code = await _call_raw(address, method, False, method.endswith("/Join"), payload,
                                   auth)
            assert code == want, (method, payload, code)
        for target, methods in targets:
            for method, cs, ss in methods:
                for _ in range(25):
                    payload = rng.randbytes(rng.choice([1, 3, 16, 64, 512]))
                    code = await _call_raw(target, method, cs, ss, payload, auth)
                    assert code in ACCEPTABLE, (method, payload, code)
                    seen.append((method, code))
        return seen

    seen = asyncio.run(fuzz())
    assert any(code == grpc.StatusCode.INVALID_ARGUMENT for _, code in seen)
    status = daemons.status(address)
    assert [a["id"] for a in status["agents"] if a["state"] == "alive"] == [agent["id"]]
    reply = daemons.cli("agent", "status", "--agent", agent["address"], "--json")
    assert reply.returncode == 0, reply.stderr
