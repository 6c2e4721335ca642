"""The planner prices a LoRA job as the worker runs it: the data-parallel exchange is the
adapters' real size (not the stage's parameters), the memory a frozen base (bf16 under
`--dtype bf16`, fp32 otherwise) plus the adapters' weight, gradient and AdamW state, and
`--sync-every auto` follows the smaller exchange (gpt-350m on the 16-device world: H = 8 for
full fine-tuning, 1 under LoRA rank 8)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from agent.worker import lora  # noqa: E402
from agent.worker.optim import make_optimizer  # noqa: E402
from agent.worker.stage import Stage, lm_loss  # noqa: E402
from coordinator.scheduler.costmodel import comm_gb  # noqa: E402
from coordinator.scheduler.memory import (  # noqa: E402
    WORKER_RUNTIME_BYTES,
    MemoryShape,
    activation_bytes,
    stage_bytes,
)
from coordinator.scheduler.steptime import step_shape  # noqa: E402
from dtfm.core.layout import layer_ranges  # noqa: E402
from dtfm.core.presets import get_preset  # noqa: E402
from dtfm.core.spec import TrainConfig  # noqa: E402


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("targets", ["", "q_proj,v_proj"])
def test_priced_exchange_is_the_adapters_real_size(name: str, targets: str) -> None:
    spec = get_preset(name)
    if spec.arch == "gpt" and targets:
        targets = "c_attn"
    cfg = TrainConfig(lora_rank=8, lora_targets=targets)
    shape = step_shape(spec, 2, 2, 8, 2, lora_rank=8, lora_targets=targets)
    real = []
    for begin, end in layer_ranges(spec.n_layers, 2):
        stage = Stage(spec, begin, end, seed=0)
        lora.apply(stage, spec, cfg)
        real.append(4 * sum(p.numel() for p in stage.parameters() if p.requires_grad))
    assert shape.grad_bytes == real  # fp32 gradients of the adapters, nothing else
    full = step_shape(spec, 2, 2, 8, 2)
    assert all(lo < hi / 5 for lo, hi in zip(shape.grad_bytes, full.grad_bytes, strict=True))
    dp_gb, _ = comm_gb(spec, 2, 2, 8, "fp32", 8, targets)
    assert dp_gb == max(real) / 1e9


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_priced_memory_is_a_frozen_base_plus_the_adapters_state(name: str, dtype: str) -> None:
    """Both stages' real tensors after one step: under bf16 the frozen base is bf16 (2 bytes
    per parameter), the adapters, their gradients and AdamW's moments fp32."""
    spec = get_preset(name)
    cfg = TrainConfig(lora_rank=8, dtype=dtype)
    stages = [Stage(spec, b, e, seed=0) for b, e in layer_ranges(spec.n_layers, 2)]
    opts = []
    for stage in stages:
        lora.apply(stage, spec, cfg)
        opts.append(make_optimizer(stage, 1e-3, 0.1))
    x = torch.randint(0, spec.vocab_size, (1, spec.seq_len))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        out = stages[1](stages[0](x))
    lm_loss(out, x).backward()
    shape = MemoryShape(spec, 2, 1, micro_size=1, micro_batches=0, dtype=dtype, lora_rank=8)
    for j, ((begin, end), stage, opt) in enumerate(
            zip(layer_ranges(spec.n_layers, 2), stages, opts, strict=True)):
        opt.step()
        tensors = list(stage.parameters()) + [p.grad for p in stage.parameters()
                                              if p.grad is not None]
        for state in opt.state.values():
            tensors += [v for k, v in state.items() if k != "step"]
        frozen = {p.dtype for p in stage.parameters() if not p.requires_grad}
        assert frozen == {torch.bfloat16 if dtype == "bf16" else torch.float32}
        assert {t.dtype for t in tensors} - frozen == ({torch.float32} if dtype == "bf16"
                                                       else set())
        real = sum(t.numel() * t.element_size() for t in tensors)
        assert stage_bytes(shape, j, begin, end) - WORKER_RUNTIME_BYTES == real, j
        full = MemoryShape(spec, 2, 1, micro_size=1, micro_batches=0, dtype=dtype)
        assert stage_bytes(full, j, begin, end) - WORKER_RUNTIME_BYTES > 2 * real  # r 8, d 64


def test_sync_auto_and_plan_follow_the_smaller_exchange(
        capsys: pytest.CaptureFixture[str]) -> None:
    from coordinator.commands import plan

    argv = ["--scenario", "world", "--per-city", "2", "--stages", "4", "--replicas", "4",
            "--model", "gpt-350m", "--sync-every", "auto", "--sync-overhead", "0.05",
            "--search-seconds", "1", "--json"]
    assert plan.main(argv) == 0
    full = json.loads(capsys.readouterr().out)
    assert plan.main([*argv, "--lora-rank", "8"]) == 0
    adapters = json.loads(capsys.readouterr().out)
    assert "LoRA rank 8" in adapters["sizes_from"]
    assert adapters["dp_gb"] < full["dp_gb"] / 100
    assert full["sync"]["every"] > 1 and adapters["sync"]["every"] == 1, (full["sync"],
                                                                          adapters["sync"])
    assert plan.main([*argv, "--lora-rank", "8", "--lora-targets", "c_fc,q_proj"]) == 2
    assert "'q_proj' names no module of a gpt layer" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("where", [(0, 2), (1, 3), (2, 4)])
def test_bf16_activations_hold_bf16_copies_of_the_adapters_only(name: str,
                                                                where: tuple[int, int]) -> None:
    """Under --dtype bf16 the frozen base is bf16 already: autocast casts (and the graph
    keeps) bf16 copies of the fp32 adapters alone. Priced with copies of every matmul weight,
    a LoRA stage's activations read 14-30 % high; now GPT's within 5 % of what autograd
    saves, and the Llama block's high by what a frozen projection does not keep (< 20 %)."""
    from tests.coordinator.scheduler.test_memory_torch import saved_bytes

    spec, (begin, end) = get_preset(name), where
    stage = Stage(spec, begin, end, seed=0)
    lora.apply(stage, spec, TrainConfig(lora_rank=8, dtype="bf16"))
    ids = torch.randint(0, spec.vocab_size, (3, spec.seq_len))
    x = ids if begin == 0 else torch.randn(3, spec.seq_len, spec.d_model, requires_grad=True)
    measured = saved_bytes(stage, x, ids if end == spec.n_layers else None, torch.bfloat16)
    priced = activation_bytes(spec, begin, end, 3, "bf16", lora_rank=8)
    if spec.arch == "gpt":
        assert priced == pytest.approx(measured, rel=0.05)
    else:
        assert measured < priced < 1.2 * measured
