"""Builds the `Assignment` each worker receives: the one place a job becomes per-rank orders.

Both the coordinator (for agents it scheduled) and `agent local` (for workers on one machine)
call this, so a worker cannot tell who launched it and both paths are tested by the same tests.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from dtfm.core import lora, pairkeys
from dtfm.core.buckets import check_shares
from dtfm.core.codecs import LinkCodecs
from dtfm.core.layout import Layout, layer_ranges, layer_splits
from dtfm.core.spec import ModelSpec, TrainConfig
from dtfm.core.words import counted
from protos.dtfm.v1 import common_pb2

log = logging.getLogger(__name__)


# The checkpoint peer that is the coordinator itself (`Assignment.checkpoint_peers`, a
# `CheckpointMirror.peer` of `checkpoint_pushes`): the copy of last resort of a stage no
# dialable member holds. Not an address (it has no port): the agent dials the coordinator at
# the address it joined it at, the one every agent is known to reach.
COORDINATOR_PEER = "coordinator"


def member_address(host: str, port: int) -> str:
    """HOST:PORT of an agent's own gRPC server, with an IPv6 literal in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def resolve_relay(assignment: common_pb2.Assignment, coordinator: str) -> None:
    """Give the data plane's relay a host: ":PORT" is the coordinator's own relay, at the
    host this agent dials the coordinator at (`coordinator`, HOST:PORT as the agent was
    told it), the one address every agent is known to reach."""
    plane = assignment.data_plane
    plane.relay = relay_at(plane.relay, coordinator)
    for pair in plane.pair_relays:
        pair.relay = relay_at(pair.relay, coordinator)


def relay_at(relay: str, coordinator: str) -> str:
    """`relay` with a host: ":PORT" (the coordinator's relay) at the host of `coordinator`
    (HOST:PORT as the agent dials it); any other address as it is."""
    return f"{coordinator.rpartition(':')[0]}{relay}" if relay.startswith(":") else relay


@dataclass(frozen=True)
class CheckpointRoutes:
    """Where one rank's agent gets checkpoints it lacks, and which stages it mirrors."""

    peers: tuple[str, ...]  # every other member, the best link first: ask them for its stage
    mirrors: tuple[tuple[int, str], ...]  # (stage, member holding it) to keep a copy of
    # (stage, member holding it) whose copy its holder pushes here: nobody can dial it
    received: tuple[tuple[int, str], ...] = ()
    # (own stage, member to push its checkpoints to, or COORDINATOR_PEER where no member can
    # be dialled): nobody can dial this rank to pull them
    pushes: tuple[tuple[int, str], ...] = ()


def mirror_stages(layout: Layout) -> dict[int, int]:
    """Stage -> the stage whose replica-0 agent mirrors it. Without shared storage a stage
    must be held by two agents: one with two or more replicas already is (every replica
    writes it); a stage with one is mirrored by the agent at the next stage (s + 1 mod S).
    With one stage and one replica there is no other agent to hold a copy."""
    if layout.replicas != 1 or layout.stages < 2:
        return {}
    return {stage: (stage + 1) % layout.stages for stage in range(layout.stages)}


def _push_target(holder: int, stage_ranks: Sequence[int], can_dial: Sequence[bool],
                 gbps: Sequence[Sequence[float]] | None) -> int | None:
    """The dialable rank outside the stage with the best measured link from `holder` (the
    lowest rank where links are unknown or equal); None when nobody can be dialled."""
    out = [r for r in range(len(can_dial)) if can_dial[r] and r not in stage_ranks]
    if not out:
        return None
    if gbps is None:
        return out[0]
    rate = [float(gbps[holder][r]) for r in out]
    best = max((x for x in rate if not math.isnan(x)), default=math.nan)
    return out[rate.index(best)] if not math.isnan(best) else out[0]


def checkpoint_routes(layout: Layout, members: Sequence[str],
                      gbps: Sequence[Sequence[float]] | None = None, *,
                      ids: Sequence[str] | None = None,
                      dialable: Sequence[bool] | None = None) -> list[CheckpointRoutes]:
    """Per rank (rank order), where its checkpoints come from and which stages it mirrors.

    `members[rank]` is the HOST:PORT of the agent running `rank`, `ids[rank]` its id (default:
    every rank its own agent). Agents are told apart by id, never by address: agents behind
    different NATs often advertise one private address, and each must still list the other.
    Without shared storage a stage's checkpoint lives on the agents that ran it; to survive
    the loss of one, every stage must be held by two (`mirror_stages`: who copies a
    one-replica stage). Every rank's peers are all other members, so an agent that takes
    over a stage it never held can find whoever holds it. An agent fetches from the first
    peer on its list that holds the step, so `dialable[i]` (False: nobody can dial rank i's
    agent, it sits behind a NAT) puts those that can be dialled first, and with `gbps[i][j]`
    (measured Gbit/s from rank i's agent to rank j's, NaN unknown) each list then starts with
    the best link into that rank: a re-plan that moves a stage away from a degraded link
    would otherwise fetch its checkpoint over that very link, as the move's priced cost
    (`coordinator.replan.copy_seconds`) assumes it does not. A mirrored stage whose holder
    nobody can dial is pushed instead (`received` on the mirror, `pushes` on the holder:
    dtfm/checkpoints/push.py) when its mirror can be dialled; a stage that still no dialable
    agent would hold is pushed by its first holder to the dialable agent it has the best link
    to. In a job without any dialable member, the first holder pushes it to the coordinator
    (`COORDINATOR_PEER`, which every agent dials: the copy of last resort); wherever a member
    cannot be dialled, every rank's peers name the coordinator after the dialable members, so
    an agent that needs a stage (this epoch's, or an earlier epoch's split) asks it too.
    """
    n = layout.world_size
    if len(members) != n:
        raise ValueError(f"{len(members)} member addresses for {n} ranks")
    if gbps is not None and (len(gbps) != n or any(len(row) != n for row in gbps)):
        raise ValueError(f"link bandwidths must be {n} x {n}, one row and column per rank")
    for name, given in (("member ids", ids), ("dialable flags", dialable)):
        if given is not None and len(given) != n:
            raise ValueError(f"{len(given)} {name} for {n} ranks")
    who = list(ids) if ids is not None else [str(r) for r in range(n)]
    can_dial = list(dialable) if dialable is not None else [True] * n
    mirrors: dict[int, list[tuple[int, str]]] = {r: [] for r in range(n)}
    received: dict[int, list[tuple[int, str]]] = {r: [] for r in range(n)}
    pushes: dict[int, list[tuple[int, str]]] = {r: [] for r in range(n)}
    pushed: set[int] = set()  # stages whose holder pushes to a dialable mirror
    for stage, by in mirror_stages(layout).items():
        holder, mirror = layout.rank(stage, 0), layout.rank(by, 0)
        if can_dial[holder] or not can_dial[mirror]:  # both undialable: logged below
            mirrors[mirror].append((stage, members[holder]))
            continue
        received[mirror].append((stage, members[holder]))
        pushes[holder].append((stage, members[mirror]))
        pushed.add(stage)
    for stage in range(layout.stages):
        if stage in pushed or any(can_dial[r] for r in layout.dp_ranks(stage)):
            continue
        holder = layout.rank(stage, 0)
        if (to := _push_target(holder, layout.dp_ranks(stage), can_dial, gbps)) is not None:
            # no dialable agent holds the stage: its first holder pushes it to the dialable
            # agent it has the best link to, where anyone can then fetch it
            received[to].append((stage, members[holder]))
            pushes[holder].append((stage, members[to]))
            pushed.add(stage)
            continue
        # no member of the job can be dialled: the coordinator, which every agent dials,
        # keeps the copy of last resort (coordinator/job/checkpointcopies.py)
        pushes[holder].append((stage, COORDINATOR_PEER))
        log.info("stage %d's checkpoints are written only by agents nobody can dial (%s), "
                 "and no member of the job can be dialled: %s pushes its newest step to the "
                 "coordinator", stage, ", ".join(who[r] for r in layout.dp_ranks(stage)),
                 who[holder])

    def peers(rank: int) -> tuple[str, ...]:
        order = [i for i in range(n) if who[i] != who[rank]]
        if gbps is not None:  # unknown (NaN) last; equal links keep rank order
            order.sort(key=lambda i: math.inf if math.isnan(g := float(gbps[i][rank])) else -g)
        order.sort(key=lambda i: not can_dial[i])  # stable: dialable first, each by its link
        found = [members[i] for i in order]
        if not all(can_dial):  # where the coordinator may hold a copy: after dialable agents
            found.insert(sum(can_dial[i] for i in order), COORDINATOR_PEER)
        return tuple(found)

    return [CheckpointRoutes(peers(rank), tuple(mirrors[rank]), tuple(received[rank]),
                             tuple(pushes[rank])) for rank in range(n)]


def build_assignments(
    *,
    job_id: str,
    epoch: int,
    layout: Layout,
    spec: ModelSpec,
    train: TrainConfig,
    master_addr: str,
    master_port: int,
    backend: str = "gloo",
    splits: Sequence[int] | None = None,
    bind_addrs: Sequence[str] | None = None,
    codecs: LinkCodecs | None = None,
    members: Sequence[tuple[str, int]] | None = None,
    checkpoint_splits: Sequence[int] | None = None,
    dp_shares: Sequence[Sequence[float]] | None = None,
    init_hash: str = "",
    member_gbps: Sequence[Sequence[float]] | None = None,
    data_plane: common_pb2.DataPlane | None = None,
    member_ids: Sequence[str] | None = None,
    member_dialable: Sequence[bool] | None = None,
) -> list[common_pb2.Assignment]:
    """One assignment per rank, in rank order.

    `bind_addrs[rank]` is the address rank's agent advertises (its collectives bind there);
    without it every rank binds to `master_addr`, which is right only on one machine.
    `codecs`: the compression of every link (the coordinator's choice for `auto`); without
    it every link uses the training config's setting, `auto` read as none.
    `members[rank]`: (host, port) of the agent running rank, for the checkpoint peers and
    mirrors of each rank (`checkpoint_routes`); none are set without it, with a shared
    `checkpoint_dir` (every rank reads that) or with checkpoints off. `member_gbps[i][j]`:
    the measured bandwidth from rank i's agent to rank j's (NaN unknown), so that each rank
    asks its best-connected peers first; `member_ids[rank]`: its agent's id (peers are told
    apart by id: two behind different NATs may share an address); `member_dialable[rank]`:
    False where nobody can dial its agent (asked last: a copy needs a dial; it pushes its
    mirrored stage to a dialable mirror instead, `checkpoint_routes`).
    `checkpoint_splits`: layers per stage of the split the job's checkpoints hold, when the
    job re-planned on another stage count; set on every rank only when it differs from this
    layout's split (each worker then reads its layers from the old stages that held them).
    `dp_shares[stage]`: that stage's share of each replica in the sharded gradient exchange
    (`dtfm.core.buckets`); without it every replica owns an equal share.
    `init_hash`: `dtfm.core.hfdir.dir_hash` of `train.init_from` where it was planned; every
    worker checks its own copy against it.
    `data_plane`: with `backend` "dtfm", the peer table (one listen address per rank), relay
    and epoch secret every rank gets (coordinator/job/dataplane.py); unless its frames are
    unprotected, each rank's copy also gets its own row of this epoch's pair keys
    (`pairkeys.keys_for`, from a master drawn here and dropped: no one else keeps it).
    """
    if (backend == "dtfm") != (data_plane is not None):
        raise ValueError("the dtfm backend needs a data plane (peer table, relay, secret), "
                         "and only it takes one")
    if data_plane is not None and len(data_plane.listen) != layout.world_size:
        raise ValueError(f"the data plane lists {len(data_plane.listen)} ranks' addresses "
                         f"for {layout.world_size} ranks")
    train.validate(layout.replicas)
    lora.check(train, spec)
    if bind_addrs is not None and len(bind_addrs) != layout.world_size:
        raise ValueError(f"{len(bind_addrs)} bind addresses for {layout.world_size} ranks")
    counts = layer_splits(spec.n_layers, layout.stages, splits)
    if codecs is None:
        codecs = LinkCodecs.uniform(train.pp_compress, train.dp_compress, layout.stages,
                                    layout.replicas)
    codecs.check(layout.stages, layout.replicas)
    ranges = layer_ranges(spec.n_layers, layout.stages, counts)
    resplit: list[int] = []
    if checkpoint_splits:
        old = list(checkpoint_splits)
        layer_splits(spec.n_layers, len(old), old)  # ValueError: not a split of this model
        resplit = [] if old == counts else old
    if dp_shares is not None:
        if len(dp_shares) != layout.stages:
            raise ValueError(f"data-parallel shares for {counted(len(dp_shares), 'stage')}, "
                             f"the layout has {layout.stages}")
        dp_shares = [check_shares(row, layout.replicas) for row in dp_shares]
    routes = None
    if members is not None and not train.checkpoint_dir and train.checkpoint_every:
        routes = checkpoint_routes(layout, [member_address(h, p) for h, p in members],
                                   member_gbps, ids=member_ids, dialable=member_dialable)
    master = (pairkeys.new_master() if data_plane is not None
              and data_plane.frames != common_pb2.FRAMES_OFF else None)
    out = []
    for rank in range(layout.world_size):
        stage, replica = layout.coords(rank)
        prev_rank, next_rank = layout.prev_rank(rank), layout.next_rank(rank)
        pp_prev, pp_next, dp = codecs.rank_codecs(stage, replica)
        out.append(common_pb2.Assignment(
            job_id=job_id, epoch=epoch, master_addr=master_addr, master_port=master_port,
            world_size=layout.world_size, rank=rank, stage=stage, replica=replica,
            stages=layout.stages, replicas=layout.replicas,
            layer_begin=ranges[stage][0], layer_end=ranges[stage][1],
            dp_group_ranks=layout.dp_ranks(stage),
            prev_rank=-1 if prev_rank is None else prev_rank,
            next_rank=-1 if next_rank is None else next_rank,
            model=spec.to_proto(), train=train.to_proto(), backend=backend,
            layer_splits=counts,
            bind_addr=bind_addrs[rank] if bind_addrs is not None else master_addr,
            pp_compress_prev=pp_prev, pp_compress_next=pp_next, dp_compress=dp,
            checkpoint_splits=resplit,
            dp_shares=dp_shares[stage] if dp_shares is not None else [],
            init_hash=init_hash, data_plane=data_plane,
        ))
        if master is not None:
            out[-1].data_plane.pair_keys[:] = pairkeys.keys_for(master, rank, layout.world_size)
        if routes is not None:
            out[-1].checkpoint_peers.extend(routes[rank].peers)
            out[-1].mirrors.extend(common_pb2.CheckpointMirror(stage=s, peer=p)
                                   for s, p in routes[rank].mirrors)
            out[-1].mirrors.extend(common_pb2.CheckpointMirror(stage=s, peer=p, pushed=True)
                                   for s, p in routes[rank].received)
            out[-1].checkpoint_pushes.extend(common_pb2.CheckpointMirror(stage=s, peer=p)
                                             for s, p in routes[rank].pushes)
    return out
