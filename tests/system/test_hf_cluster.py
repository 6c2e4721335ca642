"""Fine-tuning an imported model on a loopback cluster (coordinator + 4 agents, 2 stages x 2
replicas): `coordinator start --init-from DIR` takes the model from config.json, every worker
loads its stage's tensors, and `--export-dir` writes, after the last step, a directory
`transformers` loads whose validation loss (as `transformers` computes it on val.bin) is
lower than the imported model's, and on which `agent generate --greedy` (dtfm's own forward
pass) gives exactly the ids `transformers`' greedy generation gives.
"""

from __future__ import annotations

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


def test_init_from_with_a_disagreeing_model_is_refused_naming_both(daemons: Daemons,
                                                                    tmp_path: Path) -> None:
    src, _ = saved(tmp_path, "gpt2")
    out = daemons.cli("coordinator", "start", "--init-from", str(src), "--model", "gpt-mini",
                      "--agents", "2")
    assert out.returncode == 2, out.stderr
    assert "--model gpt-mini disagrees with --init-from" in out.stderr and str(src) in out.stderr
    out = daemons.cli("coordinator", "start", "--init-from", str(tmp_path), "--agents", "2")
    assert out.returncode == 2 and "config.json" in out.stderr, out.stderr
