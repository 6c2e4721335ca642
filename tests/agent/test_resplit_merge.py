"""Joining stage checkpoints of one layer split into a stage of another
(`agent.worker.checkpoint.merge_states`): every weight and every AdamW moment lands on the
parameter it belongs to, and pieces that do not belong together are refused.

In-process torch on gpt-tiny (no processes): two stages take one real optimizer step each,
their states are merged into one stage, and each tensor is compared with its source.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from agent.worker import lora
from agent.worker.checkpoint import Source, merge_states, optimizer_names
from agent.worker.optim import make_optimizer
from agent.worker.stage import Stage
from dtfm.core.presets import get_preset
from dtfm.core.spec import TrainConfig

SPEC = get_preset("gpt-tiny")


def trained(begin: int, end: int, cfg: TrainConfig | None = None
            ) -> tuple[Stage, torch.optim.Optimizer]:
    """A stage of layers [begin, end) after one AdamW step on a made-up loss; with a LoRA
    `cfg`, adapters on a frozen base (only they step)."""
    stage = Stage(SPEC, begin, end, seed=3)
    if cfg is not None:
        lora.apply(stage, SPEC, cfg)
    opt = make_optimizer(stage, 1e-3, 0.1)
    x = (torch.randint(0, SPEC.vocab_size, (2, SPEC.seq_len)) if begin == 0
         else torch.randn(2, SPEC.seq_len, SPEC.d_model))
    stage(x).float().pow(2).mean().backward()
    opt.step()
    return stage, opt


def saved(stage: Stage, opt: torch.optim.Optimizer, names: bool = True) -> dict[str, Any]:
    """What the worker's `_save` writes (before torch.save)."""
    state: dict[str, Any] = {
        "model": stage.state_dict(), "optimizer": opt.state_dict(),
        "data_position": {"epoch": 0, "index": 8},
        "layers": [stage.layer_begin, stage.layer_end]}
    if names:
        state["param_names"] = optimizer_names(stage, opt)
    return state


def unused(src: Source) -> list[str]:
    raise AssertionError(f"stage {src.stage}'s checkpoint lists its parameter names")


def per_name(opt: torch.optim.Optimizer, stage: Stage) -> dict[str, dict[str, torch.Tensor]]:
    return {name: opt.state[p] for name, p in stage.named_parameters()}


@pytest.mark.parametrize("listed", [True, False], ids=["param-names", "older-checkpoint"])
def test_two_stages_join_into_one(listed: bool) -> None:
    parts = [trained(0, 2), trained(2, 4)]
    srcs = [Source(0, (0, 2)), Source(1, (2, 4))]
    target = Stage(SPEC, 0, 4, seed=99)  # other weights: all must be overwritten
    opt = make_optimizer(target, 1e-3, 0.1)

    def rebuilt(src: Source) -> list[str]:  # what the worker does for older checkpoints
        old = Stage(SPEC, src.layers[0], src.layers[1], seed=0)
        return optimizer_names(old, make_optimizer(old, 1e-3, 0.1))

    merged = merge_states([saved(s, o, listed) for s, o in parts], srcs, target, opt, rebuilt)
    target.load_state_dict(merged["model"])
    opt.load_state_dict(merged["optimizer"])
    assert merged["data_position"] == {"epoch": 0, "index": 8}
    got = per_name(opt, target)
    for stage, old_opt in parts:
        want = per_name(old_opt, stage)
        for name, tensor in stage.state_dict().items():
            assert torch.equal(target.state_dict()[name], tensor), name
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(got[name][key], want[name][key]), (name, key)
    assert set(got) == {n for n, _ in target.named_parameters()}


def test_one_stage_splits_into_two() -> None:
    whole, whole_opt = trained(0, 4)
    for begin, end in ((0, 2), (2, 4)):
        target = Stage(SPEC, begin, end, seed=99)
        opt = make_optimizer(target, 1e-3, 0.1)
        merged = merge_states([saved(whole, whole_opt)], [Source(0, (0, 4))], target, opt,
                              unused)
        target.load_state_dict(merged["model"])
        opt.load_state_dict(merged["optimizer"])
        want = per_name(whole_opt, whole)
        for name, state in per_name(opt, target).items():
            assert torch.equal(state["exp_avg_sq"], want[name]["exp_avg_sq"]), name


def test_pieces_of_different_steps_or_missing_layers_are_refused() -> None:
    (a, a_opt), (b, b_opt) = trained(0, 2), trained(2, 4)
    target = Stage(SPEC, 0, 4, seed=99)
    opt = make_optimizer(target, 1e-3, 0.1)
    srcs = [Source(0, (0, 2)), Source(1, (2, 4))]
    later = saved(b, b_opt)
    later["data_position"] = {"epoch": 0, "index": 12}
    with pytest.raises(ValueError, match="disagree on the data position"):
        merge_states([saved(a, a_opt), later], srcs, target, opt, unused)
    with pytest.raises(ValueError, match="lack .* parameter"):
        merge_states([saved(a, a_opt)], srcs[:1], target, opt, unused)


def test_lora_pieces_join_by_their_layer_index_and_a_missing_layer_is_refused() -> None:
    """A LoRA checkpoint holds adapters under peft names (global layer index) and no base: each
    old stage's piece maps only the adapters it holds onto the new stage (`piece=True`), the
    frozen base is not asked for, every adapter and AdamW moment lands on its own layer, and
    a layer no piece holds is refused rather than left at its initial adapters."""
    cfg = TrainConfig(lora_rank=4, lora_alpha=8.0, seed=3)
    parts = [trained(0, 2, cfg), trained(2, 4, cfg)]
    srcs = [Source(0, (0, 2)), Source(1, (2, 4))]
    target = Stage(SPEC, 0, 4, seed=3)
    lora.apply(target, SPEC, cfg)
    opt = make_optimizer(target, 1e-3, 0.1)

    def piece(stage: Stage, old_opt: torch.optim.Optimizer) -> dict[str, Any]:
        """What the worker's `_save` writes and `_resume` reads back, for one old stage."""
        state = saved(stage, old_opt)
        state["model"] = lora.adapter_state(lora.adapter_tensors(stage, SPEC, cfg), target,
                                            SPEC, cfg, piece=True)
        return state

    merged = merge_states([piece(s, o) for s, o in parts], srcs, target, opt, unused)
    assert target.load_state_dict(merged["model"], strict=False).unexpected_keys == []
    opt.load_state_dict(merged["optimizer"])
    got = per_name(opt, target)
    for stage, old_opt in parts:
        for name, p in stage.named_parameters():
            if not p.requires_grad:
                continue
            assert torch.equal(target.get_parameter(name), p), name
            assert torch.equal(got[name]["exp_avg"], old_opt.state[p]["exp_avg"]), name
    stepped = {name for name, state in got.items() if state}  # the frozen base has no state
    assert stepped == {n for n, p in target.named_parameters() if p.requires_grad}
    with pytest.raises(ValueError, match="lack .* parameter"):
        merge_states([piece(*parts[0])], srcs[:1], target, opt, unused)
