"""`coordinator export` and `coordinator start --export-dir`: a job's newest complete step as a
Hugging Face directory, gathered from whichever agents hold its stages.

Every stage checkpoint holds its weights as a safetensors file under Hugging Face names
(`dtfm.core.checkpoints`), and every stage is held by at least two agents (its replicas, or a
mirror), on their own disks. So an export needs no shared storage and no torch:

1. ask the coordinator (`GetStatus`) for the job's id, its model spec and the agents;
2. ask every live agent (`Agent.ListCheckpoints`, authenticated like every agent call) which
   complete steps it holds of each stage; pick the newest step for which the stages of one
   split (their layer ranges join end to end, 0 to the model's last layer) each have a copy
   with its weights file (after a re-cut, an older split's step can be the newest complete);
3. copy each stage's weights file of that step from one holder (`dtfm.checkpoints.copies.download`:
   resumable, checked against the holder's manifest sha256), trying the next holder on
   failure; a listing that declares more bytes than the model's layers take is never
   fetched (`dtfm.checkpoints.copies.list_peer`), and a full disk ends the export saying so;
4. assemble the directory (`dtfm.core.hfexport.write_export`: atomic, refuses a non-empty
   destination unless forced), with the token ids and tokenizer the coordinator's status
   names (`dtfm.core.hfexport.ExportSource`, the one `agent local --export-dir` writes too).
   A LoRA job's stage files hold its adapters, so its status carries its LoRA settings and
   base (`ExportSource.lora`) and the export is a `peft` adapter directory
   (`dtfm.core.loraexport`, no torch) or, with `merged`, the base with the adapters folded
   in (`agent.worker.loramerge`, run as a child process by `dtfm.launcher.run_merge`: it
   needs torch, which the coordinator never imports, and the base on this disk), exactly what
   `agent local --export-dir` writes.

Everything the caller gave is checked before anything is fetched: the destination (not empty,
writable: not under /proc; for a LoRA job, not its base, a directory holding it or one inside
it, which the export would replace), the tokenizer. The download goes to a private temporary folder
beside the destination; the folder holding the destination keeps its mode.

It works while the job trains: a checkpoint step, once its manifest is listed, is immutable
until pruned, and a holder that pruned it meanwhile makes the copy fall to the next holder
(each stage keeps its newest two steps, so a retry from the listing finds it).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from dtfm import rpc
from dtfm.checkpoints.copies import BadCopy, DiskFull, Peer, download, list_peer
from dtfm.core import checkpoints as ondisk
from dtfm.core import loraexport
from dtfm.core.assignment import member_address
from dtfm.core.checkpoints import Manifest
from dtfm.core.hfexport import (
    ExportError,
    ExportSource,
    StageFile,
    check_destination,
    check_not_base,
    export_source,
    make_parent,
    tokenizer_sources,
    write_export,
)
from dtfm.core.mergerequest import MergeRequest
from dtfm.core.spec import ModelSpec, TrainConfig
from dtfm.launcher import run_merge
from dtfm.net import reach
from protos.dtfm.v1 import agent_pb2_grpc, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 10.0
MAX_STAGES = 1024  # how many stage folders a listing asks an agent about, at most


@dataclass(frozen=True)
class Holding:
    """One agent's complete copy of one stage's step."""

    peer: Peer
    manifest: Manifest


def pick_step(held: dict[tuple[int, int], list[Holding]], n_layers: int
              ) -> tuple[int, list[list[Holding]]] | None:
    """The newest step whose stages 0..S-1 (for some S) are each held with a weights file and
    their layer ranges join into one split of the model's `n_layers` layers; its holders per
    stage, in stage order. None when no step is complete."""
    for step in sorted({s for _, s in held}, reverse=True):
        per_stage: list[list[Holding]] = []
        end = 0
        stage = 0
        while end < n_layers and (stage, step) in held:
            ok = [h for h in held[(stage, step)] if _has_weights(h.manifest)
                  and h.manifest.layers is not None and h.manifest.layers[0] == end]
            if not ok:
                break
            # one split: every holder of this stage must agree on its end too
            end = ok[0].manifest.layers[1]  # type: ignore[index]
            per_stage.append([h for h in ok if h.manifest.layers[1] == end])  # type: ignore[index]
            stage += 1
        if end == n_layers and per_stage:
            return step, per_stage
    return None


def _has_weights(m: Manifest) -> bool:
    return any(f.name == ondisk.weights_name(m.step) for f in m.files)


async def job_status(address: str, security: rpc.Security, job_id: str = ""
                     ) -> coordinator_pb2.ClusterStatus:
    """The cluster's status with `job_id`'s (an ended one's too; default: the current job)."""
    async with rpc.open_channel(address, security) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        return await stub.GetStatus(coordinator_pb2.StatusRequest(job_id=job_id),
                                    timeout=STATUS_TIMEOUT_S)


def agent_targets(status: coordinator_pb2.ClusterStatus) -> list[tuple[str, str]]:
    """(agent id, HOST:PORT) of every agent the coordinator lists (lost ones too: one may be
    back), one per id: agents behind different NATs may advertise one private address, so
    the address tells no agent apart. Agents peers can dial come first; those nobody can
    dial (behind a NAT, `reach` "nowhere") last, as the copies least likely to be fetched."""
    rows = {a.info.agent_id: (a.reach.verdict == reach.NOWHERE,
                              member_address(a.info.host, a.info.port))
            for a in status.agents if a.info.port and a.info.agent_id}
    return [(agent_id, address) for agent_id, (_, address)
            in sorted(rows.items(), key=lambda row: row[1][0])]


async def gather(job_id: str, spec: ModelSpec, targets: Sequence[tuple[str, str]],
                 security: rpc.Security, into: Path,
                 say: Callable[[str], None]) -> tuple[int, list[StageFile]]:
    """Copy each stage's weights of the newest complete step into job folder `into`, from the
    agents `targets` names ((agent id, address): each listing counts only when the agent
    that answers is the one meant)."""
    channels = [rpc.open_channel(a, security) for _, a in targets]
    try:
        peers = [(agent_id, Peer(a, agent_pb2_grpc.AgentStub(c))) for (agent_id, a), c in
                 zip(targets, channels, strict=True)]
        held, missed = await _listings(peers, job_id, spec)
        picked = pick_step(held, spec.n_layers)
        if picked is None:
            why = (f"; {len(missed)} of them could not be asked from here ({missed[0]}): an "
                   f"agent behind a NAT serves its checkpoints to no one who dials it, and "
                   f"copies are not relayed yet: run the export where it can dial them, or "
                   f"from the coordinator's network" if missed else "")
            raise ExportError(
                f"no step of job {job_id} is held complete, with its weights, by the "
                f"{len(peers)} agents the coordinator lists: wait for the job's first "
                f"checkpoint (--checkpoint-every), or check the agents are reachable{why}")
        step, holders = picked
        say(f"export: job {job_id} step {step}, {len(holders)} stages, from "
            f"{len({h.peer.address for hs in holders for h in hs})} agents")
        files = []
        for stage, candidates in enumerate(holders):
            files.append(StageFile(stage, await _copy_stage(candidates, job_id, into, say)))
        return step, files
    finally:
        for c in channels:
            await c.close()


async def _listings(peers: Sequence[tuple[str, Peer]], job_id: str, spec: ModelSpec
                    ) -> tuple[dict[tuple[int, int], list[Holding]], list[str]]:
    """(stage, step) -> its holders, over every peer and every stage it may hold (a stage
    count is at most the layer count: a split of any epoch, re-cuts included), and why the
    peers not asked were not. A step that declares more bytes than its layers of `spec` take
    is left out (`list_peer`). A peer is asked only once it answered a Ping as the agent
    meant (`dtfm.net.reach.identified`): another agent at the same private address is not it."""
    held: dict[tuple[int, int], list[Holding]] = {}
    missed: list[str] = []

    async def one(agent_id: str, peer: Peer) -> None:
        if problem := await reach.identified(peer.stub, agent_id, peer.address):
            log.warning("export: not asking %s: %s", agent_id, problem)
            missed.append(problem)
            return
        for stage in range(min(spec.n_layers, MAX_STAGES)):
            try:
                found = await list_peer(peer, job_id, stage, spec)
            except grpc.RpcError as e:
                log.info("export: %s did not list stage %d: %s", peer.address, stage,
                         rpc.describe_rpc_error(e, peer.address))  # type: ignore[arg-type]
                return
            for m in found:
                held.setdefault((m.stage, m.step), []).append(Holding(peer, m))

    await asyncio.gather(*(one(i, p) for i, p in peers))
    return held, missed


async def _copy_stage(candidates: Sequence[Holding], job_id: str, into: Path,
                      say: Callable[[str], None]) -> Path:
    for h in candidates:
        f = next(f for f in h.manifest.files if f.name == ondisk.weights_name(h.manifest.step))
        try:
            await download(h.peer, job_id, into, h.manifest, f)
        except DiskFull as e:
            raise ExportError(f"disk full: {e.strerror}; free space there, or give --out on "
                              f"a disk with room for the model's weights") from None
        except (BadCopy, OSError) as e:
            log.warning("export: stage %d step %d not copied from %s: %s", h.manifest.stage,
                        h.manifest.step, h.peer.address, e)
            continue
        say(f"export: stage {h.manifest.stage} ({f.size / 2**20:.1f} MiB) from "
            f"{h.peer.address}")
        return ondisk.stage_dir(into, h.manifest.stage) / f.name
    stage, step = candidates[0].manifest.stage, candidates[0].manifest.step
    raise ExportError(f"no agent delivered stage {stage}'s weights of step {step} (tried "
                      f"{', '.join(h.peer.address for h in candidates)}; see the log): run the "
                      f"export again")


async def export_job(coordinator: str, security: rpc.Security, out: str | Path, *,
                     job_id: str = "", force: bool = False, tokenizer: str = "",
                     merged: bool = False,
                     say: Callable[[str], None] = print) -> tuple[int, Path]:
    """The whole `coordinator export`: returns the step exported and the directory."""
    check_inputs(out, force, tokenizer)
    try:
        status = await job_status(coordinator, security, job_id)
    except grpc.aio.AioRpcError as e:
        raise ExportError(rpc.describe_rpc_error(e, coordinator)) from None
    return await export_from_status(status, security, out, job_id=job_id, force=force,
                                    tokenizer=tokenizer, merged=merged, say=say,
                                    where=coordinator)


def check_inputs(out: str | Path, force: bool, tokenizer: str | Path = "") -> None:
    """What the caller gave, before anything is asked or fetched: `out` empty (or `force`)
    and writable, the tokenizer there. ExportError says what is wrong."""
    check_destination(out, force)
    make_parent(out)
    if tokenizer:
        tokenizer_sources(tokenizer)


def job_export_source(train: TrainConfig) -> coordinator_pb2.ExportSource:
    """What the coordinator's status says an export of its job writes beside the weights
    (`export_source` from the job's --init-from and --data on the coordinator's disk), and a
    LoRA job's settings and base (`loraexport.lora_source`). Never raises: the job itself
    refuses unreadable inputs; an export then has no token ids."""
    try:
        msg = export_source(train.data_path, train.init_from).to_proto()
    except (OSError, ValueError) as e:
        log.warning("export: the job's token ids and tokenizer are unknown: %s", e)
        msg = coordinator_pb2.ExportSource()
    if train.lora_rank:
        msg.lora.CopyFrom(loraexport.lora_source(train))
    return msg


def _source_for(job: coordinator_pb2.JobStatus, tokenizer: str | Path, where: str,
                say: Callable[[str], None]) -> ExportSource:
    """The status's export source, with `tokenizer` (given) in place of the job's, and the
    job's dropped, saying so, where it is not on this machine."""
    source = ExportSource.from_proto(job.export_source, f"the coordinator at {where}")
    if tokenizer:
        tokenizer_sources(tokenizer)
        return ExportSource(source.config, source.generation, str(tokenizer))
    if source.tokenizer:
        try:
            tokenizer_sources(source.tokenizer)
        except ExportError:
            say(f"export: the job's tokenizer {source.tokenizer} (on the coordinator's "
                f"machine) is not here: the export has none; give --tokenizer PATH")
            return ExportSource(source.config, source.generation)
    return source


async def export_from_status(status: coordinator_pb2.ClusterStatus, security: rpc.Security,
                             out: str | Path, *, job_id: str = "", force: bool = False,
                             tokenizer: str | Path = "", merged: bool = False,
                             say: Callable[[str], None] = print,
                             where: str = "this coordinator") -> tuple[int, Path]:
    """Export the job `status` describes from the agents it lists (the coordinator's own
    status, after the last step, for `coordinator start --export-dir`), with the token ids
    and tokenizer its `export_source` names (`tokenizer`: another tokenizer). A LoRA job
    exports a peft adapter directory, or with `merged` its base with the adapters merged."""
    job = status.job
    if not job.job_id:
        raise ExportError(f"the coordinator at {where} runs no job")
    if job_id and job_id != job.job_id:
        raise ExportError(f"the coordinator at {where} runs job {job.job_id}, not {job_id}")
    if not job.HasField("model_spec"):
        raise ExportError(f"the coordinator at {where} does not say which model job "
                          f"{job.job_id} trains (an older coordinator): upgrade it")
    spec = ModelSpec.from_proto(job.model_spec)
    check_inputs(out, force)
    lora = _lora_config(job, spec, merged, where)
    if lora is not None:  # an adapter written over its base would have none
        check_not_base(out, lora.init_from)
    source = _source_for(job, tokenizer, where, say)
    parent = Path(out).absolute().parent
    try:
        tmp = tempfile.TemporaryDirectory(prefix=".dtfm-export-", dir=parent)
    except OSError as e:
        raise ExportError(f"--out {out}: cannot write in {parent} ({e.strerror or e})") \
            from None
    with tmp:
        step, files = await gather(job.job_id, spec, agent_targets(status), security,
                                   Path(tmp.name), say)
        if lora is not None and merged:  # torch, so in a child process (run_merge)
            request = MergeRequest(Path(out), spec, lora, tuple(files), source, force)
            path = await asyncio.to_thread(run_merge, request, Path(tmp.name), say)
        elif lora is not None:
            path = await asyncio.to_thread(
                loraexport.write_adapter_export, out, spec, lora, files,
                tokenizer=source.tokenizer if source else None, force=force, progress=say)
        else:
            path = await asyncio.to_thread(write_export, out, spec, files, source=source,
                                           force=force, progress=say)
    return step, path


def _lora_config(job: coordinator_pb2.JobStatus, spec: ModelSpec, merged: bool,
                 where: str) -> TrainConfig | None:
    """A LoRA job's settings from its status (None for full fine-tuning), checked before
    anything is fetched: `merged` needs a LoRA job and, from `--init-from`, its base here."""
    if not job.export_source.HasField("lora"):
        if merged:
            raise ExportError(f"job {job.job_id} is not a LoRA job (no --lora-rank): its "
                              f"export is the whole model already; drop the merged option")
        return None
    cfg = loraexport.config_from_source(job.export_source.lora, spec, f"the coordinator at "
                                        f"{where}")
    if merged and cfg.init_from and not Path(cfg.init_from).is_dir():
        raise ExportError(f"the merged export needs job {job.job_id}'s base {cfg.init_from} "
                          f"(its --init-from on the coordinator's machine), which is not on "
                          f"this machine: export there, or export the adapters alone")
    return cfg
