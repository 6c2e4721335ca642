"""Which data plane an epoch's workers use, its peer table, and the coordinator's relay
(issue 32: agents behind NAT and firewalls take part).

gloo and NCCL dial every peer directly, so they work only where every member accepts
inbound connections. The rule, per epoch, on the members' reachability verdicts
(`AgentRecord.reach`, found by the dial-back of coordinator/links/reachability.py or set by
the agent's `--reachable`):

- every member reachable (EVERYWHERE, or not checked: UNKNOWN): gloo on CPU, NCCL when
  every member has a GPU, exactly as before (fastest where every pair can dial);
- any member NOWHERE or SOME_PEERS: the "dtfm" backend (agent/worker/transport). Such a
  member listens nowhere and dials out; one found reachable (EVERYWHERE) listens on its
  advertised host at its `data_port`; one not checked yet (UNKNOWN) dials out too, which
  always works. SOME_PEERS is treated as NOWHERE (a peer table has no per-pair reachability
  yet): it costs relayed traffic between peers that could have dialled, never a failure.
  Two members that both only dial meet at the coordinator's relay;
- `coordinator start --transport gloo|dtfm` overrides the choice.

The dtfm backend carries CPU tensors only: a GPU job (every member CUDA, where NCCL would
run) that needs it is refused with a message saying so, rather than training on CPU or
hanging in NCCL's bootstrap.

Every epoch gets a fresh random secret (`secrets.token_bytes`), carried only in the
members' assignments: the workers and the relay derive the epoch's key from it, so a holder
of the cluster's join token who is not a member cannot claim a rank, and a rank of an old
epoch cannot join a new one. The relay is told the epoch (`Relay.admit`, with its world
size) and forgets the job's older epochs (`Relay.retire`).

The relay address in the assignment has an empty host (":PORT"): the relay runs in the
coordinator's process, and the agent substitutes the host it dials the coordinator at
(agent/session.py), the one address every agent is known to reach.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

from coordinator.daemon.registry import AgentRecord
from dtfm import reach
from dtfm.core.assignment import member_address
from dtfm.relay import Relay
from protos.dtfm.v1 import common_pb2

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "gloo", "dtfm")
DTFM = "dtfm"
SECRET_BYTES = 32


def accepts(rec: AgentRecord) -> bool:
    """Whether peers may dial this agent's data port (it advertised one and was found
    reachable from everywhere)."""
    return rec.reach.verdict == reach.EVERYWHERE and rec.info.data_port > 0


def needs_dtfm(rec: AgentRecord) -> bool:
    """Whether gloo/NCCL cannot reach this agent: found unreachable by some or all."""
    return rec.reach.verdict in (reach.NOWHERE, reach.SOME_PEERS)


@dataclass
class EpochPlane:
    """One epoch's data plane: the backend, and per rank what the worker needs for dtfm."""

    backend: str
    plane: common_pb2.DataPlane | None = None  # the same for every rank; None: gloo, NCCL
    relayed: list[str] = field(default_factory=list)  # members that only dial out
    unsupported: str = ""  # why this epoch cannot run (the job fails with it)


class DataPlanes:
    """The job's data-plane choice (`--transport`) and the coordinator's relay."""

    def __init__(self, transport: str = "auto") -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"--transport must be {', '.join(TRANSPORTS)}, got {transport!r}")
        self.transport = transport
        self.relay: Relay | None = None

    async def start_relay(self, host: str, port: int) -> int:
        """Serve the relay on this (the coordinator's) event loop; the port it listens on."""
        self.relay = Relay(None, host, port)
        await self.relay.serve()
        return self.relay.port

    def status_fields(self, job_id: str) -> dict[str, int]:
        """What the relay forwarded for `job_id` and refused from non-members since this
        coordinator started (JobStatus fields; 0 without a relay)."""
        relay = self.relay
        return {"relayed_bytes": relay.forwarded(job_id) if relay else 0,
                "relay_refused_bytes": relay.refused_bytes if relay else 0}

    async def close(self) -> None:
        if self.relay is not None:
            await self.relay.aclose()

    def backend(self, records: Sequence[AgentRecord]) -> str:
        """The epoch's backend (see the module's rule)."""
        native = "nccl" if all(r.info.device.kind == "cuda" for r in records) else "gloo"
        if self.transport == DTFM or (self.transport == "auto"
                                      and any(needs_dtfm(r) for r in records)):
            return DTFM
        return native

    def plan(self, job_id: str, epoch: int, records: Sequence[AgentRecord]) -> EpochPlane:
        """The data plane of `epoch` for `records` in rank order; tells the relay the
        epoch's secret when it is dtfm."""
        backend = self.backend(records)
        if backend != DTFM:
            return EpochPlane(backend)
        relayed = [r.agent_id for r in records if not accepts(r)]
        cut_off = ", ".join(f"{r.agent_id} ({reach.NAMES[r.reach.verdict]})"
                            for r in records if not accepts(r)) or "none"
        if all(r.info.device.kind == "cuda" for r in records):
            return EpochPlane(backend, relayed=relayed, unsupported=(
                f"members that cannot accept connections ({cut_off}) need the dtfm "
                "transport, which carries CPU tensors only: GPU jobs with unreachable agents "
                "are not supported yet; open their data and gRPC ports (docs/operations.md, "
                "Ports) or start them with --reachable yes if peers can dial them"))
        if len(relayed) >= 2 and self.relay is None:
            return EpochPlane(backend, relayed=relayed, unsupported=(
                f"{len(relayed)} members cannot accept connections ({cut_off}) and must meet "
                "at a relay, but the coordinator's relay is off (--relay-port 0): start it "
                "with a relay port every agent can reach"))
        secret = secrets.token_bytes(SECRET_BYTES)
        listen = [member_address(r.info.host, r.info.data_port) if accepts(r) else ""
                  for r in records]
        relay = f":{self.relay.port}" if self.relay is not None else ""
        if self.relay is not None:
            self.relay.admit(job_id, epoch, secret, len(records))
            self.relay.retire(job_id, before_epoch=epoch)
        log.info("job %s epoch %d: dtfm data plane, %d of %d members dial out only (%s)%s",
                 job_id, epoch, len(relayed), len(records), cut_off,
                 f", relay on port {self.relay.port}" if self.relay is not None else "")
        plane = common_pb2.DataPlane(listen=listen, relay=relay, secret=secret)
        return EpochPlane(backend, plane, relayed)
