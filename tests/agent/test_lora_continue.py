"""`--init-from` a `peft` adapter directory continues its training: adapter_config.json names
the base (loaded as `--init-from BASE`), the adapters start from its weights, and the rank,
alpha and targets come from it; a flag that contradicts it is refused naming both.

The check that the adapters really start where the export left them: the continued run's
first training loss equals the exported adapter's loss under `peft` on the same batch (the
first batch of the seed's data order, which both runs draw).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from agent.worker.data import Sampler
from tests.agent.worker.testlib import run_local

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.hflib import agent_greedy, byte_data, hf_greedy, saved, val_prompt  # noqa: E402

SEQ, BATCH = 32, 4
COMMON = ("--seq-len", str(SEQ), "--stages", "2", "--replicas", "1", "--batch", str(BATCH),
          "--micro-batches", "1", "--eval-batches", "1", "--lr", "1e-2", "--warmup-steps", "1")


def _first_batch_loss(model: torch.nn.Module, data: Path, seed: int = 0) -> float:
    tokens = np.fromfile(data / "train.bin", dtype=np.uint16)
    sampler = Sampler(tokens, SEQ, seed)
    x, y = sampler.windows(sampler.next_global(BATCH))
    with torch.no_grad():
        logits = model(input_ids=x).logits
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)))


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A tiny Llama (its directory), byte data, and the peft adapter directory a 3-step
    2-stage LoRA run exported from it."""
    tmp = tmp_path_factory.mktemp("lora")
    src, _ = saved(tmp, "llama")
    data = byte_data(tmp)
    adapter = tmp / "adapter"
    first = run_local("--init-from", str(src), "--data", str(data), *COMMON, "--steps", "3",
                      "--lora-rank", "4", "--lora-alpha", "16", "--lora-targets",
                      "q_proj,v_proj,down_proj", "--checkpoint-dir", str(tmp / "c1"),
                      "--export-dir", str(adapter), timeout=200)
    assert first.rc == 0, first.stderr[-3000:]
    return src, data, adapter


@pytest.mark.timeout(300)
def test_an_exported_adapter_continues_from_exactly_its_weights(
        exported: tuple[Path, Path, Path]) -> None:
    src, data, adapter = exported
    fresh = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    want = _first_batch_loss(peft.PeftModel.from_pretrained(fresh, adapter).eval(), data)
    untrained = _first_batch_loss(transformers.AutoModelForCausalLM.from_pretrained(src).eval(),
                                  data)
    assert abs(want - untrained) > 1e-3, (want, untrained)  # the adapters did learn

    # no --lora-* flag: rank, alpha and targets come from adapter_config.json
    cont = run_local("--init-from", str(adapter), "--data", str(data), *COMMON, "--steps", "1",
                     timeout=200)
    assert cont.rc == 0, cont.stderr[-3000:]
    assert abs(cont.losses[0] - want) <= 1e-4 * want, (cont.losses[0], want)


@pytest.mark.timeout(300)
def test_generate_on_base_plus_adapter_equals_generate_on_the_merged_export(
        exported: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """`agent generate --model-dir ADAPTER_DIR` (the base its adapter_config.json names, the
    adapters merged in) gives the greedy ids of the merged export, and peft's own."""
    from agent.worker.loramerge import write_merged_export
    from dtfm.core.hfdir import resolve_spec
    from dtfm.core.hfexport import StageFile
    from dtfm.core.lora import from_adapter_dir
    from dtfm.core.spec import TrainConfig

    src, data, adapter = exported
    cfg = from_adapter_dir(TrainConfig(init_from=str(adapter)))
    merged = write_merged_export(tmp_path / "merged", resolve_spec("", str(src), SEQ), cfg,
                                 [StageFile(0, adapter / "adapter_model.safetensors")])
    prompt = val_prompt(data)
    fresh = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    want = hf_greedy(peft.PeftModel.from_pretrained(fresh, adapter).eval(), prompt, 8)
    assert agent_greedy(merged, prompt, 8) == want
    assert agent_greedy(adapter, prompt, 8) == want
    assert agent_greedy(src, prompt, 8) != want  # the adapters change what is generated


def test_a_flag_contradicting_the_adapter_directory_is_refused(tmp_path: Path) -> None:
    src, _ = saved(tmp_path, "llama")
    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_model.safetensors").write_bytes(b"")
    config = {"peft_type": "LORA", "base_model_name_or_path": str(src), "r": 4,
              "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    (d / "adapter_config.json").write_text(json.dumps(config))
    from dtfm.core.lora import from_adapter_dir
    from dtfm.core.spec import TrainConfig

    cfg = from_adapter_dir(TrainConfig(init_from=str(d)))
    assert (cfg.init_from, cfg.lora_init, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets) == (
        str(src.absolute()), str(d.absolute()), 4, 16.0, "q_proj,v_proj")
    for flags, named in ((("--lora-rank", "8"), "--lora-rank 8 contradicts"),
                         (("--lora-alpha", "4"), "--lora-alpha 4.0 contradicts"),
                         (("--lora-targets", "q_proj"), "--lora-targets q_proj contradicts")):
        run = run_local("--init-from", str(d), "--seq-len", str(SEQ), *flags, timeout=60)
        assert run.rc == 2 and named in run.stderr and str(d) in run.stderr, run.stderr
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (d / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="base .*gone.* is not a model directory"):
        from_adapter_dir(TrainConfig(init_from=str(d)))
    config.update(base_model_name_or_path=str(src), use_dora=True)
    (d / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="use_dora"):
        from_adapter_dir(TrainConfig(init_from=str(d)))
