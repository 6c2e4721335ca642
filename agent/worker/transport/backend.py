"""The dtfm transport as a `torch.distributed` backend ("dtfm"), so the worker keeps one path.

`register()` adds the backend (`Backend.register_backend`, extended API: torch hands each
group's name and global ranks to `_create`). A Python backend must subclass
`ProcessGroup` in torch 2.13 (`Backend` has no Python constructor); torch then uses the
returned object as the group itself. All groups of a process share one `Mesh` (one
connection per peer); a group's messages travel on its own stream id, derived from the group
name torch gives every member alike, so two groups never match each other's messages.

Implemented: what the worker uses (`isend`/`irecv` with tags, `all_reduce` with SUM, MIN,
MAX or PRODUCT, async or not, `barrier`, `new_group` with or without
`use_local_synchronization`, `destroy_process_group`). `all_reduce` of two members, or of
a tensor under `SPLIT_MIN_BYTES`, sends the tensor to every other member and each reduces
all of them in group-rank order: one hop of latency (what counts over a WAN); for two
members it is bitwise gloo's result. A larger one of n > 2 members reduce-scatters (member
i reduces slice i, in group-rank order) then all-gathers: two hops, 2(n-1)/n of the tensor
sent per member instead of n-1. Either way every member holds bitwise the same result.

Tensors may live on the GPU or be strided views: each message goes through a host copy
(`staging.py`), so a GPU job whose members cannot all accept connections trains on its GPUs
over this backend; a collective on a strided tensor runs on a contiguous copy, copied back.

The store torch requires is not used: a `dist.HashStore()` will do (no rank 0 to dial).
"""

from __future__ import annotations

import atexit
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _DistributedBackendOptions

from agent.worker.transport.config import TransportConfig
from agent.worker.transport.mesh import Mesh
from agent.worker.transport.work import TransportWork
from dtfm.net.dataplane import stream_id

NAME = "dtfm"
_mesh: Mesh | None = None
_lock = threading.Lock()
SPLIT_MIN_BYTES = 64 << 10  # smaller all_reduces take the one-hop exchange (latency counts)

_OPS = {
    dist.ReduceOp.SUM: torch.Tensor.add_,
    dist.ReduceOp.PRODUCT: torch.Tensor.mul_,
    dist.ReduceOp.MIN: lambda a, b: torch.minimum(a, b, out=a),
    dist.ReduceOp.MAX: lambda a, b: torch.maximum(a, b, out=a),
}


def register() -> None:
    """Make `init_process_group("dtfm", ...)` available (idempotent), and close the mesh at
    interpreter exit whether or not the world was destroyed (`Mesh.close` says why)."""
    if NAME.lower() not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, extended_api=True,
                                      devices=["cpu", "cuda"])
        atexit.register(close)


def close() -> None:
    """Stop this process's mesh, if any: its threads joined, its connections shut."""
    global _mesh
    with _lock:
        m, _mesh = _mesh, None
    if m is not None:
        m.close()


def mesh() -> Mesh | None:
    """This process's mesh (None before init_process_group): its stats for tests/benchmarks."""
    return _mesh


def _create(opts: _DistributedBackendOptions, options: Any) -> DtfmProcessGroup:
    global _mesh
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    with _lock:
        if not opts.global_ranks_in_group:  # the world: a new mesh
            cfg = options if isinstance(options, TransportConfig) else TransportConfig.from_env()
            if _mesh is not None:
                _mesh.close()
            cfg.timeout = opts.timeout
            _mesh = Mesh(cfg, ranks[opts.group_rank])
        elif _mesh is None:
            raise RuntimeError("a dtfm subgroup needs the dtfm world: init_process_group first")
        world = not opts.global_ranks_in_group
        return DtfmProcessGroup(_mesh, opts.group_rank, ranks, str(opts.group_id), world)


class DtfmProcessGroup(dist.ProcessGroup):
    """One group over the shared mesh: ranks are group ranks, mapped to global ones."""

    def __init__(self, mesh: Mesh, rank: int, ranks: list[int], name: str,
                 world: bool = False) -> None:
        super().__init__(rank, len(ranks))
        self._world = world  # the world group owns the mesh: its shutdown closes it
        self._mesh, self._ranks, self._name = mesh, ranks, name
        self._p2p = stream_id(name, collective=False)
        self._coll = stream_id(name, collective=True)
        self._seq = itertools.count()
        self._runner = ThreadPoolExecutor(1, thread_name_prefix=f"dtfm-coll-{name[:8]}")

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> TransportWork:
        return self._mesh.send(self._ranks[dst], self._p2p, tag, _one(tensors))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> TransportWork:
        return self._mesh.recv(self._ranks[src], self._p2p, tag, _one(tensors))

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> TransportWork:
        t = _one(tensors)
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        fn = next((f for o, f in _OPS.items() if op == o), None)
        if fn is None:
            raise ValueError(f"the dtfm backend reduces with SUM, PRODUCT, MIN or MAX: got {op}")
        return self._collective(t, fn)

    def barrier(self, opts: Any = None) -> TransportWork:
        return self._collective(torch.zeros(1), torch.Tensor.add_)

    def _collective(self, t: torch.Tensor, fn: Any) -> TransportWork:
        """Reduce `t` over the group on one thread per group (collectives finish in the order
        they were called, as members expect). Every element is reduced in group-rank order by
        exactly one computation whose result every member receives, so all members hold
        bitwise the same tensor.

        Receives are posted before anything else and `t` itself is sent (no copy): a member
        that posts late finds the message in the mailbox and pays an extra copy, and every
        fresh 16 MiB buffer costs page faults; those copies, not the network, were what made
        this 12x slower than gloo (docs/benchmarks.md, the transport section)."""
        seq = next(self._seq)
        work = TransportWork(self._mesh.cfg.timeout, f"all_reduce #{seq} over ranks "
                             f"{self._ranks}", [t], stalled=self._mesh.reconnecting)
        n = self.size()
        dense = t if t.is_contiguous() else t.contiguous()  # a strided view: reduce a copy
        if n > 2 and dense.numel() * dense.element_size() >= SPLIT_MIN_BYTES:
            step = self._scatter_gather(dense.view(-1), fn, seq)
        else:
            step = self._exchange(dense, fn, seq)

        def finish() -> None:
            try:
                step()
                if dense is not t:
                    with torch.no_grad():
                        t.copy_(dense)
            except BaseException as exc:  # noqa: BLE001 - the waiter hears why
                work.finish(exc)
                return
            work.finish()

        self._runner.submit(finish)
        return work

    def _exchange(self, t: torch.Tensor, fn: Any, seq: int) -> Any:
        """One hop: `t` to every member, each reduces all of them (n-1 tensors sent)."""
        me, tag = self.rank(), 2 * seq
        parts = [t if i == me else torch.empty_like(t) for i in range(self.size())]
        works = [self._mesh.recv(r, self._coll, tag, parts[i])
                 for i, r in enumerate(self._ranks) if i != me]
        works += [self._mesh.send(r, self._coll, tag, t)
                  for i, r in enumerate(self._ranks) if i != me]

        def step() -> None:
            for w in works:
                w.wait()
            _reduce_into(t, parts, fn)
        return step

    def _scatter_gather(self, flat: torch.Tensor, fn: Any, seq: int) -> Any:
        """Reduce-scatter then all-gather: member i reduces the i-th of n slices and sends
        the result to every other member, 2(n-1)/n tensors sent instead of n-1, two hops.

        The all-gather's receives are posted now, straight into `flat`'s slices: member j
        sends its reduced slice j only after it received all of this member's slice j, so
        this member's send of that slice no longer reads it when the result lands there."""
        me, n = self.rank(), self.size()
        slices = list(torch.tensor_split(flat, n))
        own = slices[me]
        parts = [own if i == me else torch.empty_like(own) for i in range(n)]
        peers = [(i, r) for i, r in enumerate(self._ranks) if i != me]
        works = [self._mesh.recv(r, self._coll, 2 * seq, parts[i]) for i, r in peers]
        gathered = [self._mesh.recv(r, self._coll, 2 * seq + 1, slices[i]) for i, r in peers]
        works += [self._mesh.send(r, self._coll, 2 * seq, slices[i]) for i, r in peers]

        def step() -> None:
            for w in works:
                w.wait()
            _reduce_into(own, parts, fn)
            sent = [self._mesh.send(r, self._coll, 2 * seq + 1, own) for _, r in peers]
            for w in gathered + sent:
                w.wait()
        return step

    def shutdown(self) -> None:
        global _mesh
        self._runner.shutdown(wait=False)
        if not self._world:
            return
        with _lock:
            self._mesh.close()
            if _mesh is self._mesh:
                _mesh = None


def _reduce_into(out: torch.Tensor, parts: list[torch.Tensor], fn: Any) -> None:
    """`out` = parts[0] op parts[1] op ..., in this order; `out` is one of `parts` (this
    member's own), the others are receive buffers, free to be overwritten."""
    if parts[0] is out:
        for p in parts[1:]:
            fn(out, p)
        return
    acc = parts[0]
    for p in parts[1:]:
        fn(acc, p)
    out.copy_(acc)


def _one(tensors: list[torch.Tensor]) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"the dtfm backend takes one tensor per call: got {len(tensors)}")
    return tensors[0]
