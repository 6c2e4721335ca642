"""A LoRA job's export against `peft` and `transformers` themselves: tiny random Llama and
Qwen2 models saved by `transformers`, a 2 x 2 (1F1B) LoRA fine-tune by `agent local`, then

- the peft adapter directory `PeftModel.from_pretrained(base, DIR)` loads gives the
  validation loss dtfm computed, on the same windows;
- the merged export (`--export-merged`) gives the same loss under plain `transformers`;
- the base model's files are untouched.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from agent.worker.data import Sampler, val_batches
from dtfm.core.hfexport import StageFile
from tests.agent.worker.testlib import local_job_dir, run_local

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.hflib import byte_data, saved  # noqa: E402

SEQ, BATCH, EVAL = 32, 8, 2
REL = 1e-4


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _val_loss(model: torch.nn.Module, data: Path) -> float:
    """The mean next-token loss over the windows dtfm's evaluation takes (`val_batches`)."""
    tokens = np.fromfile(data / "val.bin", dtype=np.uint16)
    sampler = Sampler(tokens, SEQ, 0)
    losses = []
    with torch.no_grad():
        for ids in val_batches(tokens, SEQ, BATCH, EVAL):
            x, y = sampler.windows(ids)
            logits = model(input_ids=x).logits
            losses.append(float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                y.reshape(-1))))
    return sum(losses) / len(losses)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_lora_2x2_exports_load_in_peft_and_transformers_with_dtfms_loss(
        tmp_path: Path, kind: str) -> None:
    src, base_model = saved(tmp_path, kind)
    before = _digests(src)
    data = byte_data(tmp_path)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    merged_flag = kind == "qwen2"  # one kind exports each way through the flag
    run = run_local("--init-from", str(src), "--data", str(data), "--seq-len", str(SEQ),
                    "--steps", "12", "--lr", "1e-2", "--warmup-steps", "2", "--stages", "2",
                    "--replicas", "2", "--schedule", "1f1b", "--batch", str(BATCH),
                    "--micro-batches", "2", "--eval-batches", str(EVAL), "--lora-rank", "4",
                    "--lora-alpha", "8", "--checkpoint-dir", str(ckpt), "--export-dir", str(out),
                    *(["--export-merged"] if merged_flag else []), timeout=360)
    assert run.rc == 0, run.stderr[-3000:]
    assert run.done is not None
    dtfm_loss = run.done["val_loss"]
    assert _digests(src) == before  # the frozen base's files are untouched
    base_loss = _val_loss(base_model, data)
    assert abs(dtfm_loss - base_loss) > 1e-3, (dtfm_loss, base_loss)  # the adapters did learn

    # the other export, from the same checkpoints, through the same function agent local calls
    import argparse

    from agent.commands.local import add_arguments, train_config
    from agent.worker.loramerge import write_lora_export
    from dtfm.core.hfdir import resolve_spec
    from dtfm.core.hfexport import local_stage_files
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = train_config(parser.parse_args(["--init-from", str(src), "--seq-len", str(SEQ),
                                          "--lora-rank", "4", "--lora-alpha", "8"]))
    spec = resolve_spec("", str(src), SEQ)
    _, files = local_stage_files(ckpt, local_job_dir(ckpt).name, 2)
    other = tmp_path / "other"
    write_lora_export(other, spec, cfg, [StageFile(f.stage, f.path) for f in files],
                      merged=not merged_flag)
    adapter_dir, merged_dir = (other, out) if merged_flag else (out, other)
    _the_coordinators_merge_is_the_same(merged_dir, spec, cfg, [StageFile(f.stage, f.path)
                                                                for f in files], tmp_path)

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(src.absolute())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    fresh = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    with_adapters = peft.PeftModel.from_pretrained(fresh, adapter_dir).eval()
    peft_loss = _val_loss(with_adapters, data)
    assert abs(peft_loss - dtfm_loss) <= REL * dtfm_loss, (peft_loss, dtfm_loss)

    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    merged_loss = _val_loss(merged, data)
    assert abs(merged_loss - dtfm_loss) <= REL * dtfm_loss, (merged_loss, dtfm_loss)


@pytest.mark.timeout(300)
def test_qwen2_bf16_lora_merges_into_the_full_precision_base(tmp_path: Path) -> None:
    """A --dtype bf16 job holds its frozen base in bf16, yet the merged export is built on
    --init-from's fp32 base: every untargeted tensor is the base's bit for bit (no bf16
    rounding), every targeted one the base's plus a learned delta."""
    from safetensors.torch import load_file

    src, _ = saved(tmp_path, "qwen2")
    data, out = byte_data(tmp_path), tmp_path / "out"
    run = run_local("--init-from", str(src), "--data", str(data), "--seq-len", str(SEQ),
                    "--steps", "4", "--lr", "1e-2", "--stages", "1", "--replicas", "1",
                    "--batch", "4", "--eval-batches", "1", "--lora-rank", "4", "--dtype", "bf16",
                    "--checkpoint-dir", str(tmp_path / "ckpt"), "--export-dir", str(out),
                    "--export-merged", timeout=240)
    assert run.rc == 0, run.stderr[-3000:]
    base = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()}
    merged = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    base.setdefault("lm_head.weight", base["model.embed_tokens.weight"])  # tied in the base
    assert set(merged) == set(base)
    targeted = [k for k in base if k.endswith("proj.weight")]
    assert targeted
    for name, value in base.items():
        assert merged[name].dtype == value.dtype == torch.float32, name
        if name in targeted:
            assert not torch.equal(merged[name], value), name
        else:
            assert torch.equal(merged[name], value), name
    rounded = base["model.embed_tokens.weight"]
    assert not torch.equal(rounded.bfloat16().float(), rounded)  # the check could fail


def _the_coordinators_merge_is_the_same(merged_dir: Path, spec: object, cfg: object,
                                        files: list[StageFile], tmp_path: Path) -> None:
    """The torch-free coordinator merges in a child process (`dtfm.launcher.run_merge`); it
    writes exactly the tensors the in-process merge wrote, and a refusal in the child (a
    non-empty destination) is an ExportError here, with the child's message."""
    from safetensors.torch import load_file

    from dtfm.core.hfexport import ExportError
    from dtfm.core.mergerequest import MergeRequest
    from dtfm.launcher import run_merge

    said: list[str] = []
    work = tmp_path / "merge-work"
    work.mkdir()
    child = run_merge(MergeRequest(tmp_path / "child", spec, cfg, tuple(files)),  # type: ignore[arg-type]
                      work, said.append)
    assert child == (tmp_path / "child").absolute() and said

    def tensors(d: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    mine, theirs = tensors(child), tensors(merged_dir)
    assert set(mine) == set(theirs) and mine
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    with pytest.raises(ExportError, match="not empty|--force|exists"):
        run_merge(MergeRequest(child, spec, cfg, tuple(files)), work, said.append)  # type: ignore[arg-type]
