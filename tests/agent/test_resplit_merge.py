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

from agent.worker.checkpoint import Source, merge_states, optimizer_names
from agent.worker.optim import make_optimizer
from agent.worker.stage import Stage
from dtfm.core.presets import get_preset

SPEC = get_preset("gpt-tiny")


def trained(begin: int, end: int) -> tuple[Stage, torch.optim.Optimizer]:
    """A stage of layers [begin, end) after one AdamW step on a made-up loss."""
    stage = Stage(SPEC, begin, end, seed=3)
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
