"""A gloo group's member addresses come from the store in one round trip, not two per member.

Four real processes join a gloo world on loopback through `GroupAddressStore` over a store
that counts the requests reaching it, and create a member-only group the way `world.join`
does. Without the hint gloo waits for and reads each member's key in turn (2 x 4 requests);
with it, one wait for all four keys and one multi-get. The group then carries an
all-reduce, so the addresses it got are the right ones.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from agent.worker.store import ForwardingStore, GroupAddressStore
from agent.worker.world import _member_group
from dtfm.rpc import free_port

WORLD = 4
TIMEOUT = timedelta(seconds=60)


class Counting(ForwardingStore):
    """Passes everything to the TCPStore and counts the waits and reads that reach it."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__(inner)
        self.waits, self.reads = 0, 0

    def get(self, key: str) -> bytes:
        self.reads += 1
        return self.inner.get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.reads += 1
        return self.inner.multi_get(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        self.waits += 1
        super().wait(keys, timeout)


def _rank(rank: int, port: int, batch: bool, results: dict[int, tuple[int, int, float]]) -> None:
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"  # the world connects nothing, as in world.join
    tcp = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, TIMEOUT)
    counting = Counting(tcp)
    store = GroupAddressStore(counting)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=TIMEOUT)
    del os.environ["TORCH_GLOO_LAZY_INIT"]
    waits, reads = counting.waits, counting.reads
    group = _member_group(list(range(WORLD)), TIMEOUT, store if batch else None)
    used = (counting.waits - waits, counting.reads - reads)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=group)
    results[rank] = (*used, float(t.item()))
    dist.destroy_process_group()


def _run(batch: bool) -> dict[int, tuple[int, int, float]]:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(free_port(), batch, results), nprocs=WORLD)
        return dict(results)


@pytest.mark.timeout(180)
def test_a_groups_addresses_arrive_in_one_wait_and_one_read() -> None:
    batched = _run(batch=True)
    assert all(v == (1, 1, 10.0) for v in batched.values()), batched
    plain = _run(batch=False)  # gloo on its own: a wait and a read per member
    assert all(v == (WORLD, WORLD, 10.0) for v in plain.values()), plain
