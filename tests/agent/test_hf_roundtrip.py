"""Models in and out on one machine: `agent local --init-from DIR ... --export-dir OUT` on tiny
random GPT-2, Llama and Qwen2 models saved by `transformers` (nothing is downloaded).

- With `--steps 0` the export holds exactly the imported tensors (a tied checkpoint's head is
  its embedding, exported untied) and `AutoModelForCausalLM.from_pretrained` computes the
  same logits as the source model.
- A 2 stages x 2 replicas fine-tune from an import lowers the validation loss that
  `transformers` computes on `val.bin`, and the export loads.
- Bad input is refused before any worker starts, naming the flag or directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dtfm.core.tokenfiles import TokenMeta, write_meta
from tests.agent.worker.testlib import run_local

transformers = pytest.importorskip("transformers")

from tests.hflib import VOCAB, byte_data, exported_tensors, hf_val_loss, saved  # noqa: E402


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])
def test_steps_0_exports_the_imported_tensors_and_transformers_loads_them(
        tmp_path: Path, kind: str) -> None:
    src, model = saved(tmp_path, kind)
    out = tmp_path / "out"
    run = run_local("--init-from", str(src), "--steps", "0", "--stages", "2", "--replicas", "1",
                    "--batch", "2", "--micro-batches", "1", "--eval-batches", "0",
                    "--export-dir", str(out), timeout=240)
    assert run.rc == 0, run.stderr[-3000:]
    got = exported_tensors(out)
    source = load_file(src / "model.safetensors")
    for name, value in source.items():
        assert torch.equal(got[name], value), name
    embed = "transformer.wte.weight" if kind == "gpt2" else "model.embed_tokens.weight"
    assert torch.equal(got["lm_head.weight"], source.get("lm_head.weight", source[embed]))
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert not back.config.tie_word_embeddings
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_2x2_fine_tune_from_an_import_lowers_transformers_val_loss(tmp_path: Path) -> None:
    src, model = saved(tmp_path, "llama")
    data = byte_data(tmp_path)
    before = hf_val_loss(model, data)
    out = tmp_path / "out"
    run = run_local("--init-from", str(src), "--data", str(data), "--seq-len", "32",
                    "--steps", "30", "--lr", "3e-3", "--warmup-steps", "2", "--stages", "2",
                    "--replicas", "2", "--batch", "8", "--micro-batches", "2",
                    "--eval-batches", "1", "--export-dir", str(out), timeout=280)
    assert run.rc == 0, run.stderr[-3000:]
    assert len(run.steps) == 30
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    after = hf_val_loss(tuned, data)
    assert after < before - 0.3, (before, after)


def test_bad_input_is_refused_before_any_worker_starts(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    run = run_local("--init-from", str(empty), "--steps", "1", timeout=60)
    assert run.rc == 2 and "config.json" in run.stderr and str(empty) in run.stderr
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    run = run_local("--init-from", str(bert), "--steps", "1", timeout=60)
    assert run.rc == 2 and "BertForMaskedLM" in run.stderr and "LlamaForCausalLM" in run.stderr
    src, _ = saved(tmp_path, "gpt2")
    run = run_local("--init-from", str(src), "--model", "gpt-mini", "--steps", "1", timeout=60)
    assert run.rc == 2 and "--model gpt-mini disagrees with --init-from" in run.stderr
    data = byte_data(tmp_path)  # prepared with another tokenizer than the model's
    n = {split: (data / f"{split}.bin").stat().st_size // 2 for split in ("train", "val")}
    write_meta(data, TokenMeta("uint16", VOCAB, "ab" * 32, 0, "<eot>", 255, {"train": 1,
               "val": 1}, n, 0.1))
    (src / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    run = run_local("--init-from", str(src), "--data", str(data), "--steps", "1", timeout=60)
    assert run.rc == 2 and "another tokenizer than the model's" in run.stderr, run.stderr
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    run = run_local("--init-from", str(src), "--steps", "0", "--export-dir", str(full),
                    timeout=60)
    assert run.rc == 2 and "not empty" in run.stderr and "--force" in run.stderr
