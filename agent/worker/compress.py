"""Compressed messages: int8 / int4 / int3 block quantization, block top-k, error feedback.

Owns turning a float tensor into the bytes a slow link carries and back. Over the Internet a
step's time is the bytes on its slowest links, so pipeline activations and their gradients,
and data-parallel gradient shards, may travel compressed (`--pp-compress`, `--dp-compress`,
or chosen per link by the coordinator). The codecs' names and wire sizes are defined in
`dtfm.core.codecs` (the scheduler counts the same bytes without torch); this module is
their torch implementation, and a test pins every message to `Codec.wire_bytes`.

A message is one flat `uint8` tensor of a size the receiver knows in advance (gloo and NCCL
receive into a buffer of fixed size), laid out scales first so that every typed view is
aligned:

- int8 / int4: `[bf16 scale per block | int8 per element or two int4 per byte]`; a block's
  scale is its largest magnitude over 127 (or 7), values are rounded to nearest.
- int4h (pipeline only): int4's message of the blocks after a fixed Hadamard rotation
  (`rotate.py`), undone by the receiver. A message sent with a `key` (the pipeline's
  gradients going back) is rounded stochastically, with noise seeded by the codec's `seed`
  and the key, so it is unbiased and a seeded run repeats exactly; its scale is rounded up to
  the next bf16 so that no value needs clamping, which would bias it.
- int3 (data-parallel only): `[bf16 scale per block of 32 | eight 3-bit codes per three
  bytes]`; the scale is the block's largest magnitude and the codes index a fixed grid of
  eight levels, `+-INT3_LEVELS` times the scale: the 8-level Lloyd-Max quantizer of a normal
  distribution, divided by the expected largest magnitude of 32 normal values (2.35), so the
  levels are dense where most values are rather than evenly spread up to a rare maximum. On
  gpt-mini's gradients a message loses 0.029 of their energy (a uniform 8-level grid: 0.038;
  int4: 0.015), and training stays correspondingly closer to the exact run. The price: the top
  level is 0.92 of the scale, so a block's largest value loses up to 0.08 of it, which error
  feedback sends with the next message.
- top-k: `[bf16 scale per block | k positions per block (uint8) | k int8 values per block]`.

Error feedback (`ErrorFeedback`) sends `x + residual` and keeps what the message could not
carry for the next message of the same tensor, so the running sum of what was sent tracks the
running sum of the true values within one message's error, however many steps pass. It is
used where consecutive messages carry the same quantity: data-parallel gradients (step after
step, the same parameters). Pipeline messages carry different micro-batches each time, so a
residual from one would be noise in the next (AQ-SGD's feedback for activations keeps one
buffer per training example, which a run shorter than an epoch never revisits); they are
quantized directly, with rounding to nearest.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from agent.worker import rotate
from dtfm.core.codecs import (
    BLOCK,
    INT3_BLOCK,
    QUANT_BITS,
    SCALE_BYTES,
    TOPK_BLOCK,
    Codec,
    parse_codec,
)

_QMAX = {"int8": 127.0, "int4": 7.0}  # uniform grids: -qmax..qmax times the block's scale
# int3's grid (module docstring): the positive levels of the 8-level Lloyd-Max quantizer of a
# standard normal, over the expected largest magnitude of INT3_BLOCK = 32 standard normals,
# i.e. as fractions of the block's largest magnitude.
_LLOYD_MAX_8 = (0.2451, 0.7561, 1.3437, 2.1523)
_EXPECTED_MAX_OF_32 = 2.348
INT3_LEVELS = tuple(v / _EXPECTED_MAX_OF_32 for v in _LLOYD_MAX_8)
_INT3_GRID = torch.tensor([-v for v in reversed(INT3_LEVELS)] + list(INT3_LEVELS))  # by code
_INT3_EDGES = (_INT3_GRID[1:] + _INT3_GRID[:-1]) / 2  # midpoints between adjacent levels


class TensorCodec:
    """The torch side of one lossy `Codec`: `encode` to bytes, `decode` back to float32."""

    def __init__(self, codec: Codec, seed: int = 0) -> None:
        if codec.lossless:
            raise ValueError("'none' sends tensors as they are; it has no TensorCodec")
        self.codec = codec
        self.seed = seed  # int4h's stochastic rounding: noise from (seed, the message's key)

    @property
    def name(self) -> str:
        return self.codec.name

    def wire_bytes(self, n: int) -> int:
        return self.codec.wire_bytes(n)

    @torch.no_grad()
    def encode(self, x: torch.Tensor, key: int | None = None) -> torch.Tensor:
        """The message for `x` (any shape; flattened): a 1-D uint8 tensor of
        `wire_bytes(x.numel())` bytes on `x`'s device. int4h with a `key` (unique per message
        of this codec, e.g. from step and micro-batch) rounds stochastically; other codecs
        ignore it."""
        flat = x.detach().reshape(-1).float()
        if self.codec.kind == "topk":
            return _encode_topk(flat, self.codec.topk_per_block)
        if self.codec.kind == "int4h":
            return _encode_rotated(flat, None if key is None else (self.seed, key))
        return _encode_quant(flat, self.codec.kind)

    @torch.no_grad()
    def decode(self, msg: torch.Tensor, n: int) -> torch.Tensor:
        """The `n` float32 values a message of `encode` carries (1-D)."""
        if msg.numel() != self.wire_bytes(n):
            raise ValueError(f"a {self.name} message of {n} elements has {self.wire_bytes(n)} "
                             f"bytes, got {msg.numel()}")
        if self.codec.kind == "topk":
            return _decode_topk(msg, n, self.codec.topk_per_block)
        if self.codec.kind == "int4h":
            return rotate.unrotate(_decode_quant(msg, n, "int4"))
        return _decode_quant(msg, n, self.codec.kind)


def make_codec(name: str | Codec, seed: int = 0) -> TensorCodec | None:
    """The torch codec for a name from the assignment (`""` and `none`: None, send as is);
    `seed`: int4h's stochastic rounding (the job's seed and the rank)."""
    codec = name if isinstance(name, Codec) else parse_codec(name or "none")
    return None if codec.lossless else TensorCodec(codec, seed)


def _blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    pad = (-flat.numel()) % block
    return (F.pad(flat, (0, pad)) if pad else flat).view(-1, block)


def _scales(amax: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 scales for the wire, the float32 divisors both ends use: 1 for an all-zero block)."""
    scale = (amax / qmax).to(torch.bfloat16)
    s = scale.float()
    return scale, torch.where(s > 0, s, torch.ones_like(s))


def _split(msg: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 scales, the rest of the message) from a message that starts with scales.

    The scales as sent, zeros included: an all-zero block decodes to zeros whatever its codes
    say, which int3 needs (its grid has no zero level)."""
    head = blocks * SCALE_BYTES
    return msg[:head].view(torch.bfloat16).float(), msg[head:]


def _encode_quant(flat: torch.Tensor, kind: str) -> torch.Tensor:
    n = flat.numel()
    b = _blocks(flat, INT3_BLOCK if kind == "int3" else BLOCK)
    amax = b.abs().amax(dim=1)
    if kind == "int3":
        scale, s = _scales(amax, 1.0)
        t = b / s[:, None]
        # the nearest level's code is the number of midpoints below the value (counted by
        # comparisons: 5x faster than torch.bucketize on a CPU)
        codes = torch.zeros(t.shape, dtype=torch.uint8, device=t.device)
        for edge in _INT3_EDGES.tolist():
            codes += t > edge
        payload = _pack(codes.reshape(-1)[:n], 3, pad=0)
        return torch.cat([scale.view(torch.uint8), payload])
    qmax = _QMAX[kind]
    scale, s = _scales(amax, qmax)
    q = torch.round(b / s[:, None]).clamp_(-qmax, qmax).to(torch.int8).reshape(-1)[:n]
    return _message(scale, q, kind)


def _message(scale: torch.Tensor, q: torch.Tensor, kind: str) -> torch.Tensor:
    """int8 / int4: the bf16 scales, then the codes `q` (int8, -qmax..qmax) as bytes."""
    if kind == "int8":
        payload = q.view(torch.uint8)
    else:
        payload = _pack((q + 8).to(torch.uint8), 4, pad=8)  # 1..15; the pad is a zero
    return torch.cat([scale.view(torch.uint8), payload])


def _encode_rotated(flat: torch.Tensor, noise: tuple[int, int] | None) -> torch.Tensor:
    """int4's message of `rotate(flat)`: rounded to nearest, or with `noise` = (seed, key)
    stochastically under a scale rounded up (1 + 2^-7 covers bf16's rounding)."""
    if noise is None:
        return _encode_quant(rotate.rotate(flat), "int4")
    n = flat.numel()
    b = _blocks(rotate.rotate(flat), BLOCK)
    scale, s = _scales(b.abs().amax(dim=1) * (1.0 + 2.0 ** -7), _QMAX["int4"])
    u = rotate.noise(b.shape, b.device, *noise)
    q = rotate.round_stochastic(b / s[:, None], u).to(torch.int8).reshape(-1)[:n]
    return _message(scale, q, "int4")


def _group(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole number of bytes that `bits`-bit codes fill."""
    per = 8 // math.gcd(bits, 8)
    return per, per * bits // 8


def _pack(codes: torch.Tensor, bits: int, pad: int) -> torch.Tensor:
    """`bits`-bit codes (uint8) as bytes, the first code in the lowest bits, little-endian
    across the bytes of a group (int4: two codes a byte; int3: eight codes in three bytes).
    Exactly `ceil(n * bits / 8)` bytes: the last byte's unused bits hold `pad`, which the
    receiver drops."""
    n = codes.numel()
    per, nbytes = _group(bits)
    extra = (-n) % per
    if extra:
        codes = F.pad(codes, (0, extra), value=pad)
    if nbytes == 1:  # whole codes per byte: shift in uint8, no wider temporaries
        out = codes[0::per].clone()
        for i in range(1, per):
            out |= codes[i::per] << (bits * i)
        return out
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    words = (codes.view(-1, per).to(torch.int32) << shifts).sum(dim=1, dtype=torch.int32)
    byte_shifts = torch.arange(nbytes, device=codes.device, dtype=torch.int32) * 8
    out = ((words[:, None] >> byte_shifts) & 255).to(torch.uint8).reshape(-1)
    return out[: -(-n * bits // 8)]


def _unpack(payload: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The first `n` codes of `_pack`'s bytes (uint8 for whole codes per byte, else int32)."""
    per, nbytes = _group(bits)
    mask = (1 << bits) - 1
    if nbytes == 1:
        codes = torch.stack([(payload >> (bits * i)) & mask for i in range(per)], dim=1)
        return codes.reshape(-1)[:n]
    extra = (-payload.numel()) % nbytes
    if extra:
        payload = F.pad(payload, (0, extra))
    byte_shifts = torch.arange(nbytes, device=payload.device, dtype=torch.int32) * 8
    words = (payload.view(-1, nbytes).to(torch.int32) << byte_shifts).sum(dim=1,
                                                                         dtype=torch.int32)
    shifts = torch.arange(per, device=payload.device, dtype=torch.int32) * bits
    return ((words[:, None] >> shifts) & mask).reshape(-1)[:n]


def _decode_quant(msg: torch.Tensor, n: int, kind: str) -> torch.Tensor:
    block = INT3_BLOCK if kind == "int3" else BLOCK
    blocks = -(-n // block)
    s, payload = _split(msg, blocks)
    if kind == "int8":
        q = payload.view(torch.int8).float()
    elif kind == "int3":
        q = _INT3_GRID.to(msg.device)[_unpack(payload, 3, n).long()]
    else:
        q = _unpack(payload, QUANT_BITS[kind], n).float() - 8.0
    full = torch.zeros(blocks * block, dtype=torch.float32, device=msg.device)
    full[:n] = q
    return (full.view(blocks, block) * s[:, None]).reshape(-1)[:n]


def _encode_topk(flat: torch.Tensor, k: int) -> torch.Tensor:
    b = _blocks(flat, TOPK_BLOCK)
    mags, idx = b.abs().topk(k, dim=1)  # sorted: mags[:, 0] is the block's largest magnitude
    scale, s = _scales(mags[:, 0], 127.0)
    vals = torch.round(b.gather(1, idx) / s[:, None]).clamp_(-127, 127).to(torch.int8)
    return torch.cat([scale.view(torch.uint8), idx.to(torch.uint8).reshape(-1),
                      vals.view(torch.uint8).reshape(-1)])


def _decode_topk(msg: torch.Tensor, n: int, k: int) -> torch.Tensor:
    blocks = -(-n // TOPK_BLOCK)
    s, rest = _split(msg, blocks)
    idx = rest[: blocks * k].view(blocks, k).long()
    vals = rest[blocks * k :].view(torch.int8).view(blocks, k).float() * s[:, None]
    out = torch.zeros(blocks, TOPK_BLOCK, dtype=torch.float32, device=msg.device)
    out.scatter_(1, idx, vals)
    return out.reshape(-1)[:n]


class ErrorFeedback:
    """Compress one recurring tensor with error feedback (EF-SGD, as in CocktailSGD).

    Each call sends `x + residual` and keeps `residual = (x + residual) - decoded`, so after
    T messages `sum(decoded) = sum(x) - residual_T`: the running sums differ by one message's
    error, not T of them. Gradients are summed over steps by the optimizer's momentum, which
    is why this keeps training on track where plain 4-bit rounding would bias it."""

    def __init__(self, codec: TensorCodec) -> None:
        self.codec = codec
        self.residual: torch.Tensor | None = None

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(message, what the receiver will decode from it), for 1-D float `x`."""
        v = x.float() if self.residual is None else x.float() + self.residual
        msg = self.codec.encode(v)
        sent = self.codec.decode(msg, v.numel())
        self.residual = v - sent
        return msg, sent
