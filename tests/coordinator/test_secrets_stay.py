"""No secret leaves the coordinator in any answer (issue 41, item 1).

Every agent proves its id with the `agent_secret` of its Welcome, and every volunteer holds the
join token: an answer any token holder can read (GetStatus, GetPlan, GetHistory, the copies'
listing, `coordinator status` as JSON or text, `coordinator report`, the metrics, the web
view's JSON) must carry no agent's secret, nor the token. Here a real coordinator (a job
waiting for a third agent) and two real agents heartbeat for a while; then every field of
every answer is walked, recursively over the protobuf, and every output searched, for any
agent's secret.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message

from coordinator.daemon.registry import AgentRecord
from coordinator.job.dataplane import DataPlanes
from dtfm import rpc
from dtfm.core.assignment import build_assignments
from dtfm.core.layout import Layout
from dtfm.core.spec import ModelSpec, TrainConfig
from dtfm.net import reach
from protos.dtfm.v1 import agent_pb2, common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.daemons import Daemons, free_port, wait_for
from tests.system.test_web_access import get

pytestmark = pytest.mark.timeout(180)


def scalars(message: Message, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every set scalar of `message` with its path, through nested messages, repeated fields
    and maps (`ListFields` yields map fields as their entry messages' repeated field)."""
    for field, value in message.ListFields():
        where = f"{path}.{field.name}"
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            items = [(f"{where}[{k!r}]", v) for k, v in value.items()]
            items += [(f"{where} key {k!r}", k) for k in value]
        elif field.is_repeated:
            items = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
        else:
            items = [(where, value)]
        for at, v in items:
            if isinstance(v, Message):
                yield from scalars(v, at)
            else:
                yield at, v


def leaks(message: Message, secrets: dict[str, str]) -> list[str]:
    """Where `message` carries one of `secrets` (name -> value), as text or bytes."""
    found = []
    for where, value in scalars(message):
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        found += [f"{name} at {where}" for name, s in secrets.items() if s in text]
    raw = message.SerializeToString()
    found += [f"{name} in the serialized answer" for name, s in secrets.items()
              if s.encode() in raw]
    return found


def test_the_walk_finds_a_secret_anywhere_in_a_status() -> None:
    """The walk itself: a secret hidden in a nested repeated field or a map is found."""
    status = coordinator_pb2.ClusterStatus(agents=[coordinator_pb2.AgentStatus(
        progress=coordinator_pb2.ProgressReport(agent_secret="s3cr3t",
                                                mirrored_steps={3: 4}))])
    assert leaks(status, {"a": "s3cr3t"}) == ["a at .agents[0].progress.agent_secret",
                                              "a in the serialized answer"]
    assert dict(scalars(status))[".agents[0].progress.mirrored_steps[3]"] == 4


def answers_reach(descriptor: Descriptor, seen: set[str] | None = None) -> set[str]:
    """Every `Message.field` an answer of type `descriptor` can hold, recursively."""
    seen = set() if seen is None else seen
    if descriptor.full_name in seen:
        return set()
    seen.add(descriptor.full_name)
    fields = set()
    for field in descriptor.fields:
        if not descriptor.GetOptions().map_entry:  # a map's own key and value fields
            fields.add(f"{descriptor.name}.{field.name}")
        if field.message_type is not None:
            fields |= answers_reach(field.message_type, seen)
    return fields


def test_no_answer_has_room_for_a_secret_but_the_stripped_one() -> None:
    """The schema of every answer the coordinator gives a token holder: the one field named
    for a secret it can hold is the heartbeat's, which the coordinator clears once checked
    (pinned below with real agents); a data-plane, probe or Welcome secret, or a new field,
    would show up here first."""
    service = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"]
    answers = {m.output_type for m in service.methods if m.name != "Join"}
    assert {a.name for a in answers} >= {"ClusterStatus", "Plan", "JobHistory",
                                          "CheckpointList", "CheckpointChunk"}
    secret_like = {f for a in answers for f in answers_reach(a) if secret_named(f)}
    assert secret_like == {"ProgressReport.agent_secret"}


# "tokens" is not among them: it counts text (`tokens_per_s`)
SECRET_WORDS = {"secret", "secrets", "token", "key", "keys", "password"}


def secret_named(field: str) -> bool:
    """Whether `Message.field` is named for a secret (a plural too: `pair_keys`)."""
    return bool(SECRET_WORDS & set(field.split(".")[1].split("_")))


def test_the_name_check_sees_every_secret_an_assignment_holds() -> None:
    """The schema check above would catch the data plane's secrets in an answer: the epoch's
    secret and the per-pair frame keys (issue 43), which only assignments carry."""
    held = {f for f in answers_reach(common_pb2.Assignment.DESCRIPTOR) if secret_named(f)}
    assert {"DataPlane.secret", "DataPlane.pair_keys"} <= held


def test_each_rank_gets_its_own_pair_keys_and_a_relay_agent_none_of_the_pairs_it_relays(
        caplog: pytest.LogCaptureFixture) -> None:
    """Frame keys (issue 43, item 5): agent a0 relays for a1..a3, which all only dial; each
    rank's assignment holds its own row, the two ends of a pair the same key, and neither the
    relay agent's assignment, the plane every rank shares, nor the coordinator's log holds a
    relayed pair's key."""
    recs = [AgentRecord(common_pb2.AgentInfo(
        agent_id=f"a{i}", host=f"10.0.0.{i}", port=7071, data_port=7072,
        relay_port=7171 if i == 0 else 0), 0.0, 0.0,
        reach=common_pb2.ReachStatus(verdict=reach.EVERYWHERE if i == 0 else reach.NOWHERE))
        for i in range(4)]
    routes = {(f"a{x}", f"a{y}"): "a0" for x, y in ((1, 2), (1, 3), (2, 3))}
    with caplog.at_level(logging.DEBUG):
        plane = DataPlanes().plan("job-k", 1, recs, routes=routes).plane
        assert plane is not None and len(plane.pair_relays) == 3 and not plane.pair_keys
        out = build_assignments(
            job_id="job-k", epoch=1, layout=Layout(stages=2, replicas=2),
            spec=ModelSpec("t", vocab_size=256, n_layers=4, d_model=32, n_heads=4, seq_len=16),
            train=TrainConfig(global_batch=8, micro_batches=2), master_addr="10.0.0.0",
            master_port=1, backend="dtfm", data_plane=plane)
    rows = [list(a.data_plane.pair_keys) for a in out]
    assert [[len(k) for k in row] for row in rows] == [
        [0 if r == c else 32 for c in range(4)] for r in range(4)]
    assert all(rows[a][b] == rows[b][a] for a in range(4) for b in range(4))
    relayed = {rows[x][y] for x, y in ((1, 2), (1, 3), (2, 3))}
    assert len(relayed) == 3
    seen = {"the relay agent's assignment": out[0].SerializeToString(),
            "the shared plane": plane.SerializeToString(),
            "the coordinator's log": caplog.text.encode()}
    found = [f"{where}: a relayed pair's key" for where, raw in seen.items()
             for k in relayed if k in raw or k.hex().encode() in raw]
    assert not found, found
    assert all(rows[1][2] in out[r].SerializeToString() for r in (1, 2))  # the search works


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:  # noqa: S310 - loopback only
        return reply.read().decode()


def test_no_answer_or_output_carries_an_agents_secret(daemons: Daemons, tmp_path: Path
                                                      ) -> None:
    metrics, web = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    coordinator, address = daemons.coordinator(
        "--state-dir", str(tmp_path / "coordinator"), "--metrics-listen", metrics, "--web", web,
        "--model", "gpt-tiny", "--agents", "3")  # waits for a third agent: no torch
    for name in ("agent-0", "agent-1"):
        daemons.agent(address, name)
    wait_for(lambda: len(daemons.agents_in(address, "alive")) == 2, 60, "two agents alive")
    secrets = {f"{name}'s secret": wait_for(
        lambda n=name: (p := tmp_path / n / "agent-secret").exists() and p.read_text().strip(),
        10, "the agent's secret") for name in ("agent-0", "agent-1")}
    assert all(len(s) == 64 for s in secrets.values())
    secrets["the join token"] = daemons.token

    async def answers() -> dict[str, Message]:
        security = rpc.Security(token=daemons.token)
        async with rpc.open_channel(address, security) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            # a few heartbeats after both joined: every agent's report is in
            await asyncio.sleep(2)
            got: dict[str, Message] = {
                "GetStatus": await stub.GetStatus(coordinator_pb2.StatusRequest(), timeout=10),
                "GetHistory": await stub.GetHistory(coordinator_pb2.HistoryRequest(),
                                                    timeout=10),
                "ListCheckpoints": await stub.ListCheckpoints(
                    agent_pb2.ListCheckpointsRequest(job_id="x", stage=0), timeout=10)}
            try:
                got["GetPlan"] = await stub.GetPlan(coordinator_pb2.PlanRequest(), timeout=10)
            except grpc.aio.AioRpcError as e:  # no plan yet: its reason is an answer too
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
                got["GetPlan's refusal"] = coordinator_pb2.Ack(message=e.details() or "")
            return got

    got = asyncio.run(answers())
    status = got["GetStatus"]
    assert isinstance(status, coordinator_pb2.ClusterStatus)
    assert len(status.agents) == 2 and all(a.progress.agent_id for a in status.agents), \
        "both agents' heartbeats are in the status"
    found = [f"{rpc_name}: {leak}" for rpc_name, answer in got.items()
             for leak in leaks(answer, secrets)]

    def search(what: str, text: str) -> None:
        found.extend(f"{what}: {name}" for name, s in secrets.items() if s in text)

    for args in (["status", "--json"], ["status"], ["report", "--json"], ["report"]):
        out = daemons.cli("coordinator", *args, "--coordinator", address)
        assert out.returncode == 0, out.stderr
        search(f"coordinator {' '.join(args)}", out.stdout + out.stderr)
    search("the metrics", _get(f"http://{metrics}/metrics"))
    port = int(web.rsplit(":", 1)[1])
    cookie = get(port, f"/login?token={daemons.token}")[1]["set-cookie"].split(";", 1)[0]
    for route in ("/api/status", "/api/view", "/"):
        status_code, _, body = get(port, route, cookie=cookie)
        assert status_code == 200, route
        search(f"the web view's {route}", body.decode())
    search("the coordinator's log", daemons.log(coordinator))
    for path in (tmp_path / "coordinator").rglob("*"):
        if path.is_file():
            search(f"the state dir's {path.name}", path.read_bytes().decode("latin-1"))
    assert not found, found
