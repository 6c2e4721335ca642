"""`coordinator export` gathering a job's weights from real agent gRPC servers (the daemon's own
`AgentService` over its own checkpoint directory, token and all, in-process on loopback), with
the coordinator's status built here: what it writes (token ids, tokenizer), where (the folder
holding `--out` keeps its mode), and what it refuses (a peer declaring more than the model
holds, a full disk, bad inputs before anything is fetched). The weights are a tiny random
`LlamaForCausalLM`'s, cut into two stages as the workers' checkpoints hold them; nothing is
downloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from safetensors.numpy import load_file, save_file

from agent.daemon.server import AgentService
from coordinator.job.export import agent_targets, export_from_status, export_job
from dtfm import rpc
from dtfm.checkpoints.copies import CheckpointStore
from dtfm.core import checkpoints as ondisk
from dtfm.core.checkpoints import FileEntry, Manifest
from dtfm.core.hfconfig import EMBEDDING_INDEX, HEAD_INDEX, part_tensors
from dtfm.core.hfdir import spec_from_dir
from dtfm.core.hfexport import ExportError, export_source
from dtfm.core.spec import ModelSpec
from protos.dtfm.v1 import agent_pb2, common_pb2, coordinator_pb2
from tests.agent.servers import serving as serving_agent
from tests.daemons import TOKEN
from tests.smalldisk import small_disk

transformers = pytest.importorskip("transformers")

from tests.hflib import saved  # noqa: E402

pytestmark = pytest.mark.timeout(120)
JOB = "job-1a2b3c4d"
SECURITY = rpc.Security(token=TOKEN)
EOS = 3
STEP = 10


def write_stages(root: Path, spec: ModelSpec, model_dir: Path,
                 splits: list[tuple[int, int]]) -> None:
    """What the workers' checkpoints of step STEP leave in agent root `root`: each stage's HF
    tensors as its weights file, a `.pt` beside it, the manifest last."""
    tensors = load_file(model_dir / "model.safetensors")
    job_root = ondisk.job_dir(root, JOB)
    for stage, (begin, end) in enumerate(splits):
        parts = [*([EMBEDDING_INDEX] if begin == 0 else []), *range(begin, end),
                 *([HEAD_INDEX] if end == spec.n_layers else [])]
        weights = ondisk.weights_for(job_root, stage, STEP)
        ondisk.private_dir(weights.parent)
        save_file({t.name: tensors[t.name] for p in parts
                   for t in part_tensors(spec, p).values()}, weights)
        ondisk.atomic_write(ondisk.path_for(job_root, stage, STEP), lambda f: f.write(b"state"))
        files = tuple(FileEntry(p.name, p.stat().st_size, ondisk.sha256_file(p)) for p in
                      (ondisk.path_for(job_root, stage, STEP), weights))
        ondisk.write_manifest(job_root, Manifest(JOB, stage, STEP, (begin, end), files))


class Counting(AgentService):
    """The daemon's service, counting the files peers fetch from it."""

    fetched: list[str]

    async def FetchCheckpoint(self, request: agent_pb2.FetchCheckpointRequest,
                              context: grpc.aio.ServicerContext
                              ) -> AsyncIterator[agent_pb2.CheckpointChunk]:
        self.fetched.append(request.name)
        async for chunk in super().FetchCheckpoint(request, context):
            yield chunk


class Liar(Counting):
    """Lists its real steps, but declares each file 10^12 bytes (with a matching-looking
    checksum): what a hostile token holder could send to fill the exporter's disk."""

    async def ListCheckpoints(self, request: agent_pb2.ListCheckpointsRequest,
                              context: grpc.aio.ServicerContext) -> agent_pb2.CheckpointList:
        listed = await super().ListCheckpoints(request, context)
        for entry in listed.entries:
            for f in entry.files:
                f.size = 10**12
                f.sha256 = hashlib.sha256(b"lie").hexdigest()
        return listed


@contextlib.asynccontextmanager
async def agents(*holders: tuple[Path, type[Counting]]) -> AsyncIterator[list[Counting]]:
    """One agent server per (root, service class); yields the services (their `.port` set)."""
    async with contextlib.AsyncExitStack() as stack:
        services = []
        for i, (root, kind) in enumerate(holders):
            svc = kind(common_pb2.AgentInfo(agent_id=f"a{i}", host="127.0.0.1"),
                       CheckpointStore(root))
            svc.fetched = []
            address = await stack.enter_async_context(serving_agent(svc, SECURITY))
            svc.info.port = int(address.rsplit(":", 1)[1])
            services.append(svc)
        yield services


def status(spec: ModelSpec, services: list[Counting],
           source: coordinator_pb2.ExportSource | None = None) -> coordinator_pb2.ClusterStatus:
    """What the coordinator's GetStatus says of the job and its agents."""
    return coordinator_pb2.ClusterStatus(
        agents=[coordinator_pb2.AgentStatus(info=s.info) for s in services],
        job=coordinator_pb2.JobStatus(job_id=JOB, model_spec=spec.to_proto(),
                                      export_source=source))


@pytest.fixture
def model(tmp_path: Path) -> tuple[Path, ModelSpec]:
    src, _ = saved(tmp_path, "llama", eos=EOS)
    return src, spec_from_dir(src, seq_len=32)


def test_an_export_keeps_the_ids_and_tokenizer_and_the_mode_of_the_folder_holding_it(
        tmp_path: Path, model: tuple[Path, ModelSpec]) -> None:
    src, spec = model
    holder = tmp_path / "holder"
    write_stages(holder, spec, src, [(0, 2), (2, 3)])
    world = tmp_path / "world"  # a /tmp: anyone may create in it
    world.mkdir()
    world.chmod(0o1777)
    tmp_path.chmod(0o755)
    out = world / "snapshot"
    # the coordinator's status names what --init-from's directory gives
    source = export_source("", str(src)).to_proto()

    async def main() -> int:
        async with agents((holder, Counting)) as services:
            step, _ = await export_from_status(status(spec, services, source), SECURITY, out,
                                               say=lambda line: None)
            return step

    assert asyncio.run(main()) == STEP
    assert stat.S_IMODE(world.stat().st_mode) == 0o1777
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o755
    assert sorted(p.name for p in world.iterdir()) == ["snapshot"]  # no temporary left
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (EOS, EOS)
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert (generation.bos_token_id, generation.eos_token_id) == (EOS, EOS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token_id == EOS and tokenizer("w5 w7").input_ids == [5, 7]
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert tuned.config.eos_token_id == EOS


def test_a_peer_declaring_more_than_the_model_holds_is_never_fetched(
        tmp_path: Path, model: tuple[Path, ModelSpec],
        caplog: pytest.LogCaptureFixture) -> None:
    src, spec = model
    liar, honest = tmp_path / "liar", tmp_path / "honest"
    for root in (liar, honest):
        write_stages(root, spec, src, [(0, 3)])

    async def main() -> list[Counting]:
        async with agents((liar, Liar)) as services:
            with pytest.raises(ExportError, match=r"no step of job .* is held complete"):
                await export_from_status(status(spec, services), SECURITY, tmp_path / "a",
                                         say=lambda line: None)
        async with agents((liar, Liar), (honest, Counting)) as both:
            await export_from_status(status(spec, both), SECURITY, tmp_path / "b",
                                     say=lambda line: None)
            return services + both

    with caplog.at_level(logging.WARNING, logger="dtfm.checkpoints.copies"):
        alone, liar_svc, honest_svc = asyncio.run(main())
    assert alone.fetched == [] and liar_svc.fetched == []
    assert honest_svc.fetched == [ondisk.weights_name(STEP)]
    assert "declares 1,000,000,000,000 bytes" in caplog.text
    assert "refused before downloading" in caplog.text
    assert (tmp_path / "b" / "model.safetensors").is_file()


def test_a_full_disk_is_named_and_says_what_to_do(
        tmp_path: Path, model: tuple[Path, ModelSpec]) -> None:
    src, spec = model
    holder = tmp_path / "holder"
    write_stages(holder, spec, src, [(0, 3)])
    assert (src / "model.safetensors").stat().st_size > 64 * 1024

    async def main(disk: Path) -> None:
        async with agents((holder, Counting)) as services:
            await export_from_status(status(spec, services), SECURITY, disk / "out",
                                     say=lambda line: None)

    with small_disk(tmp_path / "disk", "64k") as disk:
        with pytest.raises(ExportError, match=r"disk full: the disk holding .* is full .*free "
                                              r"space there, or give --out on a disk"):
            asyncio.run(main(disk))
        assert list(disk.iterdir()) == []  # the partial download went with its folder


def test_inputs_are_refused_before_anything_is_asked_or_fetched(tmp_path: Path) -> None:
    unreachable = f"127.0.0.1:{rpc.free_port()}"  # asked first, this would be the error

    def refused(out: Path, tokenizer: str = "") -> str:
        with pytest.raises(ExportError) as info:
            asyncio.run(export_job(unreachable, SECURITY, out, tokenizer=tokenizer,
                                   say=lambda line: None))
        return str(info.value)

    assert "--tokenizer" in refused(tmp_path / "out", str(tmp_path / "missing"))
    for place in ("/proc", "/sys"):
        why = refused(Path(place) / "dtfm-snapshot")
        assert why.startswith(f"--out {place}/dtfm-snapshot: cannot write") and \
            "give a directory on a disk you can write" in why, why


@pytest.mark.parametrize("out", ["/proc/dtfm-snapshot", "/sys/dtfm-snapshot"])
def test_the_command_says_one_line_for_an_unwritable_out(out: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator", "export", "--coordinator",
         f"127.0.0.1:{rpc.free_port()}", "--out", out],
        capture_output=True, text=True, timeout=60, env={**os.environ, "DTFM_TOKEN": TOKEN})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert f"--out {out}: cannot write" in proc.stderr


def test_agents_behind_nats_are_told_apart_by_id_not_by_the_address_they_share() -> None:
    """Two agents behind different NATs both advertise 192.168.1.2:7000: the export asks
    each by id (the old address dedupe dropped the second); nowhere-reachable ones last."""
    shared = common_pb2.AgentInfo(host="192.168.1.2", port=7000)
    rows = [coordinator_pb2.AgentStatus(info=common_pb2.AgentInfo(agent_id=i, host=shared.host,
                                                                   port=shared.port),
                                        reach=common_pb2.ReachStatus(verdict=v))
            for i, v in (("hidden", common_pb2.REACHABILITY_NOWHERE),
                         ("open", common_pb2.REACHABILITY_EVERYWHERE))]
    assert agent_targets(coordinator_pb2.ClusterStatus(agents=rows)) == [
        ("open", "192.168.1.2:7000"), ("hidden", "192.168.1.2:7000")]


def test_an_agent_answering_at_another_s_address_is_not_taken_for_it(
        tmp_path: Path, model: tuple[Path, ModelSpec],
        caplog: pytest.LogCaptureFixture) -> None:
    """Agent a1 is listed at the address where a0 answers (one private address, two NATs):
    only a0's listing counts, and when no complete step is held the error says which agent
    could not be asked and that copies are not relayed."""
    src, spec = model
    holder = tmp_path / "holder"
    write_stages(holder, spec, src, [(0, 2)])  # stage 0 only: no complete step

    async def main() -> str:
        async with agents((holder, Counting)) as services:
            listed = status(spec, services)
            twin = coordinator_pb2.AgentStatus(info=common_pb2.AgentInfo(
                agent_id="a1", host="127.0.0.1", port=services[0].info.port))
            listed.agents.append(twin)
            with pytest.raises(ExportError) as err:
                await export_from_status(listed, SECURITY, tmp_path / "out",
                                         say=lambda line: None)
            return str(err.value)

    with caplog.at_level(logging.WARNING, logger="coordinator.job.export"):
        message = asyncio.run(main())
    assert "answered as agent a0, not a1" in caplog.text
    assert "1 of them could not be asked from here" in message, message
    assert "copies are not relayed yet" in message
