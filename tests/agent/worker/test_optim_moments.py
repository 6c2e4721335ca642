"""AdamW with bf16 moments (`--moments-dtype bf16`, agent/worker/optim.py).

What must hold: the arithmetic is torch's AdamW (with fp32 storage it is torch's to the bit,
chunked or not); with bf16 storage the moments really are bf16 and the weights stay close to
fp32 AdamW's over many steps; the default is torch's own AdamW, untouched; a checkpoint's
state round-trips at bf16 without being widened on load.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from agent.worker import optim
from agent.worker.optim import BF16MomentsAdamW, make_optimizer
from agent.worker.stage import Stage, lm_loss
from dtfm.core.presets import get_preset


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.LayerNorm(96), nn.Linear(96, 8))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    """`steps` updates on a fixed random regression task (the same batches for every run)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(32, 48, generator=gen)
        y = torch.randn(32, 8, generator=gen)
        opt.zero_grad(set_to_none=True)
        (model(x) - y).square().mean().backward()
        opt.step()


def _groups(model: nn.Module) -> list[dict]:
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


@pytest.mark.parametrize("chunk", [optim.CHUNK, 7])  # 7: many chunks, a ragged tail
def test_fp32_storage_is_torch_adamw_to_the_bit(monkeypatch: pytest.MonkeyPatch,
                                                chunk: int) -> None:
    monkeypatch.setattr(optim, "CHUNK", chunk)
    ref, ours = _model(), _model()
    _train(ref, make_optimizer(ref, 1e-2, 0.1), 20)
    _train(ours, BF16MomentsAdamW(_groups(ours), lr=1e-2, weight_decay=0.1,
                                  moments_dtype=torch.float32), 20)
    for a, b in zip(ref.parameters(), ours.parameters(), strict=True):
        assert torch.equal(a, b)


def test_default_is_torch_adamw_itself() -> None:
    opt = make_optimizer(_model(), 1e-3, 0.1)
    assert type(opt) is torch.optim.AdamW  # the equality tests' reference path, unchanged
    assert type(make_optimizer(_model(), 1e-3, 0.1, "bf16")) is BF16MomentsAdamW


def test_unknown_moments_dtype_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--moments-dtype must be one of fp32, bf16"):
        make_optimizer(_model(), 1e-3, 0.1, "fp16")


def test_bf16_moments_are_bf16_and_stay_close_to_fp32_adamw() -> None:
    ref, ours = _model(), _model()
    start = copy.deepcopy(ref)
    ref_opt, our_opt = make_optimizer(ref, 1e-2, 0.1), make_optimizer(ours, 1e-2, 0.1, "bf16")
    _train(ref, ref_opt, 50)
    _train(ours, our_opt, 50)
    for p in ours.parameters():
        state = our_opt.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        assert p.dtype == torch.float32 and state["step"].item() == 50
    for a, b, s in zip(ref.parameters(), ours.parameters(), start.parameters(), strict=True):
        moved = (a - s).norm()  # how far fp32 AdamW went in 50 steps
        assert moved > 0
        assert (a - b).norm() <= 0.02 * moved, "bf16 moments drifted from fp32 AdamW"
    assert not all(torch.equal(a, b) for a, b in zip(ref.parameters(), ours.parameters(),
                                                     strict=True)), "no rounding happened"


def test_bf16_moments_hold_half_the_bytes_on_a_real_stage() -> None:
    spec = get_preset("gpt-tiny")
    stage = Stage(spec, 0, spec.n_layers, seed=0)
    opt = make_optimizer(stage, 1e-3, 0.1, "bf16")
    ids = torch.randint(0, spec.vocab_size, (2, spec.seq_len))
    lm_loss(stage(ids), ids).backward()
    opt.step()
    moment_bytes = sum(v.numel() * v.element_size() for st in opt.state.values()
                       for k, v in st.items() if k in optim.MOMENTS)
    assert moment_bytes == 4 * spec.stage_params(0, spec.n_layers)  # 2 x bf16 per parameter


def test_state_dict_round_trip_keeps_bf16_and_continues_identically() -> None:
    a = _model()
    opt_a = make_optimizer(a, 1e-2, 0.1, "bf16")
    _train(a, opt_a, 5)
    saved = copy.deepcopy(opt_a.state_dict())
    assert all(st[k].dtype == torch.bfloat16 for st in saved["state"].values()
               for k in optim.MOMENTS)
    b = copy.deepcopy(a)
    opt_b = make_optimizer(b, 1e-2, 0.1, "bf16")
    opt_b.load_state_dict(saved)
    for p in b.parameters():
        assert opt_b.state[p]["exp_avg"].dtype == torch.bfloat16  # torch's load would widen it
    _train(a, opt_a, 5, seed=2)
    _train(b, opt_b, 5, seed=2)
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y)


def test_fp32_checkpoint_loads_into_bf16_moments_and_back() -> None:
    """Switching --moments-dtype between runs of a job: the state is cast, not refused."""
    a = _model()
    opt_a = make_optimizer(a, 1e-2, 0.1)
    _train(a, opt_a, 3)
    b = copy.deepcopy(a)
    opt_b = make_optimizer(b, 1e-2, 0.1, "bf16")
    opt_b.load_state_dict(opt_a.state_dict())
    first = next(b.parameters())
    assert opt_b.state[first]["exp_avg_sq"].dtype == torch.bfloat16
    assert torch.allclose(opt_b.state[first]["exp_avg_sq"].float(),
                          opt_a.state[next(a.parameters())]["exp_avg_sq"], rtol=1e-2)
    c = copy.deepcopy(b)
    opt_c = make_optimizer(c, 1e-2, 0.1)  # back to fp32: torch widens, as it always did
    opt_c.load_state_dict(opt_b.state_dict())
    assert opt_c.state[next(c.parameters())]["exp_avg"].dtype == torch.float32


@pytest.mark.timeout(150)
def test_a_worker_checkpoints_bf16_moments_and_resumes_exactly(tmp_path: Path) -> None:
    """Real workers (`agent local`, 2 stages, gloo): the checkpoint holds bf16 moments, and a
    run that crashed after it resumes to the uninterrupted run's losses."""
    from tests.agent.worker.test_resume import FLAGS
    from tests.agent.worker.testlib import assert_close, local_job_dir, run_local

    flags = (*FLAGS, "--moments-dtype", "bf16")
    full = run_local(*flags, "--checkpoint-dir", str(tmp_path / "full"))
    assert full.rc == 0, full.stderr
    saved = torch.load(local_job_dir(tmp_path / "full") / "stage-1" / "step-00000008.pt",
                       weights_only=True)
    moments = [st[k] for st in saved["optimizer"]["state"].values() for k in optim.MOMENTS]
    assert moments and all(m.dtype == torch.bfloat16 for m in moments)
    ckpt = tmp_path / "crashy"
    crashed = run_local(*flags, "--checkpoint-dir", str(ckpt), env={"DTFM_FAULT": "1:6"})
    assert crashed.rc != 0
    resumed = run_local(*flags, "--checkpoint-dir", str(ckpt))
    assert resumed.rc == 0, resumed.stderr
    assert [s["step"] for s in resumed.steps] == [5, 6, 7, 8]
    assert_close(resumed.losses, full.losses[4:], 1e-6)
