"""The coordinator's copy of last resort of stage checkpoints (issue 32).

Without shared storage a stage's checkpoint lives on the agents that wrote it, and a second
copy is pulled by (or pushed to) another member of the job (dtfm/checkpoints/copies.py,
dtfm/checkpoints/push.py). When no member of the job can be dialled (every agent behind a NAT
or firewall) nobody can take that copy, and losing an agent would lose its stage. Every agent
dials the coordinator, so there the stage's holder pushes it instead
(`dtfm.core.assignment.COORDINATOR_PEER` in its `checkpoint_pushes`), store and forward:

- **Receiving** (`Coordinator.PushCheckpoint`): through the agents' own receiving path
  (`dtfm.checkpoints.push.answer_push` / `install_push`: first message checked, files written
  to hidden partial names, checked for size and sha256, renamed into place, the manifest
  last), behind the same authenticated server (the join token, or mTLS). Accepted only from
  the stage's own holder, proven by its agent secret, for the job the coordinator runs while it
  has not ended and a step it can have reached (the gate the daemon passes in:
  coordinator/daemon/pushgate.py), all decided before anything is reserved or written; within
  the size the model allows for the
  step's layers (`dtfm.core.checkpoints.size_problem`), and within `--checkpoint-store-mib`
  for everything held: a push that would exceed it is refused (RESOURCE_EXHAUSTED) and logged
  as an error naming the flag. One step per (job, stage) is kept, the newest pushed: the
  holder pushes only its newest, and a push replaces what was held (a job that resumed from
  an older step rewrites it). While a replacement is written the old step is still on disk,
  so the disk briefly holds up to twice a stage.
- **Serving** (`Coordinator.ListCheckpoints` / `FetchCheckpoint`): the same calls and
  messages agents serve, answered by the agents' own `CheckpointStore` over this folder, so an
  agent fetches from the coordinator exactly as from a peer (`COORDINATOR_PEER` in its
  `checkpoint_peers`).
- **Removing**: a job's copies go when the job ends (done or failed) and, at start, those of
  any other job an earlier run left (`keep_only`); without `--state-dir` the folder is a
  temporary one removed when the coordinator exits.

`held` feeds `coordinator status` (stages, steps, bytes); `floor` the steps agents keep.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc

from dtfm.checkpoints.copies import CheckpointStore
from dtfm.checkpoints.push import Pusher, Refused, answer_push, install_push, pusher_of
from dtfm.core import checkpoints as ondisk
from dtfm.core.checkpoints import Manifest
from dtfm.core.spec import ModelSpec
from protos.dtfm.v1 import agent_pb2, coordinator_pb2

log = logging.getLogger(__name__)

FOLDER = "checkpoints"  # under --state-dir
# whether `pusher` may push step `m` of job `job_id`: its model if so, Refused if not
Admit = Callable[[Pusher, str, Manifest], ModelSpec]


class CoordinatorCopies:
    """Stage checkpoints pushed to the coordinator: the newest step of each (job, stage)."""

    def __init__(self, state_dir: str | Path, cap_bytes: int, admit: Admit) -> None:
        if state_dir:
            self.root = Path(state_dir) / FOLDER
        else:  # nothing to keep across runs: a private folder gone at exit
            self.root = Path(tempfile.mkdtemp(prefix="dtfm-coordinator-checkpoints-"))
            atexit.register(shutil.rmtree, self.root, True)
        self.cap_bytes = cap_bytes
        self.admit = admit
        self.serving = CheckpointStore(self.root)
        # (job folder, stage) -> the step held and its bytes; pushes in flight reserve theirs
        self._held: dict[tuple[str, int], tuple[int, int]] = _scan(self.root)
        self._reserved: dict[tuple[str, int], int] = {}
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}

    # ---- the calls ----

    async def list(self, request: agent_pb2.ListCheckpointsRequest,
                   context: grpc.aio.ServicerContext) -> agent_pb2.CheckpointList:
        return await self.serving.list(request, context)

    def fetch(self, request: agent_pb2.FetchCheckpointRequest,
              context: grpc.aio.ServicerContext) -> AsyncIterator[agent_pb2.CheckpointChunk]:
        return self.serving.fetch(request, context)

    async def push(self, requests: AsyncIterator[agent_pb2.CheckpointPush],
                   context: grpc.aio.ServicerContext) -> agent_pb2.CheckpointPushReply:
        pusher = pusher_of(context)

        async def receive(messages: AsyncIterator[agent_pb2.CheckpointPush],
                          first: agent_pb2.CheckpointPush, m: Manifest,
                          who: str) -> agent_pb2.CheckpointPushReply:
            spec = self.admit(pusher, first.job_id, m)  # before a byte is reserved
            return await self._receive(messages, first, m, f"agent {pusher[0]} ({who})", spec)

        return await answer_push(requests, context, receive)

    async def _receive(self, messages: AsyncIterator[agent_pb2.CheckpointPush],
                       first: agent_pb2.CheckpointPush, m: Manifest,
                       who: str, spec: ModelSpec) -> agent_pb2.CheckpointPushReply:
        if too_big := ondisk.size_problem(m, spec):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"stage {m.stage} step {m.step}: {too_big}")
        key = (ondisk.job_key(first.job_id), m.stage)
        size = sum(f.size for f in m.files)
        async with self._locks.setdefault(key, asyncio.Lock()):
            others = sum(b for k, (_, b) in self._held.items() if k != key) + sum(
                b for k, b in self._reserved.items() if k != key)
            if others + size > self.cap_bytes:
                why = (f"stage {m.stage} step {m.step} of job {first.job_id} ({_mib(size)}) "
                       f"does not fit in --checkpoint-store-mib {_mib(self.cap_bytes)}, "
                       f"{_mib(others)} of which hold other stages: it has no copy anyone "
                       f"can fetch; raise --checkpoint-store-mib (or free the coordinator's "
                       f"disk first)")
                log.error("checkpoint: %s", why)
                raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
            self._reserved[key] = size
            root = ondisk.job_dir(self.root, first.job_id)
            committed = False
            try:
                await install_push(messages, root, m)
                committed = True
            except asyncio.CancelledError:
                # the pusher hung up: its step counts if its manifest is in place (install_push
                # lets the manifest's write finish), or status and the keep floor would name
                # a step the disk no longer holds
                committed = ondisk.manifest_for(root, m.stage, m.step).exists()
                raise
            finally:
                del self._reserved[key]
                if committed:
                    keep_one(root, m.stage, m.step)  # a few unlinks: no thread to cancel
                    self._held[key] = (m.step, size)
                elif key in self._held and not ondisk.manifest_for(
                        root, m.stage, self._held[key][0]).exists():
                    del self._held[key]  # a failed push of the step held took its manifest
        log.info("checkpoint: stage %d step %d of job %s pushed to the coordinator by %s "
                 "(%s; nobody can dial a member of the job)", m.stage, m.step, first.job_id,
                 who, _mib(size))
        return agent_pb2.CheckpointPushReply(step=m.step)

    # ---- what is held ----

    def held(self, job_id: str) -> list[coordinator_pb2.HeldCheckpoint]:
        """The stages of `job_id` held here, in stage order: their step and bytes."""
        key = ondisk.job_key(job_id) if job_id else ""
        return [coordinator_pb2.HeldCheckpoint(stage=stage, step=step, bytes=size)
                for (job, stage), (step, size) in sorted(self._held.items()) if job == key]

    def floor(self, job_id: str, stages: int, floor: int) -> int:
        """The keep-from floor (`CheckpointTracker.floor`: the oldest step every agent must
        keep, 0 none) lowered to the oldest step held here of stages 0..`stages`-1: a stage
        lost with all its agents resumes from this copy, which lags its holder by the pushes
        in flight, so every other stage must still hold its step (agents keep KEEP steps
        otherwise, and a fast job outruns that)."""
        mine = [c.step for c in self.held(job_id) if c.stage < stages]
        if not mine:
            return floor
        return min(floor, min(mine)) if floor else max(1, min(mine))

    async def remove(self, job_id: str, why: str) -> None:
        """Delete every copy of `job_id` (it ended): nothing is left behind."""
        key = ondisk.job_key(job_id)
        gone = [k for k in self._held if k[0] == key]
        for k in gone:
            del self._held[k]
        path = ondisk.job_dir(self.root, job_id)
        if path.exists():
            await asyncio.to_thread(shutil.rmtree, path, True)
            log.info("checkpoint: removed the coordinator's copies of job %s (%d stages): %s",
                     job_id, len(gone), why)

    async def keep_only(self, *job_ids: str) -> None:
        """Delete the copies of every job but `job_ids` (an earlier run's, left in the
        --state-dir): those of the jobs the coordinator runs now stay."""
        others = [set(await asyncio.to_thread(ondisk.other_jobs, self.root, j)) for j in job_ids]
        for other in sorted(set.intersection(*others)) if others else []:
            for k in [k for k in self._held if k[0] == other]:
                del self._held[k]
            await asyncio.to_thread(shutil.rmtree, self.root / other, True)
            log.info("checkpoint: removed the coordinator's copies of %s (not the job it "
                     "runs now)", other)


def keep_one(root: Path, stage: int, step: int) -> None:
    """Delete every file of `stage` in job folder `root` but step `step`'s (older and newer
    steps, partial downloads, temp files)."""
    for p in ondisk.stage_dir(root, stage).iterdir():
        m = (ondisk.DATA_RE.match(p.name) or ondisk.MANIFEST_RE.match(p.name)
             or ondisk.TMP_RE.match(p.name) or ondisk.PART_RE.match(p.name))
        if m and int(m.group(1)) != step:
            p.unlink(missing_ok=True)


def _scan(root: Path) -> dict[tuple[str, int], tuple[int, int]]:
    """What an earlier run left under `root`: the newest complete step of each stage."""
    found: dict[tuple[str, int], tuple[int, int]] = {}
    if not root.is_dir():
        return found
    for job in root.iterdir():
        for stage_dir in (job.iterdir() if job.is_dir() else ()):
            if not ondisk.STAGE_RE.match(stage_dir.name):
                continue
            stage = int(stage_dir.name.removeprefix("stage-"))
            if steps := ondisk.complete_steps(job, stage):
                found[(job.name, stage)] = (steps[-1].step,
                                            sum(f.size for f in steps[-1].files))
    return found


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
