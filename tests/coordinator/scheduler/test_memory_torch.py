"""The memory model (coordinator.scheduler.memory) equals what the torch worker really holds.

Parameter state: weights, gradients and AdamW's two moments after one real optimizer step are
16 bytes per parameter of `ModelSpec.stage_params` (12 with `--moments-dtype bf16`).
Activations: the bytes autograd saves for one micro-batch of a stage (counted with
saved-tensor hooks, parameters left out) equal `activation_bytes` in fp32 and under bf16
autocast.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agent.worker.optim import make_optimizer  # noqa: E402
from agent.worker.stage import Stage, lm_loss  # noqa: E402
from coordinator.scheduler.memory import (  # noqa: E402
    PARAM_STATE_BYTES,
    activation_bytes,
    param_state_bytes,
)
from dtfm.core.presets import get_preset  # noqa: E402
from dtfm.core.spec import ModelSpec  # noqa: E402


def _state_bytes(stage: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    tensors = [p for p in stage.parameters()] + [p.grad for p in stage.parameters()]
    for state in opt.state.values():
        tensors += [v for k, v in state.items() if k != "step"]  # step: one scalar per tensor
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("name", ["gpt-tiny", "qwen-like"])
@pytest.mark.parametrize("moments", ["fp32", "bf16"])
@pytest.mark.parametrize("begin,end", [(0, 2), (1, 3), (2, 4)])
def test_parameter_state_is_16_or_12_bytes_per_parameter(begin: int, end: int,
                                                          moments: str, name: str) -> None:
    spec = _spec(name)
    stage = Stage(spec, begin, end, seed=0)
    opt = make_optimizer(stage, lr=1e-3, weight_decay=0.1, moments_dtype=moments)
    x = (torch.randint(0, spec.vocab_size, (2, spec.seq_len)) if begin == 0
         else torch.randn(2, spec.seq_len, spec.d_model))
    out = stage(x)
    loss = lm_loss(out, torch.randint(0, spec.vocab_size, (2, spec.seq_len))) \
        if end == spec.n_layers else out.square().mean()
    loss.backward()
    opt.step()
    assert _state_bytes(stage, opt) == param_state_bytes(moments) * spec.stage_params(begin, end)
    assert param_state_bytes() == PARAM_STATE_BYTES


def saved_bytes(stage: torch.nn.Module, x: torch.Tensor, targets: torch.Tensor | None,
                 dtype: torch.dtype | None) -> int:
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    seen: dict[tuple[int, torch.dtype], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[(ptr, t.dtype)] = max(seen.get((ptr, t.dtype), 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = stage(x)
        if targets is not None:
            lm_loss(out, targets)
    return sum(seen.values())


# The Llama block with every option that changes a size: grouped-query attention, a head_dim
# that is not d_model / n_heads, q/k/v biases (Qwen2), an MLP width of its own.
QWEN_LIKE = ModelSpec("qwen-like", vocab_size=300, n_layers=4, d_model=48, n_heads=6,
                      seq_len=40, d_ff=136, arch="llama", n_kv_heads=2, head_dim=12,
                      qkv_bias=True, rope_theta=1e6, norm_eps=1e-6)


def _spec(name: str) -> ModelSpec:
    return QWEN_LIKE if name == QWEN_LIKE.name else get_preset(name)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-mini", "llama-tiny", QWEN_LIKE.name])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_activation_bytes_match_what_autograd_saves(name: str, dtype: str, where: str) -> None:
    spec = _spec(name)
    begin, end = {"first": (0, 2), "middle": (1, 3), "last": (2, spec.n_layers)}[where]
    sequences = 3
    ids = torch.randint(0, spec.vocab_size, (sequences, spec.seq_len))
    x = ids if begin == 0 else torch.randn(sequences, spec.seq_len, spec.d_model,
                                           requires_grad=True)
    targets = ids if end == spec.n_layers else None
    measured = saved_bytes(Stage(spec, begin, end, seed=0), x, targets,
                            torch.bfloat16 if dtype == "bf16" else None)
    assert activation_bytes(spec, begin, end, sequences, dtype) == pytest.approx(measured,
                                                                                  rel=0.01)
