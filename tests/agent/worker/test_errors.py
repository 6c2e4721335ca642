"""The worker's error event says what kind of failure ended it, for the coordinator.

Real worker processes (`python -m agent.worker`) over gloo on loopback: an invalid
`--bind-interface` is a `config` error while joining, a world whose other rank never comes is
a `rendezvous` error, and a neighbour that dies mid-training is a `peer` error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from agent.worker import errors
from agent.worker.errors import PeerError, classify
from dtfm.core.assignment import build_assignments
from dtfm.core.layout import Layout
from dtfm.core.presets import get_preset
from dtfm.core.spec import TrainConfig
from dtfm.rpc import free_port
from tests.agent.worker.testlib import REPO


def test_classify() -> None:
    assert classify(ValueError("bad layer range"), errors.JOIN) == "config"
    assert classify(ValueError("bad"), errors.TRAIN) == "config"
    assert classify(FileNotFoundError("no data"), errors.JOIN) == "config"
    assert classify(dist.DistStoreError("timed out"), errors.JOIN) == "rendezvous"
    assert classify(RuntimeError("Gloo connectFullMesh failed"), errors.JOIN) == "rendezvous"
    assert classify(PeerError("no gradients"), errors.TRAIN) == "peer"
    assert classify(dist.DistBackendError("Connection closed by peer"), errors.TRAIN) == "peer"
    assert classify(RuntimeError("[gloo] Timed out waiting"), errors.TRAIN) == "peer"
    assert classify(KeyError("x"), errors.TRAIN) == "internal"
    assert classify(RuntimeError("shape mismatch"), errors.TRAIN) == "internal"


def _write(tmp_path: Path, stages: int) -> list[Path]:
    train = TrainConfig(global_batch=4, micro_batches=2, steps=4, eval_batches=1)
    msgs = build_assignments(job_id="t", epoch=0, layout=Layout(stages, 1),
                             spec=get_preset("gpt-tiny"), train=train,
                             master_addr="127.0.0.1", master_port=free_port())
    paths = []
    for m in msgs:
        paths.append(tmp_path / f"rank{m.rank}.bin")
        paths[-1].write_bytes(m.SerializeToString())
    return paths


def _spawn(path: Path, progress: Path, **env: str) -> subprocess.Popen[str]:
    full = {**os.environ, "DTFM_NUM_THREADS": "1", "DTFM_TIMEOUT_S": "5", **env}
    return subprocess.Popen(
        [sys.executable, "-m", "agent.worker", "--assignment", str(path),
         "--progress", str(progress)],
        cwd=REPO, env=full, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def _error(progress: Path) -> dict[str, object]:
    events = [json.loads(line) for line in progress.read_text().splitlines()]
    assert events[-1]["event"] == "error", events
    return events[-1]


def _finish(*procs: subprocess.Popen[str]) -> list[int]:
    codes = []
    for p in procs:
        try:
            p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        codes.append(p.returncode)
    return codes


@pytest.mark.timeout(90)
def test_unknown_bind_interface_is_a_config_error_while_joining(tmp_path: Path) -> None:
    (path,) = _write(tmp_path, 1)
    progress = tmp_path / "p.jsonl"
    assert _finish(_spawn(path, progress, DTFM_BIND_INTERFACE="nosuch0")) == [1]
    event = _error(progress)
    assert (event["kind"], event["phase"]) == ("config", "join")
    assert "--bind-interface 'nosuch0'" in str(event["message"])


@pytest.mark.timeout(90)
def test_missing_peer_is_a_rendezvous_error(tmp_path: Path) -> None:
    rank0, _ = _write(tmp_path, 2)  # rank 1 never starts
    progress = tmp_path / "p.jsonl"
    assert _finish(_spawn(rank0, progress, DTFM_TIMEOUT_S="3")) == [1]
    event = _error(progress)
    assert (event["kind"], event["phase"]) == ("rendezvous", "join"), event


@pytest.mark.timeout(90)
def test_dead_neighbour_is_a_peer_error_while_training(tmp_path: Path) -> None:
    paths = _write(tmp_path, 2)
    progress = [tmp_path / f"p{r}.jsonl" for r in range(2)]
    procs = [_spawn(p, q, DTFM_FAULT="1:3") for p, q in zip(paths, progress, strict=True)]
    codes = _finish(*procs)
    assert codes == [1, 17]
    event = _error(progress[0])
    assert (event["kind"], event["phase"]) == ("peer", "train"), event
    steps = [json.loads(s) for s in progress[0].read_text().splitlines()][:-1]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:  # the timing split the coordinator and benchmarks read
        assert {"step_s", "compute_s", "pp_wait_s", "dp_s", "recv_wait_s",
                "send_wait_s"} <= s.keys()
        assert s["pp_wait_s"] == pytest.approx(s["recv_wait_s"] + s["send_wait_s"])
