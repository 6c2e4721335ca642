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

Relay agents: a member found reachable from everywhere that serves a relay
(`AgentInfo.relay_port`, `agent start --relay-port`) is a candidate too. Given the epoch's
measured network and grid (`links`), every pair of dial-only ranks gets the relay with the
least relayed cost (coordinator/scheduler/relaychoice.py): pairs that talk (pipeline
neighbours, data-parallel peers) weigh their share of a step's bytes, the rest (per-step
scalars on the world group) next to nothing. Pairs that chose a relay agent are listed in
`DataPlane.pair_relays`; the rest meet at the coordinator's. A relay agent admits the epoch
from its own assignment (it is a member: agent/relayhost.py), so restricting relays to the
job's members means no secret is sent anywhere else.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

from coordinator.daemon.registry import AgentRecord
from coordinator.links.relayed import serves_relay
from coordinator.scheduler.network import Network
from coordinator.scheduler.relaychoice import NOMINAL_BYTES, Pair, Path, choose
from dtfm import reach
from dtfm.core.assignment import member_address
from dtfm.core.layout import Layout
from dtfm.relay import Relay
from protos.dtfm.v1 import common_pb2

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "gloo", "dtfm")
DTFM = "dtfm"
SECRET_BYTES = 32
SCALAR_BYTES = 1e3  # a pair that only shares the world group's per-step scalars
COORDINATOR = ""  # the coordinator's relay among the candidates
Links = tuple[Network, Sequence[int], Layout]  # the network, rank -> its index, the grid


def talking_pairs(layout: Layout) -> set[Pair]:
    """The rank pairs that exchange tensors: pipeline neighbours of a replica, and the
    replicas of a stage (their data-parallel group)."""
    pairs = set()
    for a in range(layout.world_size):
        for b in range(a + 1, layout.world_size):
            sa, sb = layout.stage_of(a), layout.stage_of(b)
            same_replica = layout.replica_of(a) == layout.replica_of(b)
            if (same_replica and abs(sa - sb) == 1) or sa == sb:
                pairs.add((a, b))
    return pairs


def pair_relays(records: Sequence[AgentRecord], listen: Sequence[str], links: Links | None,
                coordinator: bool, to_coordinator: Sequence[Path | None] = ()
                ) -> dict[Pair, str]:
    """Each dial-only pair's relay: a relay agent's HOST:PORT, or COORDINATOR. `coordinator`:
    whether the coordinator's relay runs. Without `links` (not measured) relay agents are
    not weighed and every pair meets at the coordinator's. `to_coordinator` (by rank): each
    member's measured hop to the coordinator's relay; the coordinator's path of a pair is
    priced from its two hops where both are known, else from the pair's relayed link in
    `links` (which is the cheapest relay's price: after a relay agent became the cheapest,
    that figure would make the coordinator look as good as it)."""
    dialers = [r for r, addr in enumerate(listen) if not addr]
    pairs = [(a, b) for i, a in enumerate(dialers) for b in dialers[i + 1:]]
    if links is None:
        return dict.fromkeys(pairs, COORDINATOR) if coordinator else {}
    net, index, layout = links
    talk = talking_pairs(layout)
    agents = {member_address(records[k].info.host, records[k].info.relay_port): k
              for k, rec in enumerate(records) if serves_relay(rec)}
    relays = [*agents, *([COORDINATOR] if coordinator else [])]  # ties: keep the
    # coordinator's uplink for control traffic

    def path(a: int, b: int, c: int | None) -> Path:
        if c is None and len(to_coordinator) == len(records):
            ha, hb = to_coordinator[a], to_coordinator[b]
            if ha is not None and hb is not None:
                return Path(ha.delay_ms + hb.delay_ms, min(ha.gbps, hb.gbps))
        hops = [(a, b), (b, a)] if c is None else [(a, c), (c, b)]
        delays = [float(net.delay_ms[index[x], index[y]]) for x, y in hops]
        return Path(max(delays) if c is None else sum(delays),
                    min(float(net.bandwidth_gbps[index[x], index[y]]) for x, y in hops))

    paths = {((a, b), relay): path(a, b, agents.get(relay)) for a, b in pairs
             for relay in relays}
    weights = {p: NOMINAL_BYTES if p in talk else SCALAR_BYTES for p in pairs}
    return choose(weights, paths, relays)


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
    # each dial-only pair's relay by agent ids: a relay agent's id, or reach.COORDINATOR
    # (the re-planner prices the running epoch's relayed links through these)
    routes: dict[tuple[str, str], str] = field(default_factory=dict)
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

    def plan(self, job_id: str, epoch: int, records: Sequence[AgentRecord],
             links: Links | None = None, to_coordinator: Sequence[Path | None] = ()
             ) -> EpochPlane:
        """The data plane of `epoch` for `records` in rank order, each dial-only pair's relay
        chosen on `links` and the members' hops to the coordinator (`pair_relays`); tells
        the relay the epoch's secret when it is dtfm."""
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
        listen = [member_address(r.info.host, r.info.data_port) if accepts(r) else ""
                  for r in records]
        chosen = pair_relays(records, listen, links, self.relay is not None, to_coordinator)
        if len(chosen) < len(relayed) * (len(relayed) - 1) // 2:
            return EpochPlane(backend, relayed=relayed, unsupported=(
                f"{len(relayed)} members cannot accept connections ({cut_off}) and must meet "
                "at a relay, but the coordinator's relay is off (--relay-port 0) and no relay "
                "agent of the job (--relay-port, reachable from everywhere) has measured "
                "links to both ends of every pair: start the coordinator's relay with a port "
                "every agent can reach, or a relay agent"))
        secret = secrets.token_bytes(SECRET_BYTES)
        relay = f":{self.relay.port}" if self.relay is not None else ""
        if self.relay is not None:
            self.relay.admit(job_id, epoch, secret, len(records))
            self.relay.retire(job_id, before_epoch=epoch)
        log.info("job %s epoch %d: dtfm data plane, %d of %d members dial out only (%s)%s",
                 job_id, epoch, len(relayed), len(records), cut_off,
                 f", relay on port {self.relay.port}" if self.relay is not None else "")
        by_agent = [common_pb2.PairRelay(rank_a=a, rank_b=b, relay=addr)
                    for (a, b), addr in sorted(chosen.items()) if addr != COORDINATOR]
        if by_agent:
            log.info("job %s epoch %d: %d of %d dial-only pairs meet at relay agents (%s)",
                     job_id, epoch, len(by_agent), len(chosen),
                     ", ".join(f"{p.rank_a}-{p.rank_b} at {p.relay}" for p in by_agent))
        plane = common_pb2.DataPlane(listen=listen, relay=relay, secret=secret,
                                     pair_relays=by_agent)
        relay_ids = {member_address(r.info.host, r.info.relay_port): r.agent_id
                     for r in records if serves_relay(r)}
        routes = {(records[a].agent_id, records[b].agent_id): relay_ids.get(addr, reach.COORDINATOR)
                  for (a, b), addr in chosen.items()}
        return EpochPlane(backend, plane, relayed, routes=routes)
