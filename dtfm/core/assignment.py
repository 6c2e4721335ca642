"""Builds the `Assignment` each worker receives: the one place a job becomes per-rank orders.

Both the coordinator (for agents it scheduled) and `agent local` (for workers on one machine)
call this, so a worker cannot tell who launched it and both paths are tested by the same tests.
"""

from __future__ import annotations

from collections.abc import Sequence

from dtfm.core.layout import Layout, layer_ranges, layer_splits
from dtfm.core.spec import ModelSpec, TrainConfig
from protos.dtfm.v1 import common_pb2


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
) -> list[common_pb2.Assignment]:
    """One assignment per rank, in rank order.

    `bind_addrs[rank]` is the address rank's agent advertises (its collectives bind there);
    without it every rank binds to `master_addr`, which is right only on one machine.
    """
    train.validate(layout.replicas)
    if bind_addrs is not None and len(bind_addrs) != layout.world_size:
        raise ValueError(f"{len(bind_addrs)} bind addresses for {layout.world_size} ranks")
    counts = layer_splits(spec.n_layers, layout.stages, splits)
    ranges = layer_ranges(spec.n_layers, layout.stages, counts)
    out = []
    for rank in range(layout.world_size):
        stage, replica = layout.coords(rank)
        prev_rank, next_rank = layout.prev_rank(rank), layout.next_rank(rank)
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
        ))
    return out
