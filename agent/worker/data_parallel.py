"""Gradient averaging within a stage's data-parallel group, the two ways the paper compares.

Owns turning R replicas' gradients of one stage into their mean, identically on every
replica. Gradients are flattened into one contiguous buffer (one collective per step, not
one per tensor), then either

- `allreduce`: one `all_reduce(SUM)` of the whole buffer, or
- `sharded`: the paper's scatter-reduce + all-gather: the buffer is cut into R equal shards,
  `reduce_scatter_tensor` leaves replica k with the sum of shard k (each replica sends and
  receives (R-1)/R of the buffer), k averages it, and `all_gather` brings every replica the
  averaged shards. gloo (torch >= 2.6) implements both collectives natively; where a backend
  lacks `reduce_scatter_tensor`, each shard is `reduce`d to its owner instead, which moves
  the same bytes to the same places.

Averaging divides by R after summing, so with equal replica batch slices the result equals
the single-process gradient of the whole global batch.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)


class GradAverager:
    """Averages a stage's gradients over its data-parallel group."""

    def __init__(
        self, model: nn.Module, group: dist.ProcessGroup | None, ranks: list[int], mode: str
    ) -> None:
        if mode not in ("allreduce", "sharded"):
            raise ValueError(f"unknown dp mode {mode!r}; use 'allreduce' or 'sharded'")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.group, self.ranks, self.mode = group, ranks, mode
        self.size = len(ranks)
        self.numel = sum(p.numel() for p in self.params)
        self._reduce_scatter_ok = True

    def average_(self) -> float:
        """Replace every gradient by its group mean; returns seconds spent communicating."""
        if self.size == 1:
            return 0.0
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        assert all(g is not None for g in grads)
        flat = torch.cat([g.reshape(-1) for g in grads if g is not None])
        t0 = time.perf_counter()
        if self.mode == "allreduce":
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            flat.div_(self.size)
        else:
            flat = self._sharded(flat)
        seconds = time.perf_counter() - t0
        offset = 0
        for p in self.params:
            n = p.numel()
            assert p.grad is not None
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n
        return seconds

    def _sharded(self, flat: torch.Tensor) -> torch.Tensor:
        r = self.size
        shard = -(-flat.numel() // r)
        padded = torch.zeros(shard * r, dtype=flat.dtype, device=flat.device)
        padded[: flat.numel()] = flat
        mine = torch.empty(shard, dtype=flat.dtype, device=flat.device)
        me = self.ranks.index(dist.get_rank())
        if self._reduce_scatter_ok:
            try:
                dist.reduce_scatter_tensor(mine, padded, op=dist.ReduceOp.SUM, group=self.group)
            except (RuntimeError, NotImplementedError) as e:  # backend without it
                log.warning("reduce_scatter_tensor unavailable (%s); reducing to owners", e)
                self._reduce_scatter_ok = False
        if not self._reduce_scatter_ok:
            chunks = list(padded.chunk(r))
            works = [
                dist.reduce(chunks[k], dst=self.ranks[k], op=dist.ReduceOp.SUM,
                            group=self.group, async_op=True)
                for k in range(r)
            ]
            for w in works:
                assert w is not None
                w.wait()
            mine.copy_(chunks[me])
        mine.div_(r)
        out = list(padded.chunk(r))
        dist.all_gather(out, mine, group=self.group)
        return padded[: flat.numel()]
