"""The optimizer step shared by every layout: AdamW, warmup + cosine LR, global clipping.

Clipping must use the norm of the whole model's gradient, not a stage's, or pipelined runs
would diverge from the single-process reference; so each stage's squared norm is sent to the
other stages of its pipeline (`world.pipeline_exchange`) and summed in stage order before any
stage scales its gradients.

AdamW's two moments are 8 of the 16 bytes a parameter costs (fp32 weight, gradient, moments).
`--moments-dtype bf16` stores them in bf16 (`BF16MomentsAdamW`): each step widens a chunk of
them to fp32, updates it exactly as torch's AdamW does, and rounds only what it stores back, as
Megatron-core's `--exp-avg-dtype/--exp-avg-sq-dtype bf16` does. bf16 keeps fp32's exponent
range, so a tiny squared gradient does not underflow as it would in fp16; its 8-bit mantissa
is why the update is computed wide. With fp32 moments the optimizer is torch's own AdamW,
unchanged, so the equality tests against the single-process reference still hold bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

MIN_LR_FRACTION = 0.1
BETAS = (0.9, 0.95)
EPS = 1e-8
MOMENTS = ("exp_avg", "exp_avg_sq")
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Elements widened to fp32 at once: the scratch is a few of these (16 MiB each), not a copy
# of the largest tensor (gpt-1.3b's LM head alone is 103 M parameters, 412 MB in fp32).
CHUNK = 1 << 22


def lr_at(step: int, base_lr: float, warmup: int, total: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to 10% of `base_lr` at `total`."""
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    if total <= warmup:
        return base_lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    min_lr = base_lr * MIN_LR_FRACTION
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * progress))


def make_optimizer(model: nn.Module, lr: float, weight_decay: float,
                   moments_dtype: str = "fp32") -> torch.optim.AdamW:
    """AdamW; matrices decay, biases and LayerNorm parameters do not (nanoGPT's rule).

    `moments_dtype` "fp32" is torch's AdamW itself; "bf16" stores the moments in bf16."""
    trained = [p for p in model.parameters() if p.requires_grad]  # a frozen (LoRA) base: none
    decay = [p for p in trained if p.dim() >= 2]
    no_decay = [p for p in trained if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if moments_dtype not in MOMENT_DTYPES:
        raise ValueError(f"--moments-dtype must be one of {', '.join(MOMENT_DTYPES)}, "
                         f"got {moments_dtype!r}")
    if moments_dtype == "fp32":
        return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=EPS, foreach=False)
    return BF16MomentsAdamW(groups, lr=lr, weight_decay=weight_decay,
                            moments_dtype=MOMENT_DTYPES[moments_dtype])


class BF16MomentsAdamW(torch.optim.AdamW):
    """torch's AdamW (decoupled weight decay, bias correction, no amsgrad) whose `exp_avg` and
    `exp_avg_sq` are stored in `moments_dtype` between steps.

    The state has torch's keys and layout (`step` an fp32 scalar, the moments shaped like their
    parameter), so checkpoints, `checkpoint.merge_states` and a resume by another optimizer
    read it unchanged. `load_state_dict` keeps loaded moments at `moments_dtype`: torch's would
    cast them to the parameter's dtype, doubling them on every resume.
    """

    def __init__(self, params: Iterable[Any], *, lr: float, weight_decay: float,
                 moments_dtype: torch.dtype = torch.bfloat16,
                 betas: tuple[float, float] = BETAS, eps: float = EPS) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         foreach=False)
        self.moments_dtype = moments_dtype

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    for key in MOMENTS:
                        state[key] = torch.zeros_like(p, dtype=self.moments_dtype,
                                                      memory_format=torch.contiguous_format)
                state["step"] += 1
                adamw_update_(p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                              step=float(state["step"]), lr=float(group["lr"]),
                              betas=(float(beta1), float(beta2)), eps=float(group["eps"]),
                              weight_decay=float(group["weight_decay"]))
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch does, but put the moments in place at `moments_dtype` (a cast only
        when the checkpoint was written with other moments) instead of widening them."""
        moments: dict[Any, dict[str, torch.Tensor]] = {}
        rest: dict[Any, dict[str, Any]] = {}
        for index, per_param in state_dict["state"].items():
            moments[index] = {k: v for k, v in per_param.items() if k in MOMENTS}
            rest[index] = {k: v for k, v in per_param.items() if k not in MOMENTS}
        super().load_state_dict({**state_dict, "state": rest})
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for index, p in zip(ids, params, strict=True):
            for key, value in moments.get(index, {}).items():
                self.state[p][key] = value.to(device=p.device, dtype=self.moments_dtype)


def adamw_update_(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                  exp_avg_sq: torch.Tensor, *, step: float, lr: float,
                  betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """One AdamW update of `p` in place, with torch's arithmetic (`_single_tensor_adam`, not
    capturable), `CHUNK` elements at a time: each chunk of the moments is widened to fp32,
    updated, used, and rounded back into the (possibly bf16) moments. With fp32 moments the
    widening is no copy and the result is torch's to the bit (a test pins it)."""
    beta1, beta2 = betas
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    tensors = [p, grad, exp_avg, exp_avg_sq]
    chunk = max(p.numel(), 1)
    if all(t.is_contiguous() for t in tensors):  # else one piece: in place needs views
        tensors, chunk = [t.view(-1) for t in tensors], CHUNK
    for start in range(0, p.numel(), chunk):
        pc, gc, m_store, v_store = (t[start:start + chunk] if chunk < p.numel() else t
                                    for t in tensors)
        gc = gc.float()
        m, v = m_store.float(), v_store.float()
        if weight_decay != 0:
            pc.mul_(1 - lr * weight_decay)
        m.lerp_(gc, 1 - beta1)
        v.mul_(beta2).addcmul_(gc, gc, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        pc.addcdiv_(m, denom, value=-step_size)
        if m is not m_store:
            m_store.copy_(m)
            v_store.copy_(v)


@torch.no_grad()
def predict_step_(copies: Iterable[torch.Tensor], params: Iterable[torch.Tensor],
                  opt: torch.optim.Optimizer, lr: float) -> None:
    """Move `copies` (of `params`) by the AdamW step `opt` would take with its moments as
    they stand: where the next step, whose gradient is not in yet, will about leave them
    (SpecTrain's weight prediction; a parameter with no moments yet stays)."""
    group_of = {p: g for g in opt.param_groups for p in g["params"]}
    for t, p in zip(copies, params, strict=True):
        state = opt.state.get(p)
        if not state or "exp_avg" not in state:
            continue
        group = group_of[p]
        beta1, beta2 = group["betas"]
        step = float(state["step"])
        m = state["exp_avg"].float() / (1 - beta1 ** step)
        v = state["exp_avg_sq"].float() / (1 - beta2 ** step)
        t.mul_(1 - lr * group["weight_decay"])
        t.addcdiv_(m, v.sqrt_().add_(group["eps"]), value=-lr)


def local_sq_norm(model: nn.Module | Iterable[torch.Tensor]) -> torch.Tensor:
    """Sum of squared gradient entries of this stage, or of these tensors (fp32 scalar)."""
    params = model.parameters() if isinstance(model, nn.Module) else model
    squares = [p.grad.detach().float().pow(2).sum() for p in params if p.grad is not None]
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
