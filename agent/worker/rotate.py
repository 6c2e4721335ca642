"""The int4h codec's two additions to int4: a block Hadamard rotation and stochastic rounding.

Owns the arithmetic that lets 4-bit pipeline messages keep activations with outlier channels
(3x less error than int4 on such messages; on Gaussian ones the two are equal, see
docs/benchmarks.md, "int4h"); the message format (scales, packed codes) stays
`compress.py`'s, byte for byte int4's.

- **Rotation.** A transformer's activations have a few outlier channels, tens of times the
  typical magnitude. Plain int4 scales each block of 128 values by its largest magnitude, so
  one outlier leaves the other 127 values on two or three of the fifteen levels. Multiplying
  each block by an orthogonal matrix that mixes all its values evenly (`H D`: a fixed random
  sign per position, then the normalised Walsh-Hadamard transform) spreads an outlier's
  energy over the whole block, whose largest magnitude then sits near the block's typical
  one. Rounding errors, uniform in the rotated basis, come back through the same orthogonal
  transform with the same energy, so the message's error shrinks with the scale (TAH-Quant,
  QuaRot). `H / sqrt(n)` is symmetric and orthogonal, its own inverse, so the receiver
  applies `D H`. The signs come from a fixed seed: both ends hold the same ones without a
  word exchanged. The transform is the fast one, `log2(TILE)` butterfly passes of adds and
  subtracts, which builds the rotation's matrix once per device; messages are then rotated by
  one matrix product, which on a CPU core is 9x faster than the seven butterfly passes (0.42
  against 3.7 s per GB, measured) and on a GPU a single kernel. A tile is one scale block
  (`TILE == BLOCK`), so every scale follows exactly the values one rotation mixed, and the
  wire format is int4's. A message whose length is not a
  multiple of the tile leaves its last, partial tile unrotated (plain int4 there).
- **Stochastic rounding** (gradients going back): rounding up with probability equal to the
  fraction, so a value's expected code is the value itself and the gradients that reach the
  earlier stages are unbiased, where rounding to nearest is biased per value. The noise is
  drawn from a generator seeded by the codec's seed and the message's key (step and
  micro-batch), so a run with a fixed seed repeats exactly, a resumed one included.
"""

from __future__ import annotations

import torch

from dtfm.core.codecs import BLOCK

TILE = BLOCK  # values per rotation: one scale block
_SIGN_SEED = 0x5EED_4A  # the fixed seed of the per-position signs (the same on every rank)
_matrices: dict[torch.device, torch.Tensor] = {}


def signs(device: torch.device) -> torch.Tensor:
    """The fixed +-1 of every position of a tile (float32, on `device`)."""
    g = torch.Generator().manual_seed(_SIGN_SEED)
    bits = torch.randint(0, 2, (TILE,), generator=g, dtype=torch.int64)
    return (bits * 2 - 1).float().to(device)


def hadamard(tiles: torch.Tensor) -> torch.Tensor:
    """`H x / sqrt(n)` of every row of `tiles` (m x n, n a power of two): the fast
    Walsh-Hadamard transform, one pass of sums and differences per bit of n."""
    m, n = tiles.shape
    y, h = tiles, 1
    while h < n:
        pairs = y.reshape(m, n // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(m, n) * (n ** -0.5)


def matrix(device: torch.device) -> torch.Tensor:
    """`(H D)^T = D H` (TILE x TILE, float32): a row of tiles times it is `rotate`, times its
    transpose `unrotate`. Built once per device by the fast transform of the identity."""
    if device not in _matrices:
        cpu = torch.device("cpu")
        _matrices[device] = (signs(cpu)[:, None] * hadamard(torch.eye(TILE))).to(device)
    return _matrices[device]


def _whole(flat: torch.Tensor) -> int:
    return flat.numel() - flat.numel() % TILE


def _apply(flat: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Every whole tile of `flat` times `m`, in float32 even inside autocast (a bf16 product
    would lose more than the 4-bit grid it feeds)."""
    whole = _whole(flat)
    with torch.autocast(flat.device.type, enabled=False):
        if whole == flat.numel():
            return (flat.view(-1, TILE) @ m).reshape(-1)
        out = flat.clone()
        if whole:
            out[:whole] = (flat[:whole].view(-1, TILE) @ m).reshape(-1)
        return out


def rotate(flat: torch.Tensor) -> torch.Tensor:
    """`H D` applied to every whole tile of a 1-D float32 tensor (the partial tail as it is)."""
    return _apply(flat, matrix(flat.device))


def unrotate(flat: torch.Tensor) -> torch.Tensor:
    """The inverse of `rotate`: `D H` on every whole tile."""
    return _apply(flat, matrix(flat.device).T)


def noise(shape: torch.Size, device: torch.device, seed: int, key: int) -> torch.Tensor:
    """Uniform [0, 1) noise for stochastic rounding, the same for the same (seed, key)."""
    g = torch.Generator(device=device)
    g.manual_seed(hash((seed, key)) % (1 << 63))  # ints' hashes are not salted
    return torch.rand(shape, generator=g, device=device)


def round_stochastic(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`floor(v + u)`: for u uniform in [0, 1), v rounded up with probability frac(v), so
    E[result] = v. Within -q..q whenever v is (floor(q + u) = q for u < 1)."""
    return torch.floor(v + u)
