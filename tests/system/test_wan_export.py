"""`coordinator export` of a running job whose agents are on separate emulated hosts, with no
shared storage (each agent checkpoints into its own state directory), after one agent was
killed and a spare took its place: the export gathers every stage's weights over the agents'
authenticated gRPC, from whichever agent holds them, and `transformers` loads the result.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dtfm.procs import wait_for
from dtfm.wan import WanEmulator
from dtfm.wan.cluster import WanCluster, measurement_wan

AVAILABLE, WHY = WanEmulator.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")

N = 5  # a 2 x 2 job and one spare
DELAY = [[0 if i == j else 5 for j in range(N)] for i in range(N)]
RATE = [[0 if i == j else 200 for j in range(N)] for i in range(N)]
JOB = ["--model", "gpt-tiny", "--agents", "4", "--min-agents", "4", "--stages", "2",
       "--replicas", "2", "--steps", "100000", "--batch", "4", "--micro-batches", "1",
       "--checkpoint-every", "5", "--search-seconds", "1", "--no-measure",
       "--eval-batches", "0", "--heartbeat-interval", "0.5"]


def _status(cluster: WanCluster) -> dict[str, Any] | None:
    try:
        return cluster.cli("status", "--json", timeout=15)
    except (RuntimeError, subprocess.TimeoutExpired):
        return None


@pytest.mark.timeout(290)
def test_export_of_a_running_2x2_job_after_churn_loads_in_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "export"
    with measurement_wan(DELAY, RATE) as wan:
        cluster = WanCluster(wan, tmp_path, agents=N, coordinator_args=JOB)
        try:
            ids = cluster.start(timeout=120)
            first = wait_for(lambda: (s := _status(cluster)) and s["job"]["state"] == "running"
                             and s["job"]["checkpoint_step"] >= 5 and s, 150,
                             f"the job's first checkpoint (logs in {tmp_path})", 0.5)
            victim = ids.index(first["plan"]["grid"][1][0])
            cluster.agent_procs[victim].kill()
            wait_for(lambda: (s := _status(cluster)) and s["job"]["epoch"] >= 2
                     and s["job"]["state"] == "running"
                     and s["job"]["checkpoint_step"] > first["job"]["checkpoint_step"] and s,
                     150, f"the job to resume with the spare and checkpoint again (logs in "
                     f"{tmp_path})", 0.5)
            result = cluster.cli("export", "--json", "--out", str(out), timeout=120)
            status = _status(cluster)
        finally:
            cluster.stop()
    assert status is not None and status["job"]["state"] == "running", status  # still training
    assert ids[victim] not in str(status["plan"]["grid"])
    assert result["step"] >= 5 and Path(result["out"]) == out
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    # a fresh interpreter: what a user would run on the exported directory
    probe = subprocess.run([sys.executable, "-c", (
        "import sys, json, torch, transformers\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "ids = torch.arange(32).reshape(1, 32)\n"
        "print(json.dumps({'loss': float(m(ids, labels=ids).loss)}))"), str(out)],
        capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    loss = json.loads(probe.stdout)["loss"]
    assert 0 < loss < 20, loss
    assert transformers.AutoConfig.from_pretrained(out).model_type == "gpt2"
