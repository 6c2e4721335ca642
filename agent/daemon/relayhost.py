"""The relay a reachable agent serves for its job's dial-only pairs (issue 32: relays on
agents, `agent start --relay-port`).

Two ranks that both only dial out meet at a relay; the coordinator's is one, and every agent
peers can dial may serve another, so relayed flows need not all cross the coordinator's
uplink. The coordinator names a pair's relay in `DataPlane.pair_relays`
(coordinator/job/dataplane.py) and only picks relay agents that are members of the job, so
the agent learns each epoch's secret from its own assignment: it admits an epoch when the
plane names its relay for some pair and forgets the job's older epochs. No secret travels to
an agent that is not a member, and the relay forwards only for ranks proving that key.
"""

from __future__ import annotations

import logging

from dtfm.core.assignment import member_address
from dtfm.net.relay import Relay
from protos.dtfm.v1 import common_pb2

log = logging.getLogger(__name__)


class RelayHost:
    """A `dtfm.net.relay.Relay` on the agent's event loop, admitting the epochs it relays for."""

    def __init__(self, bind_host: str, port: int, advertised_host: str,
                 shared: bool = False) -> None:
        self.relay = Relay(None, bind_host, port)
        self.advertised_host = advertised_host
        # on the agent's gRPC `port` (its front hands circuits to `relay.accept`): it listens
        # nowhere itself
        self.shared = shared

    @property
    def address(self) -> str:
        """HOST:PORT the coordinator names this relay by (advertised host, relay port)."""
        return member_address(self.advertised_host, self.relay.port)

    async def start(self) -> int:
        """Serve (unless it shares the gRPC port); the port peers dial it at."""
        if not self.shared:
            await self.relay.serve()
        return self.relay.port

    def admit(self, a: common_pb2.Assignment) -> None:
        """Admit `a`'s epoch if its data plane relays some pair here."""
        plane = a.data_plane
        pairs = [p for p in plane.pair_relays if p.relay == self.address]
        if not pairs or not plane.secret:
            return
        self.relay.admit(a.job_id, a.epoch, plane.secret, a.world_size)
        self.relay.retire(a.job_id, before_epoch=a.epoch)
        log.info("relay: job %s epoch %d: relaying for %s", a.job_id, a.epoch,
                 ", ".join(f"ranks {p.rank_a}-{p.rank_b}" for p in pairs))

    async def close(self) -> None:
        await self.relay.aclose()
