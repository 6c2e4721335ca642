"""One pipeline stage: a contiguous range of layers, plus the embedding and/or the head.

A stage is the unit a worker holds and checkpoints. Its parameter names carry global layer
indices (`layers.7.attn.qkv.weight`), so a stage's state dict means the same thing whatever
layout produced it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from agent.worker.model import EMBEDDING_INDEX, HEAD_INDEX, SpecLike, build_part


class Stage(nn.Module):
    """Layers [layer_begin, layer_end) of the model; `first`/`last` add embedding/head."""

    def __init__(self, spec: SpecLike, layer_begin: int, layer_end: int, seed: int) -> None:
        super().__init__()
        if not 0 <= layer_begin < layer_end <= spec.n_layers:
            raise ValueError(
                f"stage layer range [{layer_begin}, {layer_end}) is outside the model's "
                f"{spec.n_layers} layers"
            )
        self.layer_begin, self.layer_end = layer_begin, layer_end
        self.is_first = layer_begin == 0
        self.is_last = layer_end == spec.n_layers
        self.d_model, self.seq_len = spec.d_model, spec.seq_len
        self.embed = build_part(spec, EMBEDDING_INDEX, seed) if self.is_first else None
        self.layers = nn.ModuleDict(
            {str(i): build_part(spec, i, seed) for i in range(layer_begin, layer_end)}
        )
        self.head = build_part(spec, HEAD_INDEX, seed) if self.is_last else None

    def parts(self) -> dict[int, nn.Module]:
        """This stage's parts by part index (EMBEDDING_INDEX, layer, HEAD_INDEX), as
        `agent.worker.hfload` loads and saves them."""
        out: dict[int, nn.Module] = {int(i): layer for i, layer in self.layers.items()}
        if self.embed is not None:
            out[EMBEDDING_INDEX] = self.embed
        if self.head is not None:
            out[HEAD_INDEX] = self.head
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (first stage) or hidden states in; hidden states or logits (last) out."""
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.head is not None:
            x = self.head(x)
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the micro-batch (in fp32)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
