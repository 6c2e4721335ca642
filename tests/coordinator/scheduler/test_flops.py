"""The compute model's FLOPs (`coordinator.scheduler.flops`) equal what torch really computes,
for full fine-tuning and under LoRA, where the frozen base needs no weight gradients: a LoRA
stage's backward costs about one forward, not two. The step model then gives a LoRA stage's
tasklet its real compute and splits it forward / backward by its own share.

torch's FLOP counter counts the matmuls (not CPU attention), so the attention term is taken
out by hand; the one thing the model leaves out is the first stage's layer-0 projections that
read the frozen embedding's output, whose input gradient torch skips (within 15 % on these
tiny stages of two layers; less the more layers a stage holds)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from agent.worker import lora  # noqa: E402
from agent.worker.stage import Stage, lm_loss  # noqa: E402
from coordinator.scheduler.compute import Workload, tasklet_seconds  # noqa: E402
from coordinator.scheduler.flops import (  # noqa: E402
    ATTENTION_FORWARD,
    FULL_FORWARD_SHARE,
    stage_flops,
    stage_flops_by_pass,
)
from coordinator.scheduler.steptime import step_shape  # noqa: E402
from dtfm.core.presets import get_preset  # noqa: E402
from dtfm.core.spec import TrainConfig  # noqa: E402


def _torch_flops(name: str, begin: int, end: int, rank: int, sequences: int) -> tuple[int, int]:
    """(forward, backward) matmul FLOPs torch counts for one micro-batch of the stage."""
    spec = get_preset(name)
    stage = Stage(spec, begin, end, seed=0)
    if rank:
        lora.apply(stage, spec, TrainConfig(lora_rank=rank))
    ids = torch.randint(0, spec.vocab_size, (sequences, spec.seq_len))
    x = ids if begin == 0 else torch.randn(sequences, spec.seq_len, spec.d_model,
                                           requires_grad=True)
    with FlopCounterMode(display=False) as fwd:
        out = stage(x)
        loss = lm_loss(out, ids) if end == spec.n_layers else out.square().mean()
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("rank", [0, 8])
@pytest.mark.parametrize("begin,end", [(0, 2), (1, 3), (2, 4)])
def test_stage_flops_are_what_torch_computes(name: str, rank: int, begin: int, end: int) -> None:
    spec = get_preset(name)
    tokens = 3 * spec.seq_len
    fwd, bwd = _torch_flops(name, begin, end, rank, 3)
    attention = tokens * (end - begin) * ATTENTION_FORWARD * spec.seq_len * spec.n_heads \
        * spec.head_size
    model = stage_flops_by_pass(spec, begin, end, tokens, rank)
    assert model.forward - attention == fwd
    if begin == 0 and rank:  # layer 0's first projections: no input gradient (left out)
        assert bwd < model.backward - 2 * attention <= 1.15 * bwd
    else:
        assert model.backward - 2 * attention == bwd


def test_a_frozen_base_makes_backward_about_one_forward() -> None:
    spec = get_preset("gpt-small")
    full = stage_flops_by_pass(spec, 2, 4, 1.0)
    adapters = stage_flops_by_pass(spec, 2, 4, 1.0, lora_rank=8)
    assert full.forward_share == pytest.approx(FULL_FORWARD_SHARE)
    # 4 of the 6 FLOPs per weight, attention's backward still twice its forward (gpt-small's
    # 256 tokens make attention a seventh of the work), the adapters' backward twice theirs
    assert 0.4 < adapters.forward_share < 0.5
    assert 2 / 3 < adapters.total / full.total < 0.8
    assert stage_flops(spec, 2, 4, 1.0, 8) == adapters.total


def test_the_step_model_prices_a_lora_stage_by_its_own_flops() -> None:
    """Before the fix a LoRA job's tasklets were priced at full fine-tuning's 6 FLOPs per
    weight and token, and split a third forward: 1.5x its compute before its workers report."""
    spec = get_preset("gpt-small")
    full = Workload(spec, 4, 2, 16, 4)
    adapters = Workload(spec, 4, 2, 16, 4, lora_rank=8)
    grid, flops = [[0, 1], [2, 3], [4, 5], [6, 7]], [1e10] * 8
    a = tasklet_seconds(adapters, grid, flops, None)
    f = tasklet_seconds(full, grid, flops, None)
    tokens = 2 * spec.seq_len  # a micro-batch: 16 / (2 replicas x 4 micro-batches)
    assert a[3, 0] == stage_flops(spec, 6, 8, tokens, 8) / 1e10
    assert (a / f).max() < 0.8
    shape = adapters.step_shape(None)
    assert len(shape.forward_share) == 4 and min(shape.forward_share) > 0.4
    assert shape.forward_of(0) == stage_flops_by_pass(spec, 0, 2, 1.0, 8).forward_share
    assert step_shape(spec, 4, 2, 16, 4).forward_of(3) == FULL_FORWARD_SHARE
