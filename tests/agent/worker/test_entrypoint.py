"""The contract the agent's supervisor relies on: `python -m agent.worker --assignment PATH`.

A one-rank job run directly (no launcher) reports step and done events as JSON lines on stdout
or to `--progress`; a bad assignment ends with an error event and a non-zero exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtfm.core.assignment import build_assignments
from dtfm.core.layout import Layout
from dtfm.core.presets import get_preset
from dtfm.core.spec import TrainConfig
from dtfm.rpc import free_port
from tests.agent.worker.testlib import REPO


def _assignment(tmp_path: Path, **changes: int) -> Path:
    train = TrainConfig(global_batch=4, micro_batches=2, steps=3, eval_batches=1)
    (msg,) = build_assignments(job_id="local", epoch=0, layout=Layout(1, 1),
                               spec=get_preset("gpt-tiny"), train=train,
                               master_addr="127.0.0.1", master_port=free_port())
    for k, v in changes.items():
        setattr(msg, k, v)
    path = tmp_path / "a.bin"
    path.write_bytes(msg.SerializeToString())
    return path


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DTFM_NUM_THREADS": "1", "DTFM_TIMEOUT_S": "30"}
    return subprocess.run([sys.executable, "-m", "agent.worker", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(90)
def test_worker_reports_json_lines_on_stdout(tmp_path: Path) -> None:
    proc = _run("--assignment", str(_assignment(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3]
    for e in steps:
        assert {"step", "loss", "tokens_per_s", "total_steps", "rank"} <= e.keys()
        assert e["total_steps"] == 3 and e["rank"] == 0 and e["tokens_per_s"] > 0
    assert events[-1]["event"] == "done" and events[-1]["val_loss"] > 0


@pytest.mark.timeout(90)
def test_bad_assignment_ends_with_an_error_event(tmp_path: Path) -> None:
    progress = tmp_path / "progress.jsonl"
    proc = _run("--assignment", str(_assignment(tmp_path, layer_end=3)),
                "--progress", str(progress))
    assert proc.returncode == 1
    (event,) = [json.loads(line) for line in progress.read_text().splitlines()]
    assert event["event"] == "error" and "layer range" in event["message"]
