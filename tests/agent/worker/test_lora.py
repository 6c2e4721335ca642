"""LoRA on the worker: a frozen base, adapters as peft builds them, exact across layouts,
checkpoints of adapters only that resume exactly (real gloo processes via `agent local`)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from agent.worker import lora
from agent.worker.optim import make_optimizer
from agent.worker.stage import Stage
from dtfm.core import lora as spec_lora
from dtfm.core.presets import PRESETS
from dtfm.core.spec import TrainConfig
from tests.agent.worker.testlib import assert_close, assert_resumed, local_job_dir, run_local

LLAMA = PRESETS["llama-tiny"]
LORA = ("--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2")
COMMON = ("--model", "llama-tiny", "--batch", "8", "--steps", "20", "--seed", "1",
          "--eval-batches", "1", "--timeout", "60", "--micro-batches", "2", *LORA)
REL = 1e-4  # what tests/agent/worker/test_equality.py holds every layout to


def test_adapters_start_as_the_base_and_only_they_train() -> None:
    cfg = TrainConfig(lora_rank=4, lora_alpha=16.0, seed=3)
    base = Stage(LLAMA, 0, 2, seed=3)
    stage = Stage(LLAMA, 0, 2, seed=3)
    x = torch.randint(0, LLAMA.vocab_size, (2, 16))
    count = lora.apply(stage, LLAMA, cfg)
    assert count == spec_lora.stage_adapter_params(LLAMA, 0, 2, 4)  # the planner's count
    assert torch.equal(stage(x), base(x))  # B starts at zero: the base model exactly
    trained = [n for n, p in stage.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert sum(p.numel() for p in stage.parameters() if p.requires_grad) == count
    opt = make_optimizer(stage, 1e-3, 0.1)
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_opt == {id(p) for p in stage.parameters() if p.requires_grad}
    # A as peft's kaiming_uniform_(a=sqrt(5)): within 1/sqrt(in), the same in every layout
    a = stage.layers["1"].attn.q_proj.lora_A.weight
    assert a.abs().max() <= 1 / LLAMA.d_model ** 0.5 and a.abs().max() > 0
    again = Stage(LLAMA, 1, 3, seed=3)
    lora.apply(again, LLAMA, cfg)
    assert torch.equal(again.layers["1"].attn.q_proj.lora_A.weight, a)
    names = set(lora.adapter_tensors(stage, LLAMA, cfg))
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in names


@pytest.mark.timeout(300)
def test_lora_2x2_1f1b_matches_single_process() -> None:
    ref = run_local(*COMMON, "--stages", "1", "--replicas", "1")
    run = run_local(*COMMON, "--stages", "2", "--replicas", "2", "--schedule", "1f1b",
                    "--layer-splits", "3,1")
    for r in (ref, run):
        assert r.rc == 0, r.stderr
        assert [s["step"] for s in r.steps] == list(range(1, 21))
    assert_close(run.losses, ref.losses, REL)
    assert run.done is not None and ref.done is not None
    assert abs(run.done["val_loss"] - ref.done["val_loss"]) <= REL * ref.done["val_loss"]
    assert run.losses[-1] < run.losses[0] - 0.2  # the adapters learn (a random base)
    # the exchange the workers counted: every rank sends its stage's adapters once (fp32, a
    # two-member ring), so 2 x 4 bytes per adapter number of each stage, plus at most one
    # float64 scalar per rank (the replicas' shared figures), and no base weight
    adapters = 8 * sum(spec_lora.trained_params(LLAMA, a, b, 4) for a, b in ((0, 3), (3, 4)))
    assert 0 <= run.done["dp_bytes_per_step"] - adapters <= 4 * 8, (run.done, adapters)
    assert ref.done["dp_bytes_per_step"] == 0  # one replica exchanges nothing


@pytest.mark.timeout(200)
def test_lora_checkpoints_hold_adapters_only_and_resume_exactly(tmp_path: Path) -> None:
    flags = ("--model", "llama-tiny", "--stages", "2", "--replicas", "1", "--batch", "4",
             "--micro-batches", "2", "--steps", "8", "--checkpoint-every", "4", "--seed", "5",
             "--eval-batches", "1", "--timeout", "30", *LORA)
    full = run_local(*flags, "--checkpoint-dir", str(tmp_path / "full"))
    assert full.rc == 0, full.stderr
    ckpt = tmp_path / "crashy"
    crashed = run_local(*flags, "--checkpoint-dir", str(ckpt), env={"DTFM_FAULT": "1:6"})
    assert crashed.rc != 0
    with safe_open(str(local_job_dir(ckpt) / "stage-1" / "step-00000004.safetensors"),
                   "pt") as f:
        names = list(f.keys())
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names), names
    assert len(names) == 2 * 2 * 7  # layers 2 and 3: seven projections, A and B each
    assert_resumed(run_local(*flags, "--checkpoint-dir", str(ckpt)), full, after=4)


@pytest.mark.timeout(200)
def test_lora_bf16_holds_the_frozen_base_in_bf16_and_trains_fp32_adapters(
        tmp_path: Path) -> None:
    """--dtype bf16: each worker's frozen base (projections, embedding, norms, head) is bf16,
    the adapters fp32 (the worker logs its real tensors' dtypes), and the 2 x 1 run learns."""
    flags = ("--model", "llama-tiny", "--stages", "2", "--replicas", "1", "--batch", "4",
             "--micro-batches", "2", "--steps", "12", "--seed", "2", "--eval-batches", "1",
             "--timeout", "60", "--dtype", "bf16", "--workdir", str(tmp_path), *LORA)
    run = run_local(*flags, env={"DTFM_LOG_LEVEL": "INFO"})
    assert run.rc == 0, run.stderr[-3000:]
    logs = "".join(p.read_text() for p in sorted(tmp_path.rglob("*.log")))
    held = re.findall(r"rank (\d): LoRA adapters (\d+) bytes in (\S+), frozen base (\d+) "
                      r"bytes in (\S+)", logs)
    held = sorted({h[0]: h[1:] for h in held}.items())
    assert len(held) == 2, logs[-3000:]  # one line per stage
    held = [h for _, h in held]
    assert {(a, f) for _, a, _, f in held} == {("float32", "bfloat16")}
    for (begin, end), (_, _, frozen, _) in zip(((0, 2), (2, 4)), held, strict=True):
        assert int(frozen) == 2 * LLAMA.stage_params(begin, end)  # the planner's count, 2 B
    assert all(math.isfinite(x) for x in run.losses)
    assert run.losses[-1] < run.losses[0] - 0.2  # the adapters learn (a random base)
    assert run.done is not None and math.isfinite(run.done["val_loss"])
