"""Fine-tuning an imported model across hosts of the WAN emulator, and `coordinator export` of
it while it trains: a tiny random `Qwen2ForCausalLM` (the Llama-family block, with q/k/v
biases and tied embeddings split across the two stages) is `--init-from` on a 2 x 2 job whose
agents are on separate emulated hosts with no shared storage (each agent checkpoints into its
own state directory); one agent is killed and the spare takes its place; the export gathers
every stage's weights over the agents' authenticated gRPC from whichever agent holds them.
The result loads in `transformers`, its validation loss on val.bin (as `transformers` computes
it) is lower than the imported model's, and `agent generate --greedy` on it gives exactly
`transformers`' greedy generation.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from dtfm.procs import wait_for
from dtfm.wan import WanEmulator
from dtfm.wan.cluster import WanCluster, measurement_wan

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")

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

N = 5  # a 2 x 2 job and one spare
DELAY = [[0 if i == j else 5 for j in range(N)] for i in range(N)]
RATE = [[0 if i == j else 200 for j in range(N)] for i in range(N)]
JOB = ["--seq-len", "32", "--agents", "4", "--min-agents", "4", "--stages", "2",
       "--replicas", "2", "--steps", "100000", "--lr", "1e-2", "--warmup-steps", "2",
       "--batch", "8", "--micro-batches", "2", "--checkpoint-every", "5",
       "--search-seconds", "1", "--no-measure", "--eval-batches", "0",
       "--heartbeat-interval", "0.5"]


@pytest.mark.timeout(290)
def test_an_import_fine_tuned_across_hosts_exports_while_training_after_churn(
        tmp_path: Path) -> None:
    src, imported = saved(tmp_path, "qwen2", eos=EOT_ID)
    data = byte_data(tmp_path)
    before = hf_val_loss(imported, data)
    world = tmp_path / "world"
    world.mkdir()
    world.chmod(0o1777)
    out = world / "export"
    with measurement_wan(DELAY, RATE) as wan:
        cluster = WanCluster(wan, tmp_path, agents=N, coordinator_args=[
            "--init-from", str(src), "--data", str(data), *JOB])
        try:
            ids = cluster.start(timeout=120)
            first = wait_for(lambda: (s := cluster.status()) and s["job"]["state"] == "running"
                             and s["job"]["checkpoint_step"] >= 5 and s, 150,
                             f"the job's first checkpoint (logs in {tmp_path})", 0.5)
            victim = ids.index(first["plan"]["grid"][1][0])
            cluster.agent_procs[victim].kill()
            wait_for(lambda: (s := cluster.status()) and s["job"]["epoch"] >= 2
                     and s["job"]["state"] == "running"
                     and s["job"]["checkpoint_step"] > first["job"]["checkpoint_step"] and s,
                     150, f"the job to resume with the spare and checkpoint again (logs in "
                     f"{tmp_path})", 0.5)
            result = cluster.cli("export", "--json", "--out", str(out), timeout=120)
            status = cluster.status()
        finally:
            cluster.stop()
    assert status is not None and status["job"]["state"] == "running", status  # still training
    assert status["job"]["model"] == "hf:qwen2", status["job"]
    assert ids[victim] not in str(status["plan"]["grid"])
    assert result["step"] > first["job"]["checkpoint_step"] and Path(result["out"]) == out
    assert stat.S_IMODE(world.stat().st_mode) == 0o1777
    assert sorted(p.name for p in world.iterdir()) == ["export"]
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
        "tokenizer_config.json"]
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert tuned.config.model_type == "qwen2"
    assert (tuned.config.bos_token_id, tuned.config.eos_token_id) == (EOT_ID, EOT_ID)
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == EOT_ID
    assert transformers.AutoTokenizer.from_pretrained(out).eos_token_id == EOT_ID
    after = hf_val_loss(tuned, data)
    assert after < before - 0.3, (before, after)
    prompt = val_prompt(data)
    want = hf_greedy(tuned, prompt, 8)
    assert len(want) == 8 and agent_greedy(out, prompt, 8) == want
