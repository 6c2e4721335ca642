"""How a stage's gradients are cut for data-parallel averaging: bucket size and shard sizes.

The worker (`agent.worker.data_parallel`) and the step model
(`coordinator.scheduler.steptime`) must agree on both, so they live here, in plain Python.

- **Buckets.** A bucket's shards start travelling as soon as backward has filled it, and an
  owner sends a bucket's average as soon as every copy of it has arrived. With one bucket per
  stage the second hop waits for the whole first one; with several, the second hop of one
  bucket overlaps the first hop of the next, on other links. So a stage is cut into about
  `PIPELINE_BUCKETS` buckets, none smaller than `MIN_BUCKET_BYTES` (below that, per-message
  costs win) nor larger than `MAX_BUCKET_BYTES` (a large model has plenty of buckets).
- **Shards.** In the sharded exchange replica k owns shard k of every bucket: it receives
  every copy, sums them in replica order and sends the average back. Equal shards are the
  paper's; on a group whose links differ a replica with short, fast links to everyone should
  own more, and one far from everyone may own nothing (`coordinator.scheduler.dpshares`).
  An element's sum is over the replicas in replica order wherever it is owned, so shard sizes
  change no bit of the result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dtfm.core.words import counted

PIPELINE_BUCKETS = 8  # buckets per stage, so the exchange's two hops overlap
MIN_BUCKET_BYTES = 64 << 10
MAX_BUCKET_BYTES = 4 << 20


def dp_bucket_bytes(stage_grad_bytes: float) -> int:
    """Bucket size for a stage whose gradients take `stage_grad_bytes`."""
    return int(min(MAX_BUCKET_BYTES,
                   max(MIN_BUCKET_BYTES, math.ceil(stage_grad_bytes / PIPELINE_BUCKETS))))


def dp_bucket_count(stage_grad_bytes: float) -> int:
    """How many buckets of `dp_bucket_bytes` such a stage's gradients fill (at least one)."""
    return max(1, math.ceil(stage_grad_bytes / dp_bucket_bytes(stage_grad_bytes)))


def check_shares(shares: Sequence[float], replicas: int) -> list[float]:
    """`shares` as a list, or ValueError saying what is wrong with them."""
    out = [float(s) for s in shares]
    if len(out) != replicas:
        raise ValueError(f"{len(out)} data-parallel shares for {counted(replicas, 'replica')}")
    if not all(math.isfinite(s) and s >= 0 for s in out) or sum(out) <= 0:
        raise ValueError(f"data-parallel shares must be >= 0 with a positive sum, got {out}")
    return out


def shard_sizes(n: int, shares: Sequence[float]) -> list[int]:
    """Elements of each replica's shard of an `n`-element bucket, proportional to `shares`
    (largest remainder, ties to the lower replica): the same on every replica, since each
    computes it from the same numbers. A zero share owns nothing."""
    total = sum(shares)
    exact = [n * s / total for s in shares]
    sizes = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda k: (-(exact[k] - sizes[k]), k))
    for k in by_remainder[: n - sum(sizes)]:
        sizes[k] += 1
    return sizes
