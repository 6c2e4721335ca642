"""A worker whose machine lacks the `--init-from` directory, or holds another checkpoint under
its path, fails before joining with a `config` error naming the directory (so the coordinator
fails the job at once instead of retrying); a checkpoint with tensors the model does not use
is refused, naming one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from agent.worker.train import run_assignment
from dtfm.core import hfdir
from dtfm.core.assignment import build_assignments
from dtfm.core.layout import Layout
from dtfm.core.spec import TrainConfig
from dtfm.rpc import free_port
from protos.dtfm.v1 import common_pb2

pytest.importorskip("transformers")

from tests.hflib import saved  # noqa: E402


def _fail(tmp: Path, init_from: Path, init_hash: str, spec_dir: Path) -> dict:
    spec = hfdir.resolve_spec("", str(spec_dir))
    train = TrainConfig(global_batch=1, micro_batches=1, steps=1, init_from=str(init_from),
                        checkpoint_every=0, eval_batches=0)
    [a] = build_assignments(job_id="j", epoch=1, layout=Layout(1, 1), spec=spec, train=train,
                            master_addr="127.0.0.1", master_port=free_port(),
                            init_hash=init_hash)
    progress = tmp / f"progress-{init_from.name}.jsonl"
    with pytest.raises(ValueError):
        run_assignment(common_pb2.Assignment.FromString(a.SerializeToString()), str(progress))
    event = json.loads(progress.read_text().splitlines()[-1])
    assert event["event"] == "error" and event["kind"] == "config" and event["phase"] == "join"
    return event


def test_a_missing_or_different_init_dir_is_a_config_error_naming_it(tmp_path: Path) -> None:
    src, _ = saved(tmp_path, "llama")
    good = hfdir.dir_hash(src)
    absent = tmp_path / "absent"
    event = _fail(tmp_path, absent, good, src)
    assert f"--init-from {absent}: no such directory on this machine" in event["message"]
    other = tmp_path / "other"
    shutil.copytree(src, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    event = _fail(tmp_path, other, good, src)
    assert f"--init-from {other} on this machine is not the checkpoint" in event["message"]


def test_a_checkpoint_with_extra_tensors_is_refused_naming_one(tmp_path: Path) -> None:
    src, _ = saved(tmp_path, "llama")
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.7.mlp.up_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    event = _fail(tmp_path, src, hfdir.dir_hash(src), src)
    assert "model.layers.7.mlp.up_proj.weight" in event["message"], event


def test_absurd_sizes_fail_the_worker_before_it_allocates_its_stage(tmp_path: Path) -> None:
    """A coordinator holding only config.json plans whatever it says; the worker holding the
    weights refuses sizes they do not have with a config error, not the allocator's."""
    src, _ = saved(tmp_path, "llama")
    config = json.loads((src / "config.json").read_text())
    absurd = json.dumps({**config, "hidden_size": 1_000_000, "intermediate_size": 4_000_000,
                         "head_dim": 8})
    (src / "config.json").write_text(absurd)
    planner = tmp_path / "coordinator-copy"
    planner.mkdir()
    (planner / "config.json").write_text(absurd)
    event = _fail(tmp_path, src, hfdir.dir_hash(src), planner)
    assert "config.json does not describe these weights" in event["message"], event
