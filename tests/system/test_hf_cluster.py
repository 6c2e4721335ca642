"""Fine-tuning an imported model on a loopback cluster (coordinator + 4 agents, 2 stages x 2
replicas): `coordinator start --init-from DIR` takes the model from config.json, every worker
loads its stage's tensors, and `--export-dir` writes, after the last step, a directory
`transformers` loads whose validation loss (as `transformers` computes it on val.bin) is
lower than the imported model's, and on which `agent generate --greedy` (dtfm's own forward
pass) gives exactly the ids `transformers`' greedy generation gives.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.daemons import Daemons, wait_for

transformers = pytest.importorskip("transformers")

from tests.hflib import (  # noqa: E402
    EOT_ID,
    agent_greedy,
    byte_data,
    hf_greedy,
    hf_val_loss,
    saved,
    val_prompt,
)

EOS = EOT_ID


@pytest.mark.timeout(300)
def test_a_2x2_cluster_fine_tunes_an_import_and_exports_it(daemons: Daemons) -> None:
    src, model = saved(daemons.tmp, "llama", eos=EOS)  # its config and tokenizer name EOS
    data = byte_data(daemons.tmp)
    before = hf_val_loss(model, data)
    out = daemons.tmp / "export"
    _, address = daemons.coordinator(
        "--init-from", str(src), "--data", str(data), "--seq-len", "32", "--agents", "4",
        "--stages", "2", "--replicas", "2", "--steps", "30", "--lr", "3e-3",
        "--warmup-steps", "2", "--batch", "8", "--micro-batches", "2", "--eval-batches", "1",
        "--checkpoint-every", "10", "--no-measure", "--search-seconds", "1",
        "--export-dir", str(out))
    for i in range(4):
        daemons.agent(address, f"agent-{i}", "--no-prewarm")
    done = wait_for(lambda: (s := daemons.status(address)["job"])["state"] in ("done", "failed")
                    and s, 250, f"the job to finish (logs in {daemons.tmp})", 1.0)
    assert done["state"] == "done", done
    assert done["model"] == "hf:llama"
    wait_for(lambda: (out / "config.json").is_file(), 60, "the export after the last step")
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    after = hf_val_loss(tuned, data)
    assert after < before - 0.3, (before, after)
    # the imported model's special-token ids and tokenizer, as `agent local` exports them
    assert (tuned.config.bos_token_id, tuned.config.eos_token_id) == (EOS, EOS)
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == EOS
    assert transformers.AutoTokenizer.from_pretrained(out).eos_token_id == EOS
    prompt = val_prompt(data)
    want = hf_greedy(tuned, prompt, 8)
    assert len(want) == 8 and agent_greedy(out, prompt, 8) == want


@pytest.mark.timeout(300)
def test_a_lora_cluster_exports_a_peft_adapter_and_a_merged_model(daemons: Daemons) -> None:
    """A LoRA job on a loopback cluster (2 stages x 1 replica): `coordinator start --export-dir`
    writes the peft adapter directory from the agents' adapter files, and `coordinator export
    --merged` (the client, against the same coordinator) the base with them merged; under
    `peft` and `transformers` the two give the same loss, not the base's."""
    peft = pytest.importorskip("peft")
    src, base = saved(daemons.tmp, "llama", eos=EOS)
    data = byte_data(daemons.tmp)
    out, merged = daemons.tmp / "adapter", daemons.tmp / "merged"
    _, address = daemons.coordinator(
        "--init-from", str(src), "--data", str(data), "--seq-len", "32", "--agents", "2",
        "--stages", "2", "--replicas", "1", "--steps", "6", "--lr", "1e-2",
        "--warmup-steps", "1", "--batch", "4", "--micro-batches", "2", "--eval-batches", "1",
        "--checkpoint-every", "6", "--no-measure", "--search-seconds", "1",
        "--lora-rank", "4", "--lora-alpha", "8", "--export-dir", str(out))
    for i in range(2):
        daemons.agent(address, f"agent-{i}", "--no-prewarm")
    done = wait_for(lambda: (s := daemons.status(address)["job"])["state"] in ("done", "failed")
                    and s, 250, f"the job to finish (logs in {daemons.tmp})", 1.0)
    assert done["state"] == "done", done
    wait_for(lambda: (out / "adapter_config.json").is_file(), 60, "the adapter export")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(src.absolute()) and config["r"] == 4
    assert not (out / "model.safetensors").exists()
    run = daemons.cli("coordinator", "export", "--coordinator", address, "--out", str(merged),
                      "--merged", timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    before = hf_val_loss(base, data)
    fresh = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    adapted = hf_val_loss(peft.PeftModel.from_pretrained(fresh, out).eval(), data)
    folded = hf_val_loss(transformers.AutoModelForCausalLM.from_pretrained(merged).eval(), data)
    assert abs(adapted - before) > 1e-3, (adapted, before)  # the adapters learned
    assert abs(adapted - folded) <= 1e-4 * adapted, (adapted, folded)


def test_init_from_with_a_disagreeing_model_is_refused_naming_both(daemons: Daemons,
                                                                    tmp_path: Path) -> None:
    src, _ = saved(tmp_path, "gpt2")
    out = daemons.cli("coordinator", "start", "--init-from", str(src), "--model", "gpt-mini",
                      "--agents", "2")
    assert out.returncode == 2, out.stderr
    assert "--model gpt-mini disagrees with --init-from" in out.stderr and str(src) in out.stderr
    out = daemons.cli("coordinator", "start", "--init-from", str(tmp_path), "--agents", "2")
    assert out.returncode == 2 and "config.json" in out.stderr, out.stderr
