"""The optimizer step shared by every layout: AdamW, warmup + cosine LR, global clipping.

Clipping must use the norm of the whole model's gradient, not a stage's, or pipelined runs
would diverge from the single-process reference; so each stage's squared norm is sent to the
other stages of its pipeline (`world.pipeline_exchange`) and summed in stage order before any
stage scales its gradients.
"""

from __future__ import annotations

import math

import torch
from torch import nn

MIN_LR_FRACTION = 0.1


def lr_at(step: int, base_lr: float, warmup: int, total: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to 10% of `base_lr` at `total`."""
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    if total <= warmup:
        return base_lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    min_lr = base_lr * MIN_LR_FRACTION
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * progress))


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; matrices decay, biases and LayerNorm parameters do not (nanoGPT's rule)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)


def local_sq_norm(model: nn.Module) -> torch.Tensor:
    """Sum of squared gradient entries of this stage (fp32 scalar)."""
    squares = [p.grad.detach().float().pow(2).sum() for p in model.parameters()
               if p.grad is not None]
    if not squares:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack(squares).sum().cpu()  # one device sync, not one per tensor


def clip_(model: nn.Module, global_norm: float, max_norm: float) -> None:
    """Scale this stage's gradients by min(1, max_norm / global_norm)."""
    if max_norm <= 0:
        return
    coef = max_norm / (global_norm + 1e-6)
    if coef < 1.0:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
