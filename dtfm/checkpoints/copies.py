"""Stage checkpoints that outlive the agent that wrote them, copied agent to agent over gRPC.

Without shared storage a stage's checkpoints live on the disks of the agents that ran it
(`STATE_DIR/checkpoints`, layout in `dtfm.core.checkpoints`). To survive losing one of them,
every stage is held by two agents: its replicas (each writes its own copy), or, for a stage
with one replica, a mirror the coordinator names (`Assignment.mirrors`). This module owns the
three moves, all through the agents' authenticated `Agent` service:

- **Serving** (`CheckpointStore`, behind `ListCheckpoints` / `FetchCheckpoint`): the complete
  steps (manifest present, file sizes match) of one stage, and any file one of them names, in
  1 MiB chunks from any offset. Nothing else under the root can be named: the file must be a
  `step-NNNNNNNN.pt` or `.safetensors` (the stage's weights) its step's manifest lists.
  `coordinator export` gathers a job's weights through the same two calls.
- **Fetching before a worker starts** (`CheckpointCopier.prepare`): an agent given a stage
  whose newest checkpoint it lacks (it never held the stage, or its copy is damaged) asks
  every peer in `Assignment.checkpoint_peers` and copies the newest complete steps newer than
  its own, within a time budget; the worker then resumes from them like from any local step.
  After the job changed its stage count (`Assignment.checkpoint_splits`), that is done for
  every old stage that held some of the new stage's layers, each with the layer range the
  old split gave it (`dtfm.core.checkpoints.sources`).
- **Mirroring** (`CheckpointCopier.start_mirrors`): while an assignment runs, every few
  seconds, copy the mirrored stage's newest steps from its holder, and prune like a worker.
  The agent's heartbeats report the newest step mirrored (`mirrored`); the coordinator answers
  with the oldest such step of any stage, which every agent keeps (`keep_from`), so a stage
  lost with its agent and the stages that survive still share a step to resume from.

A copy is installed like a worker's own write: each file downloads to a hidden partial name
carrying the sha256 it must end with (so a broken transfer resumes from its length, and only
from a peer offering the very same file), is checked for size and sha256 against the peer's
manifest, then renamed into place; the manifest is written last. A file that fails its
checksum is deleted and the peer that sent it is skipped with a log line naming it; no half
file ever sits under a final name, so a worker never loads one. What a peer may offer is
bounded by the model before anything is fetched (`list_peer`, `dtfm.core.checkpoints.
size_problem`): a step declaring more bytes than its layers' weights and optimizer state take
is ignored, and the download stops at the declared size, so a lying peer cannot fill the
disk. A disk that fills up anyway (`DiskFull`) ends the copy with an error saying so, its
partial file deleted, instead of trying every other peer for the same failure.

The daemon must not block on this (heartbeats run on the same loop), so disk reads, writes
and hashing run in threads. No torch here: this is the daemon, not the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NoReturn

import grpc

from dtfm import rpc
from dtfm.checkpoints import retryloop
from dtfm.core import checkpoints as ondisk
from dtfm.core.assignment import COORDINATOR_PEER
from dtfm.core.checkpoints import KEEP, FileEntry, Manifest
from dtfm.core.limits import MAX_NAME, clip, text_problem
from dtfm.core.spec import ModelSpec
from protos.dtfm.v1 import agent_pb2, agent_pb2_grpc, common_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024
LIST_TIMEOUT_S = 10.0
CHUNK_TIMEOUT_S = 30.0  # a peer that sends nothing for this long is given up
PREPARE_BUDGET_S = 120.0  # how long a worker's start may wait for its stage's checkpoint
# How often a mirror lists its peer's copy for new steps: a listing is a few manifests, and a
# mirror's lag is what a lost one-replica stage costs (5 s lost 40 steps of a fast model).
MIRROR_INTERVAL_S = 1.0
PROGRESS_EVERY_S = 5.0


# ---- serving ----


def entry_of(m: Manifest) -> agent_pb2.CheckpointEntry:
    return agent_pb2.CheckpointEntry(
        stage=m.stage, step=m.step, layers=list(m.layers or ()),
        files=[agent_pb2.CheckpointFile(name=f.name, size=f.size, sha256=f.sha256)
               for f in m.files])


def manifest_of(job_id: str, entry: agent_pb2.CheckpointEntry) -> Manifest:
    """A peer's listed step as a manifest of ours; ValueError when it is malformed (names a
    file that is not one of its step's, a bad checksum, a bad layer range)."""
    return Manifest.from_dict({
        "format": ondisk.MANIFEST_FORMAT, "job_id": job_id, "stage": entry.stage,
        "step": entry.step, "layers": list(entry.layers),
        "files": [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in entry.files],
    })


class CheckpointStore:
    """Serves this agent's own checkpoint directory to peers (`Agent.ListCheckpoints`,
    `Agent.FetchCheckpoint`). Every request is validated before it touches the disk."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    async def list(self, request: agent_pb2.ListCheckpointsRequest,
                   context: grpc.aio.ServicerContext) -> agent_pb2.CheckpointList:
        await _check_job_id(request.job_id, context)
        found = await asyncio.to_thread(
            ondisk.complete_steps, ondisk.job_dir(self.root, request.job_id), request.stage,
            request.job_id)
        return agent_pb2.CheckpointList(entries=[entry_of(m) for m in found])

    async def fetch(self, request: agent_pb2.FetchCheckpointRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[agent_pb2.CheckpointChunk]:
        await _check_job_id(request.job_id, context)
        if ondisk.step_of(request.name) != request.step:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                         f"name {clip(request.name, 80)!r} is not step {request.step}'s file: "
                         f"ask for a name ListCheckpoints gave, like "
                         f"{ondisk.data_name(min(request.step, ondisk.MAX_STEP))!r}")
        root = ondisk.job_dir(self.root, request.job_id)
        m = await asyncio.to_thread(ondisk.complete_manifest, root, request.stage,
                                    request.step, request.job_id)
        entry = next((f for f in m.files if f.name == request.name), None) if m else None
        if entry is None:
            await _abort(context, grpc.StatusCode.NOT_FOUND,
                         f"this agent holds no complete checkpoint of job {request.job_id} "
                         f"stage {request.stage} step {request.step} (pruned since it was "
                         f"listed, or damaged): call ListCheckpoints again")
        if request.offset > entry.size:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                         f"offset {request.offset} is past the end of {entry.name} "
                         f"({entry.size} bytes): resume from at most its size")
        path = ondisk.stage_dir(root, request.stage) / entry.name
        try:
            f = await asyncio.to_thread(open, path, "rb")
        except OSError as e:
            await _abort(context, grpc.StatusCode.NOT_FOUND, f"{entry.name}: {e.strerror}")
        # An open file keeps its bytes even if a worker prunes the step meanwhile.
        with f:
            f.seek(request.offset)
            left = entry.size - request.offset
            while left > 0:
                data = await asyncio.to_thread(f.read, min(CHUNK_BYTES, left))
                if not data:  # shrank since the size check: the caller's checksum refuses it
                    return
                left -= len(data)
                yield agent_pb2.CheckpointChunk(data=data)


async def _check_job_id(job_id: str, context: grpc.aio.ServicerContext) -> None:
    problem = "job_id is empty" if not job_id else text_problem("job_id", job_id, MAX_NAME)
    if problem:
        await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                     f"{problem}: give the job id `coordinator status` shows")


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode,
                 message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("unreachable: abort raises")  # pragma: no cover


# ---- fetching ----


class BadCopy(Exception):
    """A peer's file could not be installed: it failed, was cut short, or failed its checks."""


class DiskFull(OSError):
    """The disk a copy was written to filled up (ENOSPC, EDQUOT). Another peer would fill it
    just the same, so callers stop and say so instead of trying the next one; the partial
    file is deleted, so the space it took is free again for the worker's own checkpoints."""

    def __init__(self, where: Path, m: Manifest, f: FileEntry, cause: OSError) -> None:
        super().__init__(cause.errno, f"the disk holding {where} is full ({cause.strerror}): "
                         f"{f.name} of stage {m.stage} step {m.step} ({f.size / 2**20:.1f} MiB) "
                         f"was not copied")
        self.where = where


@dataclass
class Peer:
    """A peer agent over an authenticated channel, or the coordinator (same calls)."""

    address: str
    stub: agent_pb2_grpc.AgentStub | coordinator_pb2_grpc.CoordinatorStub


def open_peer(address: str, security: rpc.Security,
              coordinator: str = "") -> tuple[grpc.aio.Channel, Peer]:
    """A channel and a checkpoint stub for `address`: a peer agent's HOST:PORT, or
    COORDINATOR_PEER, the coordinator at `coordinator` (HOST:PORT this agent joined)."""
    if address != COORDINATOR_PEER:
        channel = rpc.open_channel(address, security)
        return channel, Peer(address, agent_pb2_grpc.AgentStub(channel))
    if not coordinator:
        raise rpc.ConfigError("this agent was not told the coordinator's address")
    channel = rpc.open_channel(coordinator, security)
    return channel, Peer(f"coordinator {coordinator}",
                         coordinator_pb2_grpc.CoordinatorStub(channel))


async def list_peer(peer: Peer, job_id: str, stage: int, spec: ModelSpec,
                    layers: tuple[int, int] | None = None) -> list[Manifest]:
    """The complete steps `peer` holds of `stage`. Malformed entries, and entries declaring
    more bytes than `spec`'s layers allow (`dtfm.core.checkpoints.size_problem`; `layers`:
    the range expected where an entry records none), are skipped and logged: nothing larger
    than the model implies is ever downloaded."""
    reply = await peer.stub.ListCheckpoints(
        agent_pb2.ListCheckpointsRequest(job_id=job_id, stage=stage), timeout=LIST_TIMEOUT_S)
    found = []
    for entry in reply.entries:
        try:
            m = manifest_of(job_id, entry)
        except ValueError as e:
            log.warning("checkpoint: peer %s listed a malformed entry for stage %d step %d "
                        "(%s); ignoring it", peer.address, entry.stage, entry.step, e)
            continue
        if m.stage != stage:
            continue
        if too_big := ondisk.size_problem(m, spec, layers):
            log.warning("checkpoint: peer %s listed stage %d step %d, but %s; ignoring it",
                        peer.address, m.stage, m.step, too_big)
            continue
        found.append(m)
    return found


class Sink:
    """A partial download: appends and hashes in a thread, so the event loop never waits on
    the disk or on sha256."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sha = hashlib.sha256()
        self.size = 0
        self._f: IO[bytes] | None = None

    def open(self) -> None:
        """Open for appending, hashing what is already there (the part to resume after)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        self._f = os.fdopen(fd, "a+b")
        self._f.seek(0)
        while block := self._f.read(CHUNK_BYTES):
            self.sha.update(block)
            self.size += len(block)

    def write(self, data: bytes) -> None:
        assert self._f is not None
        self._f.write(data)
        self.sha.update(data)
        self.size += len(data)

    def finish(self) -> None:
        assert self._f is not None
        self._f.flush()
        os.fsync(self._f.fileno())
        self.close()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


async def download(peer: Peer, job_id: str, root: Path, m: Manifest, f: FileEntry) -> None:
    """Copy file `f` of step `m` from `peer` into job folder `root`, resuming a partial
    download of the same file, verified before it takes its final name. BadCopy says why not;
    DiskFull when this disk filled up (the partial file is deleted then)."""
    part = ondisk.part_for(root, m.stage, f.name, f.sha256)
    try:
        await _download(peer, job_id, root, m, f, part)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT) or isinstance(e, DiskFull):
            raise
        await asyncio.to_thread(part.unlink, True)
        raise DiskFull(root, m, f, e) from e


async def _download(peer: Peer, job_id: str, root: Path, m: Manifest, f: FileEntry,
                    part: Path) -> None:
    await asyncio.to_thread(ondisk.private_dir, part.parent)
    sink = Sink(part)
    await asyncio.to_thread(sink.open)
    try:
        if sink.size > f.size:  # not a prefix of this file after all
            sink.close()
            part.unlink(missing_ok=True)
            sink = Sink(part)
            await asyncio.to_thread(sink.open)
        if sink.size:
            log.info("checkpoint: resuming stage %d step %d (%s) from %s at byte %d of %d",
                     m.stage, m.step, f.name, peer.address, sink.size, f.size)
        await _receive(peer, job_id, m, f, sink)
        await asyncio.to_thread(sink.finish)
    finally:
        sink.close()
    if sink.size != f.size:  # kept: the next try resumes from here
        raise BadCopy(f"{peer.address} sent {sink.size} of {f.size} bytes of {f.name}")
    if sink.sha.hexdigest() != f.sha256:
        part.unlink(missing_ok=True)
        raise BadCopy(f"{f.name} from {peer.address} fails its checksum (sha256 "
                      f"{sink.sha.hexdigest()[:16]}..., its manifest says {f.sha256[:16]}...); "
                      f"deleted")
    final = ondisk.stage_dir(root, m.stage) / f.name
    await asyncio.to_thread(install, part, final)


async def _receive(peer: Peer, job_id: str, m: Manifest, f: FileEntry, sink: Sink) -> None:
    call = peer.stub.FetchCheckpoint(agent_pb2.FetchCheckpointRequest(
        job_id=job_id, stage=m.stage, step=m.step, name=f.name, offset=sink.size))
    chunks = call.__aiter__()
    started, said = time.monotonic(), time.monotonic()
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(chunks.__anext__(), CHUNK_TIMEOUT_S)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise BadCopy(f"{peer.address} sent nothing for {CHUNK_TIMEOUT_S:.0f} s "
                              f"(at byte {sink.size} of {f.name})") from None
            if sink.size + len(chunk.data) > f.size:
                raise BadCopy(f"{peer.address} sent more of {f.name} than its manifest's "
                              f"{f.size} bytes")
            await asyncio.to_thread(sink.write, chunk.data)
            if time.monotonic() - said >= PROGRESS_EVERY_S:
                said = time.monotonic()
                log.info("checkpoint: fetching stage %d step %d from %s: %.1f of %.1f MiB "
                         "(%.1f MiB/s)", m.stage, m.step, peer.address, sink.size / 2**20,
                         f.size / 2**20, sink.size / 2**20 / max(said - started, 1e-9))
    except grpc.aio.AioRpcError as e:
        raise BadCopy(rpc.describe_rpc_error(e, peer.address)) from e
    finally:
        call.cancel()


def install(part: Path, final: Path) -> None:
    os.replace(part, final)
    ondisk.fsync_dir(final.parent)


async def fetch_step(candidates: Sequence[tuple[Peer, Manifest]], job_id: str,
                     root: Path) -> bool:
    """Install one step from the first candidate (peer, its manifest) that delivers it whole;
    each that fails is logged by address and skipped. True when the step is installed. A full
    disk ends the tries (the next peer's copy would not fit either), logged as an error that
    says what to do."""
    for peer, m in candidates:
        started = time.monotonic()
        try:
            # an old manifest must not vouch for files while they are replaced
            ondisk.manifest_for(root, m.stage, m.step).unlink(missing_ok=True)
            for f in m.files:
                final = ondisk.stage_dir(root, m.stage) / f.name
                if await asyncio.to_thread(ondisk.check_file, final, f.size, f.sha256):
                    await download(peer, job_id, root, m, f)
            await asyncio.to_thread(ondisk.write_manifest, root, m)
        except DiskFull as e:
            log.error("checkpoint: disk full: %s from %s; free space on this agent's disk "
                      "(its --state-dir, or the job's --checkpoint-dir) so that it can hold "
                      "the stage's checkpoints", e.strerror, peer.address)
            return False
        except (BadCopy, OSError) as e:
            log.warning("checkpoint: stage %d step %d of job %s not copied from %s: %s",
                        m.stage, m.step, job_id, peer.address, e)
            continue
        size = sum(f.size for f in m.files)
        log.info("checkpoint: copied stage %d step %d of job %s from %s (%.1f MiB in %.1f s)",
                 m.stage, m.step, job_id, peer.address, size / 2**20,
                 time.monotonic() - started)
        return True
    return False


@dataclass(frozen=True)
class Held:
    """What a stage's copy holds: its newest step and each step's files."""

    newest: int
    files: dict[int, tuple[FileEntry, ...]]


def held(root: Path, stage: int, job_id: str) -> Held:
    """The complete steps this agent holds of `stage` (the cheap check: sizes, not sha256)."""
    found = ondisk.complete_steps(root, stage, job_id)
    return Held(max((m.step for m in found), default=0), {m.step: m.files for m in found})


def assignment_spec(a: common_pb2.Assignment, what: str) -> ModelSpec | None:
    """`a`'s model, or None having logged "checkpoint: WHAT for job J: why" (the worker
    refuses the same assignment, saying why)."""
    try:
        return ModelSpec.from_proto(a.model)
    except ValueError as e:
        log.warning("checkpoint: %s for job %s: %s", what, a.job_id, e)
        return None


class CheckpointCopier:
    """The fetching side: a stage's checkpoint before its worker starts, and mirrors."""

    def __init__(self, root: Path, security: rpc.Security,
                 budget_s: float = PREPARE_BUDGET_S,
                 mirror_interval_s: float = MIRROR_INTERVAL_S, coordinator: str = "") -> None:
        self.root = Path(root)
        self.security = security
        self.coordinator = coordinator  # HOST:PORT this agent joined: for COORDINATOR_PEER
        self.budget_s = budget_s
        self.mirror_interval_s = mirror_interval_s
        self._mirrors: list[asyncio.Task[None]] = []
        # stage -> newest complete step mirrored, for this agent's heartbeats to report
        self.mirrored: dict[int, int] = {}
        self._floor_job, self._floor = "", 0  # the job whose checkpoints this agent's worker
        self._floor_dir: Path | None = None  # writes, and the directory holding its floor

    @staticmethod
    def applies(a: common_pb2.Assignment) -> bool:
        """Copies are for the agents' own directories: not with a shared --checkpoint-dir
        (every rank reads that), and not with checkpoints off."""
        return not a.train.checkpoint_dir and a.train.checkpoint_every != 0

    @contextlib.asynccontextmanager
    async def _peers(self, addresses: Sequence[str]) -> AsyncIterator[list[Peer]]:
        channels: list[grpc.aio.Channel] = []
        peers = []
        try:
            for address in dict.fromkeys(addresses):
                try:
                    channel, peer = open_peer(address, self.security, self.coordinator)
                except rpc.ConfigError as e:
                    log.warning("checkpoint: skipping peer %r: %s", address, e)
                    continue
                channels.append(channel)
                peers.append(peer)
            yield peers
        finally:
            for channel in channels:
                await channel.close()

    async def prepare(self, a: common_pb2.Assignment) -> None:
        """Before rank `a`'s worker starts: for every stage folder its worker will read (its
        own stage, or after a re-split the old stages that held its layers), when a peer
        holds a newer complete checkpoint than this agent holds intact, copy the newest ones
        (up to KEEP) here, so the worker resumes from them. Never raises: on failure or after
        the time budget the worker starts with what is here and says what it resumes from."""
        # a floor names a step of the epoch that set it: the coordinator sets the new one
        self._floor_job, self._floor, self._floor_dir = a.job_id, 0, ondisk.floor_dir(
            self.root, a.job_id, a.train.checkpoint_dir, a.train.checkpoint_every, a.replica)
        if self._floor_dir is not None:
            await asyncio.to_thread(ondisk.write_floor, self._floor_dir, 0)
        if not (a.checkpoint_peers and self.applies(a)):
            return
        root = ondisk.job_dir(self.root, a.job_id)
        try:
            spec = ModelSpec.from_proto(a.model)
            srcs = ondisk.sources(a.model.n_layers, a.stage, (a.layer_begin, a.layer_end),
                                  list(a.checkpoint_splits))
        except ValueError as e:  # the worker refuses the same assignment, saying why
            log.warning("checkpoint: not fetching stage %d of job %s: %s", a.stage, a.job_id, e)
            return
        try:
            async with asyncio.timeout(self.budget_s):
                for src in srcs:
                    have = await asyncio.to_thread(ondisk.newest_intact, root, src.stage, a.job_id,
                                                   src.layers, a.resume_before)
                    await self._prepare(a, spec, root, src, have)
        except TimeoutError:
            log.warning("checkpoint: gave up fetching stage(s) %s of job %s after %.0f s; the "
                        "worker starts with what this agent holds (a partial download "
                        "resumes next time)", [s.stage for s in srcs], a.job_id, self.budget_s)
        except Exception:  # noqa: BLE001 - the worker must start whatever happened here
            log.exception("checkpoint: fetching stage(s) %s of job %s failed; the worker "
                          "starts with what this agent holds", [s.stage for s in srcs],
                          a.job_id)

    async def _prepare(self, a: common_pb2.Assignment, spec: ModelSpec, root: Path,
                       src: ondisk.Source, have: int) -> None:
        stage, layers = src.stage, src.layers
        async with self._peers(a.checkpoint_peers) as peers:
            listings = await asyncio.gather(*(list_peer(p, a.job_id, stage, spec, layers)
                                              for p in peers),
                                            return_exceptions=True)
            by_step: dict[int, list[tuple[Peer, Manifest]]] = {}
            unasked = []
            for peer, found in zip(peers, listings, strict=True):
                if isinstance(found, BaseException):
                    why = (rpc.describe_rpc_error(found, peer.address)
                           if isinstance(found, grpc.RpcError) else repr(found))
                    log.info("checkpoint: peer %s did not list stage %d: %s", peer.address,
                             stage, why)
                    unasked.append(why)
                    continue
                for m in found:
                    if m.layers in (None, layers):  # other layers: another split's step
                        by_step.setdefault(m.step, []).append((peer, m))
            # a rollback resumes before its bound: steps from it on are of no use
            newer = sorted(s for s in by_step if have < s < (a.resume_before or s + 1))[-KEEP:]
            if peers and len(unasked) == len(peers):
                log.warning("checkpoint: stage %d of job %s: none of the %d peers could be "
                            "asked for its checkpoints (%s); the worker starts from step %d",
                            stage, a.job_id, len(peers), unasked[0], have)
                return
            if not newer:
                log.info("checkpoint: stage %d (layers %d-%d) of job %s: this agent holds "
                         "step %d, no peer holds a newer one", stage, layers[0], layers[1] - 1,
                         a.job_id, have)
                return
            log.info("checkpoint: stage %d (layers %d-%d) of job %s: this agent holds step "
                     "%d, peers hold step %d: fetching steps %s before the worker starts",
                     stage, layers[0], layers[1] - 1, a.job_id, have, newer[-1], newer)
            # newest first (within the time budget, the one the worker resumes from; the older
            # is the fall-back), each from the first holder in the coordinator's order: the
            # best link into this agent. Not the two at once from two holders: the second's
            # link can be far slower (1.1 s against 9.8 s across the emulated WAN), and the
            # worker waits for both.
            got = sorted([s for s in newer[::-1] if await fetch_step(by_step[s], a.job_id, root)])
        if got:
            await asyncio.to_thread(ondisk.prune, root, stage, got[-1])
        else:
            log.warning("checkpoint: stage %d of job %s: no peer delivered steps %s; the "
                        "worker starts from step %d or older", stage, a.job_id, newer, have)

    async def keep_from(self, job_id: str, step: int) -> None:
        """Keep every checkpoint step of `job_id` from `step` on, as the coordinator asks
        (`Ack.keep_checkpoints_from`), where this agent's worker prunes (`ondisk.floor_dir`)."""
        if step and job_id == self._floor_job and step != self._floor and self._floor_dir:
            try:
                await asyncio.to_thread(ondisk.write_floor, self._floor_dir, step)
            except OSError as e:  # the heartbeat goes on; the worker's own write says more
                log.warning("checkpoint: cannot record that step %d of job %s must be kept: "
                            "%s", step, job_id, e)
                return
            self._floor = step

    # ---- mirrors ----

    def start_mirrors(self, a: common_pb2.Assignment) -> None:
        """Keep copies of the stages `a.mirrors` names while `a` runs (until stop_mirrors)."""
        if not self.applies(a) or (spec := assignment_spec(a, "not mirroring")) is None:
            return
        for mirror in a.mirrors:
            if mirror.pushed:  # its holder cannot be dialled and pushes it here instead
                continue  # (dtfm/checkpoints/push.py)
            if mirror.stage == a.stage:
                log.warning("checkpoint: not mirroring stage %d of job %s: this agent runs "
                            "it", mirror.stage, a.job_id)
                continue
            log.info("checkpoint: mirroring stage %d of job %s from %s every %g s",
                     mirror.stage, a.job_id, mirror.peer, self.mirror_interval_s)
            self._mirrors.append(asyncio.create_task(
                self._mirror(a.job_id, mirror.stage, mirror.peer, spec)))

    async def stop_mirrors(self) -> None:
        tasks, self._mirrors = self._mirrors, []
        self.mirrored = {}
        await retryloop.cancel_all(tasks)

    async def _mirror(self, job_id: str, stage: int, address: str, spec: ModelSpec) -> None:
        async with self._peers([address]) as peers:
            if not peers:
                return
            await retryloop.every(self.mirror_interval_s,
                                  lambda: self.mirror_once(peers[0], job_id, stage, spec),
                                  f"mirror stage {stage} of job {job_id} from {address}",
                                  address, log)

    async def mirror_once(self, peer: Peer, job_id: str, stage: int, spec: ModelSpec
                          ) -> list[int]:
        """Make this agent's copy of `stage` follow `peer`'s: copy its newest KEEP steps
        that are missing here or differ (the job resumed from an older step and rewrote
        them), then prune as a worker would, so steps the peer abandoned go too, and note the
        newest step now held in `mirrored` for the heartbeats. Returns the steps copied."""
        theirs = (await list_peer(peer, job_id, stage, spec))[-KEEP:]
        if not theirs:
            return []
        root = ondisk.job_dir(self.root, job_id)
        mine = await asyncio.to_thread(held, root, stage, job_id)
        copied = []
        for m in theirs:
            if mine.files.get(m.step) != m.files:
                if not await fetch_step([(peer, m)], job_id, root):
                    return copied
                copied.append(m.step)
        if copied or mine.newest != theirs[-1].step:
            await asyncio.to_thread(ondisk.prune, root, stage, theirs[-1].step)
        self.mirrored[stage] = theirs[-1].step  # every one of `theirs` is held here now
        return copied

