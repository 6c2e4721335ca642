"""Joining a job's world and the few groups it needs, in as few WAN round trips as possible.

Owns the worker's rendezvous: binding the backend to the right interface (`netbind`),
`init_process_group`, this rank's pipeline group, links and data-parallel group, and the
collectives that span the whole world (the per-step norm/loss exchange, the resume step,
the validation loss), built from those groups instead of world-wide collectives.

Over a 200 ms link every store round trip and every connection set-up is felt. Eager gloo
connects every pair of a group one after the other (a store lookup, a TCP handshake and
gloo's own, about 1 s per peer at 200 ms RTT), so a world of N costs N-1 of them on every
rank. Measured on the WAN emulator (8 ranks, 100 ms one way): 8.1 s to create the world and
the per-link groups. So:

- the world group is created with lazy gloo connections (`TORCH_GLOO_LAZY_INIT`) and never
  carries data, so it opens none. Lazy connections are *not* used for traffic: an all-pairs
  isend/irecv exchange over lazily connected pairs hung on the emulator (each rank blocks
  in the store lookup of one peer while that peer waits for another).
- a rank connects eagerly only to the peers it talks to: its pipeline (S-1 peers) and its
  stage's data-parallel group (R-1 peers), each group created by its members only
  (`use_local_synchronization=True`). gloo pipeline traffic rides the pipeline group with
  tags (see `schedule.py`). torch 2.13 names such a group by a hash of its ranks and of how
  many groups the process created before, so every rank creates exactly these two, first,
  in the same order (pipeline, then data-parallel): the counts agree among members.
- creating a gloo group, each member reads every member's address from the store, a wait
  and a read per member in turn (2 x size round trips to rank 0's host); the world's store
  (`store.GroupAddressStore`) is told each group's size and fetches all of them in one wait
  and one multi-get. Measured on the emulator (8 ranks, 4 x 2): groups 6.2 s -> 2.8 s.
- per step, the squared gradient norm and the loss go straight to every pipeline peer
  (isend/irecv: one hop) instead of a ring all-reduce over the world (2(N-1) hops).

When the assignment's backend is "dtfm" (some member cannot accept connections:
coordinator/job/dataplane.py), the world is the dtfm transport's (agent/worker/transport):
no store on rank 0 (a `HashStore` stands in; rank 0 may be behind a NAT too), the peer
table, relay and epoch secret come from the assignment's `data_plane` and stay in memory
(the assignment file is the agent's private 0600 file). Everything after `init_process_group`
(groups, links, isend/irecv, all_reduce) is the same path as gloo's.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from agent.worker import netbind
from agent.worker.deadline import Deadline
from agent.worker.errors import wait_all
from agent.worker.pipeline import Links, make_links
from agent.worker.store import GroupAddressStore, rendezvous_store
from agent.worker.transport import TransportConfig, register
from dtfm.core.assignment import member_address
from dtfm.core.layout import Layout
from dtfm.core.pairkeys import frames_name
from dtfm.net.dataplane import HANDOFF_ENV

log = logging.getLogger(__name__)

DTFM = "dtfm"  # the backend of agent/worker/transport
TAG_EXCHANGE = 3  # per-step scalars between the ranks of one pipeline
TAG_DP_GATHER = 4  # `dp_gather`'s rows between the replicas of one stage
ENV_GLOO_LAZY = "TORCH_GLOO_LAZY_INIT"


@dataclass
class Exchange:
    """A `pipeline_exchange`'s receives, posted: a buffer per peer rank and their works
    (with `start_exchange`'s sends among them once started)."""

    bufs: dict[int, torch.Tensor]
    works: list[Any]  # dist.Work (isend and irecv type them optional)
    own: list[float] = field(default_factory=list)  # this rank's values, once started
    sent: torch.Tensor | None = None  # what the sends read: alive until they are waited for


@dataclass
class World:
    """What joining produced: this rank's groups and its pipeline's ranks (by stage)."""

    links: Links
    pipe_group: dist.ProcessGroup | None  # None when S == 1
    dp_group: dist.ProcessGroup | None  # None when R == 1
    pipeline: list[int]
    rank: int
    device: torch.device
    deadline: Deadline  # how long each wait may block (the groups' own timeout is its ceiling)
    join_s: float = 0.0
    store: dist.Store | None = None  # the world's store (see join)

    def post_exchange(self, n: int) -> Exchange:
        """Post the receives of a `pipeline_exchange` of `n` values ahead of it: gloo sends
        only to a receiver it knows is ready, and that notice costs a one-way delay when it
        is posted with the sends (the training step posts at its start)."""
        bufs = {r: torch.empty(n, dtype=torch.float64, device=self.device)
                for r in self.pipeline if r != self.rank}
        return Exchange(bufs, [dist.irecv(buf, src=r, group=self.pipe_group, tag=TAG_EXCHANGE)
                               for r, buf in bufs.items()])

    def pipeline_exchange(self, values: list[float], posted: Exchange | None = None,
                          sent_scale: Sequence[float] | None = None) -> list[list[float]]:
        """Every pipeline rank's `values`, in stage order: one isend/irecv per peer, one hop
        (the receives from `posted`, when `post_exchange` posted them earlier). `sent_scale`
        multiplies what is sent, value by value, not this rank's own row: the fault seam's
        `corrupt` and `norm_lie` modes.

        float64 on the wire, so every rank holds the exact values each peer computed, and
        sums taken over the result in stage order are bitwise identical on every rank.
        """
        return self.finish_exchange(self.start_exchange(values, posted, sent_scale))

    def start_exchange(self, values: list[float], posted: Exchange | None = None,
                       sent_scale: Sequence[float] | None = None) -> Exchange:
        """`pipeline_exchange`'s sends, started: `finish_exchange` waits for it later, so a
        step that does not flush (`--pipeline-delay 1`) sends its norm as its gradients are
        complete and reads the table only when its update is due."""
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        if sent_scale is not None:
            mine = mine * torch.tensor(sent_scale, dtype=torch.float64, device=self.device)
        posted = posted or self.post_exchange(len(values))
        works = posted.works + [dist.isend(mine, dst=r, group=self.pipe_group, tag=TAG_EXCHANGE)
                                for r in posted.bufs]
        return Exchange(posted.bufs, works, values, mine)

    def finish_exchange(self, started: Exchange) -> list[list[float]]:
        """The table of a `start_exchange`, once every value has arrived (and been sent)."""
        self._wait(started.works, "exchange the gradient norm and loss with", self.pipeline)
        return [started.own if r == self.rank else started.bufs[r].tolist()
                for r in self.pipeline]

    def dp_all_reduce(self, value: float | int, op: dist.ReduceOp.RedOpType) -> float | int:
        """`value` reduced over this stage's data-parallel group (float64 or int64)."""
        dtype = torch.int64 if isinstance(value, int) else torch.float64
        t = torch.tensor([value], dtype=dtype, device=self.device)
        if self.dp_group is not None:
            work = dist.all_reduce(t, op=op, group=self.dp_group, async_op=True)
            assert work is not None
            self._wait([work], "reduce over its data-parallel group",
                       dist.get_process_group_ranks(self.dp_group))
        return t.item()

    def dp_gather(self, values: list[float]) -> list[list[float]]:
        """Every replica's `values` (the same length on each), in dp-group order, float64
        (integers below 2**53 arrive exact): each replica sends its own row to every other,
        one hop. Not a sum of one-hot rows: in an all-reduce every rank forwards partial
        sums of everyone's rows, so one bad replica could rewrite an honest one's weights
        digest or audit figures as every other replica reads them, and have it named for
        its own lie (`replicacheck.py`). Point to point, a replica can lie about its own
        row only."""
        return self.post_dp_gather(values).rows()

    def post_dp_gather(self, values: list[float]) -> Gathering:
        """`dp_gather` begun: its rows, `Gathering.rows()`, are read later (the weights
        digest's, a step later, so that its exchange overlaps training)."""
        if self.dp_group is None:
            return Gathering(self, [self.rank], list(values), {}, [])
        ranks = dist.get_process_group_ranks(self.dp_group)
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        bufs = {r: torch.empty(len(values), dtype=torch.float64, device=self.device)
                for r in ranks if r != self.rank}
        works = [dist.irecv(buf, src=r, group=self.dp_group, tag=TAG_DP_GATHER)
                 for r, buf in bufs.items()]
        works += [dist.isend(mine, dst=r, group=self.dp_group, tag=TAG_DP_GATHER)
                  for r in bufs]
        return Gathering(self, ranks, list(values), bufs, works, mine)

    def world_min(self, value: int) -> int:
        """The minimum over every rank: over the pipeline, then over the replicas."""
        lowest = min(int(row[0]) for row in self.pipeline_exchange([float(value)]))
        return int(self.dp_all_reduce(lowest, dist.ReduceOp.MIN))

    def _wait(self, works: list[dist.Work], what: str, peers: list[int]) -> None:
        wait_all(works, self.deadline, f"rank {self.rank}: {what} {peers}")


@dataclass
class Gathering:
    """A `World.post_dp_gather` in flight: the buffers it sends and receives stay alive
    until `rows` waits for them."""

    world: World
    ranks: list[int]
    values: list[float]
    bufs: dict[int, torch.Tensor]
    works: list[Any]  # dist.Work (isend and irecv type them optional)
    mine: torch.Tensor | None = None

    def rows(self) -> list[list[float]]:
        """Every replica's row, in dp-group order (waits for them)."""
        if self.works:
            self.world._wait(self.works, "gather over its data-parallel group", self.ranks)
            self.works = []
        return [list(self.values) if r == self.world.rank else self.bufs[r].tolist()
                for r in self.ranks]


def join(a: Any, layout: Layout, deadline: Deadline, device: torch.device) -> World:
    """Bind, rendezvous and create this rank's groups; logs how long it took.

    Joining blocks in the store and in group creation, not in a `Work.wait`, so it is bounded
    by the ceiling (`deadline.ceiling`, DTFM_TIMEOUT_S), which is also every group's own
    timeout: peers start at different times (an agent may first fetch a checkpoint).
    """
    timeout = deadline.ceiling
    backend = a.backend or "gloo"
    choice = netbind.choose(a.bind_addr, a.master_addr)
    netbind.apply(choice, backend)
    t0 = time.perf_counter()
    batch: GroupAddressStore | None = None
    if backend == DTFM:
        register()
        store: dist.Store = dist.HashStore()  # unused by dtfm: nobody dials rank 0's store
        dist.init_process_group(DTFM, store=store, rank=a.rank, world_size=a.world_size,
                                timeout=timeout,
                                pg_options=transport_config(a, choice, timeout))
    else:
        with _lazy_gloo():
            store = rendezvous_store(a.master_addr, a.master_port, a.rank, a.world_size,
                                     timeout)
            # gloo's address keys only; NCCL's store traffic is left exactly as torch does it
            if backend == "gloo":
                store = batch = GroupAddressStore(store)
            dist.init_process_group(backend, store=store, rank=a.rank,
                                    world_size=a.world_size, timeout=timeout)
    t1 = time.perf_counter()
    # Member-only groups first, in this order on every rank: their names count the groups
    # each process created before them, which must agree among members (see make_links).
    pipelines = [layout.pipeline_ranks(k) for k in range(layout.replicas)]
    pipeline = pipelines[a.replica]
    pipe_group = _member_group(pipeline, timeout, batch)
    t2 = time.perf_counter()
    dp_group = _member_group(layout.dp_ranks(a.stage), timeout, batch)
    links = make_links(pipelines, a.rank, backend, pipe_group, timeout)
    world = World(links, pipe_group, dp_group, pipeline, a.rank, device, deadline)
    world.store = store  # torch's groups use it through C++: it must outlive them
    world.join_s = time.perf_counter() - t0
    log.info(
        "joined world of %d in %.2f s (world %.2f s, groups %.2f s: pipeline %.2f s, "
        "data-parallel and links %.2f s; %s via %s)",
        a.world_size, world.join_s, t1 - t0, world.join_s - (t1 - t0), t2 - t1,
        world.join_s - (t2 - t0), backend,
        os.environ.get(netbind.GLOO_ENV, "the default interface") if backend != DTFM
        else "the assignment's peer table",
    )
    return world


def transport_config(a: Any, choice: netbind.BindChoice,
                     timeout: timedelta) -> TransportConfig:
    """The dtfm transport's view of the assignment: every rank's listen address ("" in the
    table: it only dials), the relay, the epoch's secret (in memory only); this rank listens
    on its advertised data port at a local address (`netbind.listen_host`)."""
    plane = a.data_plane
    if len(plane.listen) != a.world_size or not plane.secret:
        raise ValueError(f"the assignment's backend is dtfm but its data plane lists "
                         f"{len(plane.listen)} addresses for {a.world_size} ranks"
                         f"{'' if plane.secret else ' and no secret'}: the coordinator "
                         f"and agent disagree on the wire format (upgrade both)")
    if plane.relay.startswith(":"):
        raise ValueError(f"the data plane's relay {plane.relay!r} names no host: the agent "
                         f"puts in the coordinator's (agent/daemon/session.py); an older agent?")
    mine = plane.listen[a.rank]
    bind = None
    # the agent serves this rank's data plane on its gRPC port and hands the connections
    # over (dtfm/net/handoff.py); without it (--data-port) the rank listens itself
    handoff = (os.environ.get(HANDOFF_ENV) or None) if mine else None
    if mine and handoff is None:
        bind = member_address(netbind.listen_host(a.bind_addr, choice),
                              int(mine.rpartition(":")[2]))
    return TransportConfig(
        job=a.job_id, epoch=a.epoch, secret=plane.secret,
        peers={r: addr or None for r, addr in enumerate(plane.listen)},
        relay=plane.relay or None, bind=bind, handoff=handoff, timeout=timeout,
        hole_punch=plane.hole_punch,
        pair_relays={(min(p.rank_a, p.rank_b), max(p.rank_a, p.rank_b)): p.relay
                     for p in plane.pair_relays},
        limited=frozenset(plane.limited),
        direct=frozenset((d.dialer, d.listener) for d in plane.direct),
        frames=frames_name(plane.frames), pair_keys=dict(enumerate(plane.pair_keys)))


def _member_group(ranks: list[int], timeout: timedelta,
                  store: GroupAddressStore | None = None) -> dist.ProcessGroup | None:
    """A group created by its members only; with `store`, its members' addresses arrive in
    one store round trip instead of two per member (`GroupAddressStore`)."""
    if len(ranks) == 1:
        return None
    if store is not None:
        store.expect(len(ranks), sorted(ranks).index(dist.get_rank()))
    try:
        group = dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
    finally:
        if store is not None:
            store.expect(None)
    assert group is not None
    return group


@contextmanager
def _lazy_gloo() -> Iterator[None]:
    """Create the world group without connecting its pairs (it never carries traffic).

    An operator's own TORCH_GLOO_LAZY_INIT is left alone (and then applies to every group).
    """
    if ENV_GLOO_LAZY in os.environ:
        yield
        return
    os.environ[ENV_GLOO_LAZY] = "1"
    try:
        yield
    finally:
        del os.environ[ENV_GLOO_LAZY]
