"""The coordinator answers link probes as the relay, so agents measure their link to it.

Pairs of agents that can dial neither way talk through the relay the coordinator hosts
(coordinator/links/relayed.py), and their link is priced from each end's link to the
coordinator. An agent nobody can dial can still dial out, so it measures that link as it
measures any peer's (agent/probing/linkprobe.py `measure_peer`): `Agent.Ping`, answered as the peer
id `relayed.RELAY`, and `Agent.Probe`, answered by the same windows agents use
(`dtfm.net.probe`). Every other `Agent` RPC stays unimplemented here. The coordinator's server
registers it beside its own service (`register`); the join token guards it like every RPC.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from coordinator.links.relayed import RELAY
from dtfm.net import probe
from protos.dtfm.v1 import agent_pb2, agent_pb2_grpc


class RelayProbeService(agent_pb2_grpc.AgentServicer):
    async def Ping(self, request: agent_pb2.PingRequest,
                   context: grpc.aio.ServicerContext) -> agent_pb2.PingReply:
        return agent_pb2.PingReply(nonce=request.nonce, agent_id=RELAY)

    async def Probe(self, request_iterator: AsyncIterator[agent_pb2.ProbeChunk],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[agent_pb2.ProbeWindow]:
        async for window in probe.windows(request_iterator):
            yield window


def register(server: grpc.aio.Server) -> list[str]:
    """Add the relay's probe answers to the coordinator's `server`; the service names, for
    reflection."""
    agent_pb2_grpc.add_AgentServicer_to_server(RelayProbeService(), server)
    return [agent_pb2.DESCRIPTOR.services_by_name["Agent"].full_name]
