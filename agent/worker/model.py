"""The model whose sizes `dtfm.core.spec.ModelSpec` describes, split into pipeline-friendly parts.

Two blocks, chosen by `ModelSpec.arch`: dtfm's GPT (LayerNorm, learned positions, GELU MLP;
with `activation="gelu_tanh"` it is GPT-2) and the Llama family's (RMSNorm, rotary positions
with Llama 3's and linear scaling, SwiGLU MLP, grouped-query attention, optional q/k/v biases
for Qwen2). Each computes what its Hugging Face counterpart does, so a checkpoint loaded by
`agent/worker/hfload.py` gives the same logits (tests/agent/test_hf_models.py pins it).

The model is built from three kinds of parts (embedding, transformer block, head) so a stage
can hold any contiguous range of them. Every part is initialised from its own
`torch.Generator` seeded by (seed, part index), which is what makes every layout (1x1, 2x2,
uneven splits) build bit-identical weights: no part's initial values depend on which other
parts the process happens to hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dtfm.core.spec import ModelSpec

EMBEDDING_INDEX = -1
HEAD_INDEX = -2
INIT_STD = 0.02
# Weights that write into the residual stream: GPT-2's scaled init (std / sqrt(2 layers)).
RESIDUAL_OUTPUTS = ("attn.proj.weight", "mlp.proj.weight", "attn.o_proj.weight",
                    "mlp.down_proj.weight")
SpecLike = ModelSpec  # what every part is built from


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
                std = residual_std if name in RESIDUAL_OUTPUTS else INIT_STD
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)


def isinstance_norm(module: nn.Module, param_name: str) -> bool:
    owner = module.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else module
    return isinstance(owner, nn.LayerNorm | RMSNorm)


@dataclass
class KVCache:
    """One layer's keys and values of the positions seen so far (generation only)."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else int(self.k.shape[2])

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's keys and values; return all of them."""
        if self.k is not None and self.v is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """Causal attention of queries at positions past.. over keys at 0..; grouped-query where
    k and v have fewer heads than q."""
    gqa = k.shape[1] != q.shape[1]
    if past == 0 or q.shape[2] == 1:  # no cache, or one new token that sees every key
        return F.scaled_dot_product_attention(q, k, v, is_causal=past == 0, enable_gqa=gqa)
    t, s = q.shape[2], k.shape[2]
    mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=past)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class Embedding(nn.Module):
    """Token plus learned position embedding (first stage only)."""

    def __init__(self, spec: SpecLike) -> None:
        super().__init__()
        self.wte = nn.Embedding(spec.vocab_size, spec.d_model)
        self.wpe = nn.Embedding(spec.positions, spec.d_model)

    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Embed `tokens`, the first of which is at position `start`."""
        pos = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        return self.wte(tokens) + self.wpe(pos)[None]


class CausalSelfAttention(nn.Module):
    def __init__(self, spec: SpecLike) -> None:
        super().__init__()
        self.n_heads = spec.n_heads
        self.qkv = nn.Linear(spec.d_model, 3 * spec.d_model, bias=True)
        self.proj = nn.Linear(spec.d_model, spec.d_model, bias=True)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        shape = (b, t, self.n_heads, d // self.n_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            past = cache.length
            k, v = cache.extend(k, v)
            y = attend(q, k, v, past)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, spec: SpecLike) -> None:
        super().__init__()
        self.fc = nn.Linear(spec.d_model, spec.d_ff, bias=True)
        self.proj = nn.Linear(spec.d_ff, spec.d_model, bias=True)
        self.approximate = "tanh" if spec.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


def make_norm(spec: SpecLike) -> nn.Module:
    """The block's normalisation: LayerNorm (gpt) or RMSNorm (llama), with the spec's eps."""
    if spec.arch == "llama":
        return RMSNorm(spec.d_model, spec.norm_eps)
    return nn.LayerNorm(spec.d_model, eps=spec.norm_eps)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)); the norm, attention
    and MLP are the spec's arch's (`BLOCK_PIECES`)."""

    def __init__(self, spec: SpecLike) -> None:
        super().__init__()
        attn, mlp = BLOCK_PIECES[spec.arch]
        self.ln1 = make_norm(spec)
        self.attn = attn(spec)
        self.ln2 = make_norm(spec)
        self.mlp = mlp(spec)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache)
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final norm and the untied, bias-free LM head (last stage only)."""

    def __init__(self, spec: SpecLike) -> None:
        super().__init__()
        self.ln_f = make_norm(spec)
        self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


# --- the Llama family's block ---


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back before the weight (as Llama's)."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(spec: SpecLike, device: torch.device | None = None) -> torch.Tensor:
    """The rotary embedding's inverse frequencies (fp32, head_dim / 2), with the spec's
    scaling: `linear` divides them by the factor; `llama3` divides the low frequencies
    (wavelengths beyond original / low_freq_factor) by it and blends the middle band."""
    dim = spec.head_size
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv = 1.0 / (spec.rope_theta ** exponents)
    factor = spec.rope_factor
    if spec.rope_type == "linear":
        return inv / factor
    if spec.rope_type != "llama3":
        return inv
    low, high = spec.rope_low_freq_factor, spec.rope_high_freq_factor
    old = spec.rope_original_max_positions
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, blended, scaled)


def rope_tables(spec: SpecLike, start: int, length: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (length x head_dim) of positions start.. , in `dtype`."""
    pos = torch.arange(start, start + length, device=device).float()
    freqs = pos[:, None] * rope_inv_freq(spec, device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply the rotary embedding (the half-split layout Hugging Face's Llama uses)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaEmbedding(nn.Module):
    """Token embedding only: positions enter each layer's attention as rotations."""

    def __init__(self, spec: SpecLike) -> None:
        super().__init__()
        self.wte = nn.Embedding(spec.vocab_size, spec.d_model)

    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        return self.wte(tokens)


class LlamaAttention(nn.Module):
    """Grouped-query causal attention with rotary positions; q/k/v biases under `qkv_bias`."""

    def __init__(self, spec: SpecLike) -> None:
        super().__init__()
        self.spec = spec
        self.n_heads, self.kv_heads, self.head_dim = spec.n_heads, spec.kv_heads, spec.head_size
        d, bias = spec.d_model, spec.qkv_bias
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=False)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(b, t, self.n_heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, hd).transpose(1, 2)
        past = 0 if cache is None else cache.length
        cos, sin = rope_tables(self.spec, past, t, q.dtype, x.device)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is not None:
            k, v = cache.extend(k, v)
        y = attend(q, k, v, past)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * hd))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, spec: SpecLike) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.d_model, spec.d_ff, bias=False)
        self.up_proj = nn.Linear(spec.d_model, spec.d_ff, bias=False)
        self.down_proj = nn.Linear(spec.d_ff, spec.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


BLOCK_PIECES: dict[str, tuple[type[nn.Module], type[nn.Module]]] = {
    "gpt": (CausalSelfAttention, MLP),
    "llama": (LlamaAttention, SwiGLU),
}
PART_CLASSES: dict[str, tuple[type[nn.Module], type[nn.Module], type[nn.Module]]] = {
    "gpt": (Embedding, Block, Head),
    "llama": (LlamaEmbedding, Block, Head),
}


def make_part(spec: SpecLike, index: int) -> nn.Module:
    """One part, uninitialised (torch's defaults; under `torch.device("meta")`, no memory):
    for a caller that loads every parameter anyway."""
    embedding, block, head = PART_CLASSES[spec.arch]
    if index == EMBEDDING_INDEX:
        return embedding(spec)
    if index == HEAD_INDEX:
        return head(spec)
    if 0 <= index < spec.n_layers:
        return block(spec)
    raise ValueError(f"part index {index} is outside the model's {spec.n_layers} layers")


def build_part(spec: SpecLike, index: int, seed: int) -> nn.Module:
    """Build and deterministically initialise one part: a layer, the embedding or the head."""
    part = make_part(spec, index)
    _init_(part, part_generator(seed, index), INIT_STD / math.sqrt(2 * spec.n_layers))
    return part


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
