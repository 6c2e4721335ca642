"""A rank running the worker's exact communication ops, over gloo or the dtfm transport.

Used by test_transport.py and bench/transport.py (spawned as real processes). 2 stages x 2
replicas: rank = replica * 2 + stage; pipelines [0, 1] and [2, 3], data-parallel groups
[0, 2] and [1, 3]. Writes what every op produced to `out` (torch.save).
"""

from __future__ import annotations

import faulthandler
from datetime import timedelta

import torch
import torch.distributed as dist

from agent.worker.transport import TransportConfig, mesh, register

TIMEOUT = timedelta(seconds=60)


def init(backend: str, rank: int, world: int, port: int, cfg: TransportConfig | None) -> None:
    if backend == "gloo":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=TIMEOUT)
    else:
        register()
        dist.init_process_group("dtfm", store=dist.HashStore(), rank=rank, world_size=world,
                                timeout=TIMEOUT, pg_options=cfg)


def _sent_bytes(backend: str) -> int:
    m = mesh() if backend == "dtfm" else None
    return 0 if m is None else int(m.stats()["sent_bytes"])


def run(rank: int, backend: str, port: int, cfg: TransportConfig | None, out: str) -> None:
    faulthandler.dump_traceback_later(100, exit=True)
    init(backend, rank, 4, port, cfg)
    stage, replica = rank % 2, rank // 2
    pipeline = [replica * 2, replica * 2 + 1]
    pipe = dist.new_group(pipeline, timeout=TIMEOUT, use_local_synchronization=True)
    dp = dist.new_group([stage, stage + 2], timeout=TIMEOUT, use_local_synchronization=True)
    gen = torch.Generator().manual_seed(10 + rank)
    res: dict[str, torch.Tensor] = {}
    peer = pipeline[1 - stage]
    # pipeline: activations forward (TAG 1, float32 and bfloat16), gradients back (TAG 2),
    # the per-step scalar exchange both ways (TAG 3, float64); receives posted first
    act = torch.empty(2, 3, 5)
    act16 = torch.empty(4, 8, dtype=torch.bfloat16)
    grad = torch.empty(2, 3, 5)
    exch = torch.empty(3, dtype=torch.float64)
    works = [dist.irecv(exch, src=peer, group=pipe, tag=3)]
    if stage == 1:
        works += [dist.irecv(act, src=peer, group=pipe, tag=1),
                  dist.irecv(act16, src=peer, group=pipe, tag=1)]
    else:
        works += [dist.irecv(grad, src=peer, group=pipe, tag=2)]
    mine = torch.randn(3, dtype=torch.float64, generator=gen)
    works.append(dist.isend(mine, dst=peer, group=pipe, tag=3))
    if stage == 0:
        works += [dist.isend(torch.randn(2, 3, 5, generator=gen), dst=peer, group=pipe, tag=1),
                  dist.isend(torch.randn(4, 8, generator=gen).bfloat16(), dst=peer, group=pipe,
                             tag=1)]
    else:
        works.append(dist.isend(torch.randn(2, 3, 5, generator=gen), dst=peer, group=pipe,
                                tag=2))
    for w in works:
        w.wait(timedelta(seconds=30))
    res.update(exch=exch, act=act if stage == 1 else grad, act16=act16 if stage == 1 else grad)
    # data-parallel: async SUM of a gradient bucket (float32, 1 MiB and a small one), MIN int64
    big = torch.randn(1 << 18, generator=gen)
    small = torch.randn(1000, generator=gen)
    lo = torch.tensor([100 - rank], dtype=torch.int64)
    ws = [dist.all_reduce(t, op=op, group=dp, async_op=True)
          for t, op in ((big, dist.ReduceOp.SUM), (small, dist.ReduceOp.SUM),
                        (lo, dist.ReduceOp.MIN))]
    for w in ws:
        assert w is not None
        w.wait(timedelta(seconds=30))
    res.update(dp_big=big, dp_small=small, dp_min=lo)
    # the world: SUM of exactly representable values and of random ones, MAX, then a barrier
    exact = torch.arange(64, dtype=torch.float32) * (rank + 1) / 4
    rand = torch.randn(4096, generator=gen)
    hi = torch.tensor([rank * 1.5], dtype=torch.float64)
    for t, op in ((exact, dist.ReduceOp.SUM), (rand, dist.ReduceOp.SUM),
                  (hi, dist.ReduceOp.MAX)):
        w = dist.all_reduce(t, op=op, async_op=True)
        assert w is not None
        w.wait(timedelta(seconds=30))
    res.update(world_exact=exact, world_rand=rand, world_max=hi)
    # a gradient-bucket-sized world SUM (4 members, uneven slices): the dtfm backend
    # reduce-scatters and all-gathers it; its input is kept for the test's own reduction
    big_in = torch.randn(300_001, generator=gen)
    big = big_in.clone()
    sent = _sent_bytes(backend)
    dist.all_reduce(big)
    res.update(world_big_in=big_in, world_big=big)
    if backend == "dtfm":
        res["dtfm_world_big_sent"] = torch.tensor(_sent_bytes(backend) - sent)
    dist.barrier()
    torch.save(res, out)
    dist.destroy_process_group()


def run_strided(rank: int, backend: str, port: int, cfg: TransportConfig | None,
                out: str) -> None:
    """Strided views (a transpose, a column slice) sent, received into and all-reduced over
    the dtfm backend: they go through host copies (agent/worker/transport/staging.py), the
    same code a GPU tensor takes. Pairs (0, 1) and (2, 3) exchange; the world reduces a small
    view (one-hop exchange) and a large one (reduce-scatter + all-gather). Every value is an
    integer, so every sum is exact in any order."""
    faulthandler.dump_traceback_later(100, exit=True)
    init(backend, rank, 4, port, cfg)
    res: dict[str, torch.Tensor] = {}
    peer = rank ^ 1
    if rank % 2 == 0:
        base = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * rank
        half = (torch.arange(24, dtype=torch.float32).reshape(4, 6) - rank).bfloat16()
        sent = base.t()
        ws = [dist.isend(sent, dst=peer, tag=1), dist.isend(half[:, 1:4], dst=peer, tag=2)]
        sent.add_(1000)  # after the send was posted: a staged send carries the value it had
    else:
        into_t = torch.zeros(3, 4).t()
        wide = torch.zeros(4, 6, dtype=torch.bfloat16)
        ws = [dist.irecv(into_t, src=peer, tag=1), dist.irecv(wide[:, 1:4], src=peer, tag=2)]
        res.update(into_t=into_t, wide=wide)
    for w in ws:
        w.wait(timedelta(seconds=30))
    small = (torch.arange(20, dtype=torch.float32).reshape(4, 5) * (rank + 1)).t()
    large = (torch.arange(40_000, dtype=torch.float32).reshape(200, 200) * (rank + 1)).t()
    cols = torch.ones(8, 8)
    for t in (small, large, cols[:, ::2]):
        w = dist.all_reduce(t, async_op=True)
        assert w is not None
        w.wait(timedelta(seconds=30))
    res.update(small=small, large=large, cols=cols)
    dist.barrier()
    torch.save(res, out)
    dist.destroy_process_group()
