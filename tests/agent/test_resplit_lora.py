"""A LoRA job resumes exactly on another stage count: its checkpoints hold only adapters (under
`peft`'s names, which carry the global layer index) and their AdamW state, and a stage cut
differently must gather its layers' adapters and moments from the old stages that held them.

Real worker processes over gloo, as `test_resplit_worker` does for full training: a 2-stage
LoRA run (`agent local`, shared checkpoint directory) dies after its step-4 checkpoint; one
stage resumes from both old stages' step 4 (`checkpoint_splits` = [2, 2]) and dies after step
8; three stages then resume from the one stage's step 8 (`checkpoint_splits` = [4]). Every loss
and the final validation loss equal the uninterrupted 2-stage run's, to the re-split tests'
tolerance (the base is re-read from the seed on every layout; only the adapters move).

After each layout, `coordinator export`'s own code (`export_from_status`, gathering from a
real agent gRPC server over that checkpoint directory) writes the peft adapter directory of the
newest complete step: after the shrink the one stage's step 8 (stage 1's stale step 4 of the old
cut beside it), after the growth the three stages' step 12, whose every adapter, under its own
layer's name, equals the uninterrupted run's.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from agent.daemon.server import AgentService
from coordinator.job.export import export_from_status, job_export_source
from dtfm import rpc
from dtfm.checkpoints.copies import CheckpointStore
from dtfm.core import lora as spec_lora
from dtfm.core.loraexport import expected_adapters
from dtfm.core.presets import PRESETS
from dtfm.core.spec import TrainConfig
from protos.dtfm.v1 import common_pb2, coordinator_pb2
from tests.agent.servers import serving
from tests.agent.worker.testlib import assert_close, local_job_dir, run_workers, shrink_to_one_stage
from tests.daemons import TOKEN

STEPS = 12
FLAGS = ("--model", "llama-tiny", "--batch", "4", "--micro-batches", "2", "--steps", str(STEPS),
         "--checkpoint-every", "4", "--seed", "5", "--eval-batches", "1", "--timeout", "30",
         "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2")
REL = 1e-5  # what tests/agent/test_resplit_worker.py holds a re-split to
SPEC = PRESETS["llama-tiny"]
CFG = TrainConfig(lora_rank=4, lora_alpha=8.0, seed=5)  # FLAGS' LoRA settings


def cluster_export(ckpt: Path, job_id: str, out: Path) -> int:
    """`coordinator export` of job `job_id` from one agent serving `ckpt`; the step written."""
    async def run() -> int:
        security = rpc.Security(token=TOKEN)
        svc = AgentService(common_pb2.AgentInfo(agent_id="a0", host="127.0.0.1"),
                           CheckpointStore(ckpt))
        async with serving(svc, security) as address:
            svc.info.port = int(address.rsplit(":", 1)[1])
            status = coordinator_pb2.ClusterStatus(
                agents=[coordinator_pb2.AgentStatus(info=svc.info)],
                job=coordinator_pb2.JobStatus(job_id=job_id, model_spec=SPEC.to_proto(),
                                              export_source=job_export_source(CFG)))
            step, _ = await export_from_status(status, security, out, say=lambda _: None)
        return step
    return asyncio.run(run())


def exported(out: Path) -> dict[str, torch.Tensor]:
    """An adapter directory's tensors, after checking it is one of this job's adapters."""
    config = json.loads((out / spec_lora.ADAPTER_CONFIG).read_text())
    assert config["r"] == CFG.lora_rank and config["lora_alpha"] == CFG.lora_alpha
    tensors = load_file(out / spec_lora.ADAPTER_WEIGHTS)
    assert set(tensors) == expected_adapters(SPEC, CFG)  # every layer, peft's names
    return tensors


def adapter_names(path: Path) -> list[str]:
    with safe_open(str(path), "pt") as f:
        return sorted(f.keys())


@pytest.mark.timeout(600)
def test_lora_job_shrinks_to_one_stage_and_grows_to_three_exactly(tmp_path: Path) -> None:
    shrunk = shrink_to_one_stage(FLAGS, tmp_path, REL)  # 2 stages, then 1 from their step 4
    full, ckpt, job_dir = shrunk.full, shrunk.ckpt, shrunk.job_dir
    assert len(full.losses) == STEPS
    # the one stage's checkpoint holds every layer's adapters, under their own layer index
    names = adapter_names(job_dir / "stage-0" / "step-00000008.safetensors")
    assert len(names) == 4 * 7 * 2  # four layers, seven projections, A and B
    assert {n.split(".layers.")[1].split(".")[0] for n in names} == {"0", "1", "2", "3"}

    assert cluster_export(ckpt, job_dir.name, tmp_path / "export-8") == 8
    exported(tmp_path / "export-8")

    back = run_workers(FLAGS, 3, ckpt, tmp_path / "back", [4], job_id=job_dir.name)
    assert back.rc == 0, back.stderr
    assert [s["step"] for s in back.steps] == [9, 10, 11, 12]
    assert_close(back.losses, full.losses[8:], REL)
    assert back.done is not None and full.done is not None
    assert abs(back.done["val_loss"] - full.done["val_loss"]) <= REL * full.done["val_loss"]

    assert cluster_export(ckpt, job_dir.name, tmp_path / "export-12") == 12
    got = exported(tmp_path / "export-12")
    full_dir = local_job_dir(tmp_path / "full")
    want = {k: v for stage in (0, 1) for k, v in
            load_file(full_dir / f"stage-{stage}" / "step-00000012.safetensors").items()}
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
