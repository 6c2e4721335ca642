"""The GPT whose sizes `dtfm.core.spec.ModelSpec` describes, split into pipeline-friendly parts.

The model is built from three kinds of parts (embedding, transformer block, head) so a stage
can hold any contiguous range of them. Every part is initialised from its own
`torch.Generator` seeded by (seed, part index), which is what makes every layout (1x1, 2x2,
uneven splits) build bit-identical weights: no part's initial values depend on which other
parts the process happens to hold.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

EMBEDDING_INDEX = -1
HEAD_INDEX = -2
INIT_STD = 0.02


class SpecLike(Protocol):
    """What the model needs from a spec (a `ModelSpec` or its proto message)."""

    vocab_size: int
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    d_ff: int


def part_generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator for part `index` (layer index, or EMBEDDING_INDEX / HEAD_INDEX)."""
    g = torch.Generator(device="cpu")
    # A fixed affine mix keeps (seed, index) pairs apart without Python's salted hash().
    g.manual_seed((int(seed) * 1_000_003 + (index + 7) * 7_919) % (2**63 - 1))
    return g


def _init_(module: nn.Module, gen: torch.Generator, residual_std: float) -> None:
    """Deterministic GPT-2 style init of every parameter of `module`, in definition order."""
    for name, p in module.named_parameters():
        with torch.no_grad():
            if isinstance_norm(module, name):
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                std = residual_std if name.endswith("proj.weight") else INIT_STD
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)


def isinstance_norm(module: nn.Module, param_name: str) -> bool:
    owner = module.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else module
    return isinstance(owner, nn.LayerNorm)


class Embedding(nn.Module):
    """Token plus learned position embedding (first stage only)."""

    def __init__(self, spec: SpecLike) -> None:
        super().__init__()
        self.wte = nn.Embedding(spec.vocab_size, spec.d_model)
        self.wpe = nn.Embedding(spec.seq_len, spec.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.wte(tokens) + self.wpe(pos)[None]


class CausalSelfAttention(nn.Module):
    def __init__(self, spec: SpecLike) -> None:
        super().__init__()
        self.n_heads = spec.n_heads
        self.qkv = nn.Linear(spec.d_model, 3 * spec.d_model, bias=True)
        self.proj = nn.Linear(spec.d_model, spec.d_model, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        shape = (b, t, self.n_heads, d // self.n_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, spec: SpecLike) -> None:
        super().__init__()
        self.fc = nn.Linear(spec.d_model, spec.d_ff, bias=True)
        self.proj = nn.Linear(spec.d_ff, spec.d_model, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, spec: SpecLike) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(spec.d_model)
        self.attn = CausalSelfAttention(spec)
        self.ln2 = nn.LayerNorm(spec.d_model)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm and the untied, bias-free LM head (last stage only)."""

    def __init__(self, spec: SpecLike) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(spec.d_model)
        self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def build_part(spec: SpecLike, index: int, seed: int) -> nn.Module:
    """Build and deterministically initialise one part: a layer, the embedding or the head."""
    part: nn.Module
    if index == EMBEDDING_INDEX:
        part = Embedding(spec)
    elif index == HEAD_INDEX:
        part = Head(spec)
    elif 0 <= index < spec.n_layers:
        part = Block(spec)
    else:
        raise ValueError(f"part index {index} is outside the model's {spec.n_layers} layers")
    _init_(part, part_generator(seed, index), INIT_STD / math.sqrt(2 * spec.n_layers))
    return part


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
