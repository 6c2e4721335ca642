"""Which data plane an epoch's workers use, its peer table, and the coordinator's relay
(issue 32: agents behind NAT and firewalls take part).

gloo and NCCL dial every peer directly, so they work only where every member accepts
inbound connections. The rule, per epoch, on the members' reachability verdicts
(`AgentRecord.reach`, found by the dial-back of coordinator/links/reachability.py or set by
the agent's `--reachable`):

- every member reachable (EVERYWHERE, or not checked: UNKNOWN): gloo on CPU, NCCL when
  every member has a GPU, exactly as before (fastest where every pair can dial);
- any member NOWHERE or SOME_PEERS: the "dtfm" backend (agent/worker/transport). One found
  reachable (EVERYWHERE) listens on its advertised host at its `data_port`, for everyone
  (unless that port was refused: another agent answers there, coordinator/links/dataport.py);
  one not checked yet (UNKNOWN) dials out, which always works. An undialable member
  (SOME_PEERS, or NOWHERE) listens for the members that got through to it only
  (`DataPlane.limited` and `.direct`, from `relayed.direct_dials`: the dialer's dial-back of
  it succeeded, or the dialer's own link probe of that direction did; `probes` is the link
  store), typically its own site's LAN, so two agents of one site behind one NAT, placed
  next to each other because their link is fast, talk directly; with no such evidence it
  only dials out. Per pair (`PeerTable.can_dial`, the worker's `TransportConfig.mode`): the
  end that may dial the other dials (the higher rank where both may); a pair where neither
  may meets at a relay, and only such pairs get one (`pair_relays`). Link pricing agrees
  (coordinator/links/relayed.py): the same probes measured such a pair direct;
- `coordinator start --transport gloo|dtfm` overrides the choice.

A GPU job (every member CUDA, where NCCL would run) that needs the dtfm backend still trains
on its GPUs: `DataPlane.gpu` tells the workers to place their stages on CUDA, and the
transport stages each message through host memory (agent/worker/transport/staging.py).

Every epoch gets a fresh random secret (`secrets.token_bytes`), carried only in the
members' assignments: the workers and the relay derive the epoch's key from it, so a holder
of the cluster's join token who is not a member cannot claim a rank, and a rank of an old
epoch cannot join a new one. The relay is told the epoch (`Relay.admit`, with its world
size) and forgets the job's older epochs (`Relay.retire`).

The relay address in the assignment has an empty host (":PORT"): the relay runs in the
coordinator's process, and the agent substitutes the host it dials the coordinator at
(agent/daemon/session.py), the one address every agent is known to reach.

Relay agents: a member found reachable from everywhere that serves a relay
(`AgentInfo.relay_port`, `agent start --relay-port`) is a candidate too. Given the epoch's
measured network and grid (`links`), every pair with no direct path gets the relay with the
least relayed cost (coordinator/scheduler/relaychoice.py): pairs that talk (pipeline
neighbours, data-parallel peers) weigh the bytes the plan's step moves between them
(`pair_bytes`, from the step model's `StepShape`), the rest (per-step scalars on the world
group) next to nothing. Pairs that chose a relay agent are listed in
`DataPlane.pair_relays`; the rest meet at the coordinator's. A relay agent admits the epoch
from its own assignment (it is a member: agent/daemon/relayhost.py), so restricting relays to the
job's members means no secret is sent anywhere else.

The planner prices the grid it places with these very routes (each relay's uplink shared by
the flows it carries, coordinator/scheduler/relay.py): `DataPlanes.router` gives it the same
choice (`DataPlanes.routes`) for the grid it prices, and `plan` takes the routes the planner
priced (`routes=`) rather than choosing again, so the epoch runs what was predicted even
where its inputs moved in between (`--sync-every auto` changes the bytes a pair moves after
placement; the planner routes on the measured links, the data plane is handed the shared
ones). It chooses itself only where it is given no routes, or routes that miss one of its
relayed pairs or name a relay it does not have.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from coordinator.daemon.registry import AgentRecord, Registry
from coordinator.links.relayed import coordinator_hop, direct_dials, serves_relay
from coordinator.links.store import LinkStore
from coordinator.scheduler.network import Network
from coordinator.scheduler.relaychoice import NOMINAL_BYTES, Pair, Path, choose
from coordinator.scheduler.steptime import StepShape
from dtfm.core.assignment import member_address
from dtfm.core.layout import Layout
from dtfm.core.pairkeys import FRAMES
from dtfm.net import dataplane as dp
from dtfm.net import reach
from dtfm.net.front import Front
from dtfm.net.relay import Relay
from protos.dtfm.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "gloo", "dtfm")
DTFM = "dtfm"
SECRET_BYTES = 32
SCALAR_BYTES = 1e3  # a pair that only shares the world group's per-step scalars
COORDINATOR = ""  # the coordinator's relay among the candidates
# the network, rank -> its index, the grid, and what a step moves (None: not known)
Links = tuple[Network, Sequence[int], Layout, StepShape | None]
# each dial-only pair's relay by agent ids: a relay agent's id, or reach.COORDINATOR
AgentRoutes = dict[tuple[str, str], str]
# the members' ids in rank order and the grid's links -> their routes (None: not known)
Router = Callable[[Sequence[str], Links], AgentRoutes | None]


def pair_bytes(layout: Layout, shape: StepShape | None) -> dict[Pair, float]:
    """The bytes each rank pair that exchanges tensors moves per step: pipeline neighbours of
    a replica every micro-batch's activations and their gradients; two replicas of a stage
    (its data-parallel group) the sharded exchange's 2/R of the stage's gradient (each sends
    the other its shard, then the averaged shard back), once per `sync_every` steps. Without
    a `shape`, every such pair weighs `NOMINAL_BYTES`. Pairs absent only share scalars."""
    pairs: dict[Pair, float] = {}
    replicas = layout.replicas
    for a in range(layout.world_size):
        for b in range(a + 1, layout.world_size):
            sa, sb = layout.stage_of(a), layout.stage_of(b)
            if layout.replica_of(a) == layout.replica_of(b) and abs(sa - sb) == 1:
                pairs[(a, b)] = (2 * shape.micro_batches * shape.act_bytes if shape
                                 else NOMINAL_BYTES)
            elif sa == sb:
                pairs[(a, b)] = (2 * shape.grad_bytes[sa] / replicas / shape.sync_every
                                 if shape else NOMINAL_BYTES)
    return pairs


@dataclass(frozen=True)
class PeerTable:
    """Who listens where, and for whom: `listen` per rank ("" = dials only), `limited` the
    ranks only the dialers in `direct` ((dialer, listener) ranks) may dial."""

    listen: list[str]
    limited: set[int] = field(default_factory=set)
    direct: set[Pair] = field(default_factory=set)

    def can_dial(self, a: int, b: int) -> bool:
        """Whether rank `a` may dial rank `b` (`dp.may_dial`, the workers' rule too)."""
        listening = {r for r, addr in enumerate(self.listen) if addr}
        return dp.may_dial(a, b, listening, self.limited, self.direct)

    def relayed_pairs(self) -> list[Pair]:
        """The (low, high) rank pairs with no direct path either way: they meet at a relay."""
        n = len(self.listen)
        return [(a, b) for a in range(n) for b in range(a + 1, n)
                if not self.can_dial(a, b) and not self.can_dial(b, a)]


def peer_table(records: Sequence[AgentRecord], direct: set[tuple[str, str]],
               relay_only: Collection[frozenset[str]] = ()) -> PeerTable:
    """The epoch's peer table from the members' verdicts and `direct` ((dialer, listener)
    agent ids, `relayed.direct_dials`): a member reachable from everywhere listens for all;
    an undialable one that some member of this epoch got through to listens for those only;
    the rest dial. The pairs of `relay_only` (agent ids) dial neither way: each listening end
    becomes `limited`, dialable by every rank but the other end, so the pair meets at a
    relay and both ends read it so from the one table (coordinator/job/failedpairs.py)."""
    rank = {r.agent_id: k for k, r in enumerate(records)}
    pairs = {(rank[a], rank[b]) for a, b in direct if a in rank and b in rank
             and records[rank[b]].data_port > 0 and not accepts(records[rank[b]])}
    limited = {b for _, b in pairs}
    listen = [member_address(r.info.host, r.data_port) if accepts(r) or k in limited
              else "" for k, r in enumerate(records)]
    cut = {(rank[a], rank[b]) for pair in relay_only if len(pair) == 2 and pair <= rank.keys()
           for a, b in (sorted(pair), sorted(pair, reverse=True))}
    for k in {x for p in cut for x in p if listen[x]} - limited:  # open to all until now
        pairs |= {(d, k) for d in range(len(records)) if d != k}
        limited.add(k)
    return PeerTable(listen, limited, pairs - cut)


def pair_relays(records: Sequence[AgentRecord], pairs: Sequence[Pair], links: Links | None,
                coordinator: bool, to_coordinator: Sequence[Path | None] = ()
                ) -> dict[Pair, str]:
    """Each relayed pair's relay (`PeerTable.relayed_pairs`): a relay agent's HOST:PORT, or
    COORDINATOR. `coordinator`: whether the coordinator's relay runs. Without `links` (not
    measured) relay agents are not weighed and every pair meets at the coordinator's.
    `to_coordinator` (by rank): each member's measured hop to the coordinator's relay; the
    coordinator's path of a pair is priced from its two hops where both are known, else
    from the pair's relayed link in `links` (which is the cheapest relay's price: after a
    relay agent became the cheapest, that figure would make the coordinator look as good as
    it)."""
    if links is None:
        return dict.fromkeys(pairs, COORDINATOR) if coordinator else {}
    net, index, layout, shape = links
    talk = pair_bytes(layout, shape)
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
    weights = {p: talk.get(p, SCALAR_BYTES) for p in pairs}
    return choose(weights, paths, relays)


def by_agent(records: Sequence[AgentRecord], chosen: Mapping[Pair, str]) -> AgentRoutes:
    """`chosen` (rank pairs -> a relay agent's HOST:PORT or COORDINATOR) by agent ids: the
    relay agent's id, or reach.COORDINATOR."""
    relay_ids = {member_address(r.info.host, r.info.relay_port): r.agent_id
                 for r in records if serves_relay(r)}
    return {(records[a].agent_id, records[b].agent_id): relay_ids.get(addr, reach.COORDINATOR)
            for (a, b), addr in chosen.items()}


def by_rank(records: Sequence[AgentRecord], routes: Mapping[tuple[str, str], str],
            pairs: Sequence[Pair], coordinator: bool) -> dict[Pair, str] | None:
    """`routes` (`by_agent`'s, either order of a pair) back to `pairs` of ranks -> a relay
    agent's HOST:PORT or COORDINATOR; None where a pair has no route or its relay is not
    one here (no member serving a relay by that id; the coordinator's relay off)."""
    addresses = {r.agent_id: member_address(r.info.host, r.info.relay_port)
                 for r in records if serves_relay(r)}
    if coordinator:
        addresses[reach.COORDINATOR] = COORDINATOR
    out = {}
    for a, b in pairs:
        x, y = records[a].agent_id, records[b].agent_id
        relay = routes.get((x, y), routes.get((y, x)))
        if relay is None or relay not in addresses:
            return None
        out[a, b] = addresses[relay]
    return out


def accepts(rec: AgentRecord) -> bool:
    """Whether peers may dial this agent's data port (it advertised one and was found
    reachable from everywhere)."""
    return rec.reach.verdict == reach.EVERYWHERE and rec.data_port > 0


def why_dials(rec: AgentRecord) -> str:
    """Why a member that does not accept connections only dials, in a word or three."""
    return "data port refused" if rec.data_port_refused else reach.NAMES[rec.reach.verdict]


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


def all_gpu(records: Sequence[AgentRecord]) -> bool:
    """Every member has CUDA: NCCL where all accept connections, else dtfm on the GPUs."""
    return all(r.info.device.kind == "cuda" for r in records)


class RelayAgentCounts:
    """Bytes the job's relay agents report (`ProgressReport.relay_*`), summed over agents.

    An agent counts from its own start, so a report lower than the last one means it
    restarted: what it had counted before is kept, and the new count adds to it."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, int]] = {}  # agent -> (forwarded, refused) reported
        self._before: dict[str, tuple[int, int]] = {}  # agent -> counted before a restart

    def observe(self, agent_id: str, forwarded: int, refused: int) -> None:
        last = self._last.get(agent_id, (0, 0))
        if forwarded < last[0] or refused < last[1]:
            before = self._before.get(agent_id, (0, 0))
            self._before[agent_id] = (before[0] + last[0], before[1] + last[1])
        self._last[agent_id] = (forwarded, refused)

    def totals(self) -> tuple[int, int]:
        """(forwarded, refused) over every agent that reported."""
        counts = [*self._last.values(), *self._before.values()]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)


class DataPlanes:
    """The job's data-plane choice (`--transport`) and the coordinator's relay."""

    def __init__(self, transport: str = "auto", hole_punch: bool = True,
                 frames: str = "mac") -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"--transport must be {', '.join(TRANSPORTS)}, got {transport!r}")
        if frames not in FRAMES:
            raise ValueError(f"--frames must be {', '.join(FRAMES)}, got {frames!r}")
        self.transport = transport
        self.frames = frames  # each frame's protection (the pair keys: dtfm/core/assignment)
        self.hole_punch = hole_punch
        self.relay: Relay | None = None
        self.relay_agents = RelayAgentCounts()
        self._front: Front | None = None  # the shared port's front, when the relay is on it
        # pairs (agent ids) relayed whatever their verdicts: their direct path failed twice
        # (coordinator/job/failedpairs.py); hole punching is off in epochs that have one
        self.relay_only: set[frozenset[str]] = set()
        self.last: EpochPlane | None = None  # the newest epoch's plane (`path_of`)
        # (job id, epoch) of an epoch adopted from the state directory: its secret died with
        # the previous process, so its members' dials are stale to this relay (`adopted`)
        self._adopted: tuple[str, int] | None = None

    def adopted(self, job_id: str, epoch: int) -> None:
        """`job_id`'s `epoch` was adopted after a coordinator restart: the relay cannot serve
        it (no key), and says its members' dials are stale rather than intrusions."""
        self._adopted = (job_id, epoch)
        self._retire_adopted()

    def _retire_adopted(self) -> None:
        if self.relay is not None and self._adopted is not None:
            self.relay.retire(self._adopted[0], before_epoch=self._adopted[1] + 1)

    async def start_relay(self, host: str, port: int) -> int:
        """Serve the relay on this (the coordinator's) event loop; the port it listens on."""
        self.relay = Relay(None, host, port)
        self._retire_adopted()
        await self.relay.serve()
        return self.relay.port

    def observe(self, agent_id: str, report: coordinator_pb2.ProgressReport) -> None:
        """Take a member's report of the relay it serves (counts since that agent started)."""
        self.relay_agents.observe(agent_id, report.relay_forwarded_bytes,
                                  report.relay_refused_bytes)

    def share_relay(self, front: Front) -> Relay:
        """A relay fed by the coordinator's `front` on its gRPC port (dtfm/net/front.py),
        which hands it data-plane connections from its first accept. It listens nowhere
        itself: the caller sets its `port` to the front's once the front listens, before any
        epoch is planned. What the front refuses counts as the relay's refused bytes."""
        self.relay = Relay(None)
        self._front = front
        front.on_data = self.relay.accept
        self._retire_adopted()
        return self.relay

    def share_relay_of(self, other: DataPlanes) -> None:
        """The coordinator's relay outlives a job: the next job's planes use the one running
        (coordinator/daemon/jobs.py)."""
        self.relay, self._front = other.relay, other._front
        self._retire_adopted()

    def status_fields(self, job_id: str) -> dict[str, int]:
        """What the relays forwarded for `job_id` and refused from non-members: the
        coordinator's since it started (the bytes of connections the shared port's front
        closed for speaking neither gRPC nor dtfm included), plus its members' relay agents
        as they last reported (JobStatus fields)."""
        relay, front = self.relay, self._front
        forwarded, refused = self.relay_agents.totals()
        refused += (relay.refused_bytes if relay else 0) + (front.refused_bytes if front else 0)
        return {"relayed_bytes": forwarded + (relay.forwarded(job_id) if relay else 0),
                "relay_refused_bytes": refused}

    @property
    def stale_dials(self) -> int:
        """Dials the coordinator's relay refused for a retired or adopted epoch: members of an
        ending epoch, not intruders, so counted apart from `relay_refused_bytes`."""
        return self.relay.stale_dials if self.relay is not None else 0

    async def close(self) -> None:
        if self.relay is not None:
            await self.relay.aclose()

    def backend(self, records: Sequence[AgentRecord]) -> str:
        """The epoch's backend (see the module's rule)."""
        native = "nccl" if all_gpu(records) else "gloo"
        if self.transport == DTFM or (self.transport == "auto" and (
                any(needs_dtfm(r) for r in records) or self._relay_only(records))):
            return DTFM
        return native

    def _relay_only(self, records: Sequence[AgentRecord]) -> set[frozenset[str]]:
        """The pairs of `relay_only` with both ends among `records`."""
        ids = {r.agent_id for r in records}
        return {p for p in self.relay_only if p <= ids}

    def can_relay(self, records: Sequence[AgentRecord]) -> bool:
        """Whether a pair of `records` could meet at a relay: the coordinator's runs, or one
        of them serves one (on gloo/NCCL only `--transport gloo` rules it out)."""
        return self.transport != "gloo" and (
            self.relay is not None or any(serves_relay(r) for r in records))

    def path_of(self, a: int, b: int) -> str:
        """The path the newest epoch gave ranks `a` and `b` (failedpairs' words): direct (both
        could dial, or gloo/NCCL), dial-out (only the one that cannot accept dials), punched
        (neither dials: they meet at a relay and try to punch through), or relay."""
        last = self.last
        if last is None or last.plane is None:
            return "direct"
        plane = last.plane
        table = PeerTable(list(plane.listen), set(plane.limited),
                          {(d.dialer, d.listener) for d in plane.direct})
        ab, ba = table.can_dial(a, b), table.can_dial(b, a)
        if ab and ba:
            return "direct"
        if ab or ba:
            return "dial-out"
        return "punched" if plane.hole_punch else "relay"

    def choose(self, records: Sequence[AgentRecord], pairs: Sequence[Pair],
               links: Links | None, probes: LinkStore | None) -> dict[Pair, str]:
        """Each relayed pair's relay (rank pairs of `records` in rank order), chosen on
        `links` and the members' hops to the coordinator (`pair_relays`)."""
        return pair_relays(
            records, pairs, links, self.relay is not None,
            [coordinator_hop(probes, r.agent_id) for r in records] if probes is not None else ())

    def routes(self, records: Sequence[AgentRecord], links: Links | None,
               probes: LinkStore | None) -> AgentRoutes | None:
        """Each relayed pair's relay by agent ids (`choose`, `by_agent`), as `plan`
        would choose it for `records` in rank order; None where the epoch would not run the
        dtfm data plane (nothing is relayed)."""
        if self.backend(records) != DTFM:
            return None
        pairs = peer_table(records, direct_dials(records, probes),
                           self._relay_only(records)).relayed_pairs()
        return by_agent(records, self.choose(records, pairs, links, probes))

    def router(self, registry: Registry, probes: LinkStore | None) -> Router:
        """`routes` for the planner (coordinator/job/epochplan.py), which knows its members
        by id: they are looked up in `registry`; None where one is not there."""
        def route(ids: Sequence[str], links: Links) -> AgentRoutes | None:
            records = [registry.get(a) for a in ids]
            known = [r for r in records if r is not None]
            return self.routes(known, links, probes) if len(known) == len(ids) else None
        return route

    def plan(self, job_id: str, epoch: int, records: Sequence[AgentRecord],
             links: Links | None = None, probes: LinkStore | None = None,
             routes: Mapping[tuple[str, str], str] | None = None) -> EpochPlane:
        """The data plane of `epoch` for `records` in rank order, each relayed pair's relay
        as the planner priced it (`routes`, `by_rank`), or, without routes that serve every
        relayed pair, chosen here (`choose`) on `links` and the members' hops to the
        coordinator; `probes`: the measured links, whose probes are evidence of direct paths
        to agents reachable from some peers only and give those hops. Tells the relay the
        epoch's secret when it is dtfm."""
        self.last = self._plan(job_id, epoch, records, links, probes, routes)
        return self.last

    def _plan(self, job_id: str, epoch: int, records: Sequence[AgentRecord],
              links: Links | None, probes: LinkStore | None,
              routes: Mapping[tuple[str, str], str] | None) -> EpochPlane:
        backend = self.backend(records)
        if backend != DTFM:
            return EpochPlane(backend)
        relayed = [r.agent_id for r in records if not accepts(r)]
        cut_off = ", ".join(f"{r.agent_id} ({why_dials(r)})"
                            for r in records if not accepts(r)) or "none"
        gpu = all_gpu(records)
        forced = self._relay_only(records)
        table = peer_table(records, direct_dials(records, probes), forced)
        relayed_pairs = table.relayed_pairs()
        if forced:
            log.warning("job %s epoch %d: relaying %s whatever their verdicts (their direct "
                        "path failed twice), with hole punching off this epoch (it would "
                        "open the same direct path)", job_id, epoch,
                        ", ".join("<->".join(sorted(p)) for p in sorted(forced, key=sorted)))
        chosen = (by_rank(records, routes, relayed_pairs, self.relay is not None)
                  if routes is not None else None)
        if chosen is None:
            if routes is not None:
                log.info("job %s epoch %d: the relays the plan was priced through miss a "
                         "relayed pair or name a relay not here; each pair's relay chosen "
                         "afresh", job_id, epoch)
            chosen = self.choose(records, relayed_pairs, links, probes)
        if len(chosen) < len(relayed_pairs):
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
        log.info("job %s epoch %d: dtfm data plane%s, %d of %d members dial out only (%s), "
                 "frames %s%s", job_id, epoch,
                 " (GPUs, messages staged through host memory)" if gpu else "",
                 len(relayed), len(records), cut_off, self.frames,
                 f", relay on port {self.relay.port}" if self.relay is not None else "")
        at_agents = [common_pb2.PairRelay(rank_a=a, rank_b=b, relay=addr)
                    for (a, b), addr in sorted(chosen.items()) if addr != COORDINATOR]
        if at_agents:
            log.info("job %s epoch %d: %d of %d dial-only pairs meet at relay agents (%s)",
                     job_id, epoch, len(at_agents), len(chosen),
                     ", ".join(f"{p.rank_a}-{p.rank_b} at {p.relay}" for p in at_agents))
        if table.direct:
            log.info("job %s epoch %d: %d pairs dial a member reachable from some peers only "
                     "directly (%s); %d pairs meet at a relay", job_id, epoch,
                     len(table.direct), ", ".join(f"{a}->{b}" for a, b in sorted(table.direct)),
                     len(relayed_pairs))
        plane = common_pb2.DataPlane(
            listen=table.listen, relay=relay, secret=secret, pair_relays=at_agents,
            limited=sorted(table.limited),
            direct=[common_pb2.DirectDial(dialer=a, listener=b) for a, b in sorted(table.direct)],
            hole_punch=self.hole_punch and not forced, gpu=gpu, frames=FRAMES[self.frames])
        return EpochPlane(backend, plane, relayed, routes=by_agent(records, chosen))
