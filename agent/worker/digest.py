"""A digest of a stage's weights, and who is the odd one out among its replicas' digests.

Owns the weights check of `--verify digest` and up: in synchronous training every replica of
a stage steps with the same averaged gradient (bit-identical on every replica, whichever dp
mode or codec: `data_parallel.py`), the same global norm and the same AdamW state, so their
weights stay bit-identical; with `--sync-every H` they are identical right after each outer
step (`outer.py` copies one anchor into every replica). A replica whose weights differ there
was corrupted (silent data corruption, a bit flip, a tampered worker).

The digest is BLAKE2b over the raw bytes of every parameter (and buffer) in order: a single
flipped bit changes it, which no sampled fingerprint promises. It is cut to 48 bits so that it
travels exact in one float64 (`world.World.dp_gather`). Its cost at gpt-mini size is in
docs/architecture.md; it runs every `dtfm.core.verify.DIGEST_EVERY` steps.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable

import torch

DIGEST_BITS = 48


def weights_digest(tensors: Iterable[torch.Tensor]) -> int:
    """BLAKE2b of the tensors' bytes, in order, as a 48-bit integer."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        h.update(flat.contiguous().view(torch.uint8).numpy())  # the buffer: no copy
    return int.from_bytes(h.digest(), "big") >> (64 - DIGEST_BITS)


def odd_ones(digests: list[int]) -> tuple[list[int], bool]:
    """(the indices whose digest differs from the majority's, whether a majority exists).

    All equal: ([], True). R >= 3 with a strict majority: the others. No strict majority (R =
    2 disagreeing, or a split vote): every index, and False (undecided)."""
    counts = Counter(digests)
    value, n = counts.most_common(1)[0]
    if n == len(digests):
        return [], True
    if 2 * n > len(digests):
        return [k for k, d in enumerate(digests) if d != value], True
    return list(range(len(digests))), False
