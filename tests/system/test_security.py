"""The join token on every RPC but health; TLS and mutual TLS with a throwaway CA."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.dtfm.v1 import agent_pb2, coordinator_pb2
from tests.certs import make_ca, make_leaf
from tests.daemons import Daemons, wait_for

pytestmark = pytest.mark.timeout(120)


def _methods(pb2: object, service: str) -> list[tuple[str, bool, bool]]:
    svc = pb2.DESCRIPTOR.services_by_name[service]  # type: ignore[attr-defined]
    return [(f"/{svc.full_name}/{m.name}", m.client_streaming, m.server_streaming)
            for m in svc.methods]


async def _call_raw(target: str, method: str, client_stream: bool, server_stream: bool,
                    payload: bytes, metadata: tuple[tuple[str, str], ...] = ()
                    ) -> grpc.StatusCode:
    """Call `method` with raw request bytes; return the status code it ends with."""
    async with grpc.aio.insecure_channel(target) as channel:
        try:
            if client_stream:
                call = channel.stream_unary(method)
                await call(iter([payload]), metadata=metadata, timeout=5)
            elif server_stream:
                call = channel.unary_stream(method)
                stream = call(payload, metadata=metadata, timeout=3)
                async for _ in stream:
                    pass
            else:
                await channel.unary_unary(method)(payload, metadata=metadata, timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_every_rpc_but_health_needs_the_token(daemons: Daemons) -> None:
    _, address = daemons.coordinator()
    daemons.agent(address, "agent-0")
    agent = wait_for(lambda: daemons.agents_in(address, "alive"), 30, "the agent")[0]
    targets = [(address, _methods(coordinator_pb2, "Coordinator")),
               (agent["address"], _methods(agent_pb2, "Agent"))]

    async def check() -> None:
        for target, methods in targets:
            for method, cs, ss in methods:
                for metadata in ((), (("authorization", "Bearer wrong"),),
                                 (("authorization", daemons.token),)):
                    code = await _call_raw(target, method, cs, ss, b"", metadata)
                    assert code == grpc.StatusCode.UNAUTHENTICATED, (method, metadata, code)
            async with grpc.aio.insecure_channel(target) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING

    asyncio.run(check())
    out = daemons.cli("coordinator", "status", "--coordinator", address,
                      env=daemons.env(DTFM_TOKEN="not-the-token-0123456789"))
    assert out.returncode == 1 and "wrong join token" in out.stderr


def test_agent_with_wrong_token_exits_with_reason(daemons: Daemons) -> None:
    _, address = daemons.coordinator()
    agent = daemons.agent(address, "intruder", env=daemons.env(DTFM_TOKEN="a-wrong-guess-012345"))
    assert agent.wait(timeout=30) == 2
    assert "wrong join token" in daemons.log(agent)
    assert daemons.status(address)["agents"] == []


def test_tls_and_mutual_tls(daemons: Daemons) -> None:
    ca, ca_key, ca_cert = make_ca(daemons.tmp)
    cert, key = make_leaf(daemons.tmp, "node", ca_key, ca_cert)
    other_ca, other_key, other_cert = make_ca(daemons.tmp, "other-ca")
    stranger_cert, stranger_key = make_leaf(daemons.tmp, "stranger", other_key, other_cert)
    tls = ["--tls-cert", str(cert), "--tls-key", str(key)]

    # server-side TLS: clients verify the server with the CA
    _, address = daemons.coordinator(*tls)
    ok = daemons.cli("coordinator", "status", "--coordinator", address, "--json",
                     "--tls-ca", str(ca))
    assert ok.returncode == 0, ok.stderr
    plain = daemons.cli("coordinator", "status", "--coordinator", address, "--timeout", "3")
    assert plain.returncode == 1

    # mutual TLS: the server demands a client certificate signed by its CA
    _, maddress = daemons.coordinator(*tls, "--tls-ca", str(ca))
    ok = daemons.cli("coordinator", "status", "--coordinator", maddress, "--json",
                     "--tls-ca", str(ca), *tls)
    assert ok.returncode == 0, ok.stderr
    no_cert = daemons.cli("coordinator", "status", "--coordinator", maddress,
                          "--tls-ca", str(ca), "--timeout", "3")
    assert no_cert.returncode == 1, "a client without a certificate must be refused"
    wrong_cert = daemons.cli("coordinator", "status", "--coordinator", maddress,
                             "--tls-ca", str(ca), "--tls-cert", str(stranger_cert),
                             "--tls-key", str(stranger_key), "--timeout", "3")
    assert wrong_cert.returncode == 1, "a certificate from another CA must be refused"

    # an agent joins over mTLS and serves its own endpoint with the same material
    daemons.agent(maddress, "agent-tls", *tls, "--tls-ca", str(ca))
    alive = wait_for(lambda: json.loads(daemons.cli(
        "coordinator", "status", "--coordinator", maddress, "--json", "--tls-ca", str(ca),
        *tls).stdout)["agents"], 30, "the agent to join over mTLS")
    assert alive[0]["state"] == "alive"
    agent_status = daemons.cli("agent", "status", "--agent", alive[0]["address"], "--json",
                               "--tls-ca", str(ca), *tls)
    assert agent_status.returncode == 0 and json.loads(agent_status.stdout)["connected"]


def test_plaintext_on_a_public_address_warns(daemons: Daemons) -> None:
    proc, _ = daemons.coordinator(env=None)  # loopback: no warning
    assert "WITHOUT TLS" not in daemons.log(proc)
    wild = daemons.spawn(["coordinator", "start", "--listen", "0.0.0.0:0"], "wild")
    wait_for(lambda: "listening" in daemons.log(wild), 20, "the coordinator to start")
    assert "WITHOUT TLS" in daemons.log(wild)
