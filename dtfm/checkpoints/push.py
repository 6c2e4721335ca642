"""Checkpoint copies pushed by an agent nobody can dial (issue 32).

A stage with one replica is kept by two agents: its holder writes it, and a mirror copies it
(dtfm/checkpoints/copies.py pulls over the holder's `Agent` port). An agent behind a NAT or a
firewall accepts no connection, so nobody can pull from it: its stage would have no second
copy, and losing it would lose the stage's progress. When the coordinator finds the holder
undialable and the mirror dialable (`dtfm.core.assignment.checkpoint_routes`), it turns the
copy around: the holder's assignment names the mirror in `checkpoint_pushes`, the mirror's
names the stage in `mirrors` with `pushed` set, and

- **pushing** (`CheckpointPushes.start`, on the holder): every few seconds, list what the
  mirror holds of the stage (`ListCheckpoints`, a dial out), and upload each of its own
  newest KEEP complete steps the mirror lacks or holds otherwise (`PushCheckpoint`, one
  client stream per step: the step's manifest, then its files' bytes in order);
- **receiving** (`CheckpointPushes.receive`, behind `Agent.PushCheckpoint`): accepted only
  for a stage the running assignment mirrors as pushed (and through the same authenticated
  server as every `Agent` call: the join token, or the cluster's mTLS), refused before a
  byte is written when the step declares more than the model's layers allow
  (`dtfm.core.checkpoints.size_problem`, the cap a pulled copy gets), each file written to
  the same hidden partial name a download uses, checked for size and sha256, then renamed
  into place, the manifest last; then pruned as a mirror prunes, and reported in the
  heartbeats' mirrored steps (`CheckpointCopier.mirrored`), as a pulled mirror is.

Where no member of the job can be dialled, the holder pushes its stage to the coordinator
instead (`COORDINATOR_PEER`, `Coordinator.PushCheckpoint`: every agent dials it), the copy of
last resort, which keeps only the newest step (coordinator/job/checkpointcopies.py, through
`answer_push` and `install_push` here: one receiving path for both). The join token proves
nothing there (every volunteer holds it), so that push alone carries the pusher's id and the
secret its coordinator issued (`pusher_metadata`, read back by `pusher_of`); a push to a peer
agent never does, since the secret would let that peer act as this agent.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc

from dtfm import rpc
from dtfm.checkpoints import retryloop
from dtfm.checkpoints.copies import (
    CHUNK_BYTES,
    CHUNK_TIMEOUT_S,
    MIRROR_INTERVAL_S,
    CheckpointCopier,
    Peer,
    Sink,
    assignment_spec,
    entry_of,
    install,
    list_peer,
    manifest_of,
    open_peer,
)
from dtfm.core import checkpoints as ondisk
from dtfm.core.assignment import COORDINATOR_PEER
from dtfm.core.checkpoints import KEEP, Manifest
from dtfm.core.limits import MAX_NAME, text_problem
from dtfm.core.spec import ModelSpec
from protos.dtfm.v1 import agent_pb2, common_pb2

T = TypeVar("T")

log = logging.getLogger(__name__)


AGENT_ID_KEY = "dtfm-agent-id"  # call metadata of a push to the coordinator
SECRET_KEY = "dtfm-agent-secret"
Pusher = tuple[str, str]  # (agent id, agent secret) a push to the coordinator claims
Metadata = tuple[tuple[str, str], ...]


def pusher_metadata(agent_id: str, secret: str) -> Metadata:
    """The call metadata proving a push to the coordinator comes from agent `agent_id`."""
    return ((AGENT_ID_KEY, agent_id), (SECRET_KEY, secret))


def pusher_of(context: grpc.aio.ServicerContext) -> Pusher:
    """The (agent id, secret) a push claims in its metadata; "" for what is missing."""
    sent = dict(context.invocation_metadata() or ())
    agent_id, secret = sent.get(AGENT_ID_KEY, ""), sent.get(SECRET_KEY, "")
    return (agent_id if isinstance(agent_id, str) else "",
            secret if isinstance(secret, str) else "")


class Refused(Exception):
    """A push this agent does not install: the status code and why, for the pusher."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class CheckpointPushes:
    """Both ends of a pushed copy: uploading this agent's stage to its mirror, and accepting
    the uploads of the stages this agent mirrors as pushed."""

    def __init__(self, root: Path, security: rpc.Security,
                 copier: CheckpointCopier | None = None,
                 interval_s: float = MIRROR_INTERVAL_S, coordinator: str = "") -> None:
        self.root = Path(root)
        self.security = security
        self.coordinator = coordinator  # HOST:PORT this agent joined: for COORDINATOR_PEER
        self.copier = copier  # its `mirrored` feeds the heartbeats
        self.interval_s = interval_s
        # this agent's id and the secret its coordinator issued, as they are now (they change
        # when it re-joins): a push to the coordinator proves them; None: not joined (tests)
        self.identity: Callable[[], Pusher] | None = None
        self._accepting: dict[tuple[str, int], ModelSpec] = {}  # (job, stage) -> its model
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._tasks: list[asyncio.Task[None]] = []

    # ---- the assignment's pushes, both ways ----

    def start(self, a: common_pb2.Assignment) -> None:
        """Accept the pushed mirrors `a` names, and push `a.checkpoint_pushes` (until stop)."""
        if not CheckpointCopier.applies(a) or not (
                a.checkpoint_pushes or any(m.pushed for m in a.mirrors)):
            return
        if (spec := assignment_spec(a, "no pushed copies")) is None:
            return
        for m in a.mirrors:
            if m.pushed:
                self._accepting[(a.job_id, m.stage)] = spec
                log.info("checkpoint: keeping stage %d of job %s as its holder %s pushes it "
                         "(nobody can dial the holder)", m.stage, a.job_id, m.peer)
        for push in a.checkpoint_pushes:
            if push.stage != a.stage:
                log.warning("checkpoint: not pushing stage %d of job %s: this agent runs "
                            "stage %d", push.stage, a.job_id, a.stage)
                continue
            log.info("checkpoint: pushing stage %d of job %s to %s every %g s (nobody can "
                     "dial this agent to pull it)", push.stage, a.job_id, push.peer,
                     self.interval_s)
            self._tasks.append(asyncio.create_task(
                self._push_loop(a.job_id, push.stage, push.peer, spec)))

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        self._accepting.clear()
        await retryloop.cancel_all(tasks)

    # ---- pushing ----

    async def _push_loop(self, job_id: str, stage: int, address: str, spec: ModelSpec) -> None:
        try:
            channel, peer = open_peer(address, self.security, self.coordinator)
        except rpc.ConfigError as e:
            log.warning("checkpoint: cannot push stage %d of job %s to %r: %s", stage, job_id,
                        address, e)
            return
        if address != COORDINATOR_PEER:
            async with channel:
                await retryloop.every(self.interval_s,
                                      lambda: self.push_once(peer, job_id, stage, spec),
                                      f"push stage {stage} of job {job_id} to {address}",
                                      address, log)
            return

        async def to_coordinator() -> None:
            """It keeps one step per stage (coordinator/job/checkpointcopies.py), and only
            while it runs the job: refused as a precondition, the job ended (or that
            coordinator runs another), so pushing again would only resend the bytes."""
            proof = pusher_metadata(*self.identity()) if self.identity is not None else ()
            try:
                await self.push_once(peer, job_id, stage, spec, keep=1, metadata=proof)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                log.info("checkpoint: stopped pushing stage %d of job %s to the coordinator: "
                         "%s", stage, job_id, e.details())
                task = asyncio.current_task()
                assert task is not None
                task.cancel()  # ends the loop at its next sleep

        async with channel:
            await retryloop.every(self.interval_s, to_coordinator,
                                  f"push stage {stage} of job {job_id} to the coordinator",
                                  self.coordinator, log)

    async def push_once(self, peer: Peer, job_id: str, stage: int, spec: ModelSpec,
                        keep: int = KEEP, metadata: Metadata = ()) -> list[int]:
        """Make `peer`'s copy of `stage` follow this agent's: upload each of the newest `keep`
        complete steps it lacks or holds otherwise (oldest first), each call with `metadata`.
        Returns the steps sent."""
        root = ondisk.job_dir(self.root, job_id)
        mine = (await asyncio.to_thread(ondisk.complete_steps, root, stage, job_id))[-keep:]
        if not mine:
            return []
        theirs = {m.step: m.files for m in await list_peer(peer, job_id, stage, spec)}
        todo = [m for m in mine if theirs.get(m.step) != m.files]
        if not todo and max(theirs, default=0) != mine[-1].step:
            todo = [mine[-1]]  # it holds newer steps this agent abandoned: it prunes them
        for m in todo:
            await push_step(peer, job_id, root, m, newest=mine[-1].step, metadata=metadata)
        return [m.step for m in todo]

    # ---- receiving ----

    async def receive(self, requests: AsyncIterator[agent_pb2.CheckpointPush],
                      context: grpc.aio.ServicerContext) -> agent_pb2.CheckpointPushReply:
        """`Agent.PushCheckpoint`: install one pushed step, or abort saying why not."""
        return await answer_push(requests, context, self._receive)

    async def _receive(self, messages: AsyncIterator[agent_pb2.CheckpointPush],
                       first: agent_pb2.CheckpointPush, m: Manifest,
                       who: str) -> agent_pb2.CheckpointPushReply:
        key = (first.job_id, m.stage)
        spec = self._accepting.get(key)
        if spec is None:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this agent keeps no pushed copy of stage {key[1]} of job {key[0]} "
                          "(its assignment names none: not started yet, or re-planned); "
                          "the pusher tries again with its next assignment")
        if too_big := ondisk.size_problem(m, spec):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"stage {m.stage} step {m.step}: {too_big}")
        async with self._locks.setdefault(key, asyncio.Lock()):
            root = ondisk.job_dir(self.root, first.job_id)
            await install_push(messages, root, m)
            kept = await asyncio.to_thread(ondisk.prune, root, m.stage,
                                           max(first.newest, m.step))
        if self.copier is not None and kept:
            self.copier.mirrored[m.stage] = kept[-1]
        log.info("checkpoint: stage %d step %d of job %s pushed here by %s (%.1f MiB)",
                 m.stage, m.step, first.job_id, who, sum(f.size for f in m.files) / 2**20)
        return agent_pb2.CheckpointPushReply(step=m.step)


# ---- receiving, shared with the coordinator's copy of last resort ----

Handler = Callable[[AsyncIterator[agent_pb2.CheckpointPush], agent_pb2.CheckpointPush,
                    Manifest, str], Awaitable[agent_pb2.CheckpointPushReply]]


async def answer_push(requests: AsyncIterator[agent_pb2.CheckpointPush],
                      context: grpc.aio.ServicerContext,
                      handle: Handler) -> agent_pb2.CheckpointPushReply:
    """A `PushCheckpoint` call (the agents' and the coordinator's): read and check the
    first message (`read_push`), then let `handle(messages, first, manifest, caller)` decide
    whether to keep the step and install it (`install_push`); a `Refused` from either aborts
    the call with its status and reason, logged."""
    messages = requests.__aiter__()
    try:
        first, m = await read_push(messages)
        return await handle(messages, first, m, context.peer())
    except Refused as e:
        log.warning("checkpoint: refused a push from %s: %s", context.peer(), e)
        await context.abort(e.code, str(e))
        raise AssertionError("unreachable: abort raises") from e  # pragma: no cover


async def read_push(messages: AsyncIterator[agent_pb2.CheckpointPush]
                    ) -> tuple[agent_pb2.CheckpointPush, Manifest]:
    """A push's first message and the step it declares; Refused when malformed."""
    first = await _next(messages)
    bad = grpc.StatusCode.INVALID_ARGUMENT
    if first is None or not first.HasField("entry") or first.data:
        raise Refused(bad, "a push starts with one message naming the job and the step "
                           "(job_id, entry, newest); the files' bytes follow in later ones")
    if problem := ("job_id is empty" if not first.job_id
                   else text_problem("job_id", first.job_id, MAX_NAME)):
        raise Refused(bad, f"{problem}: give the job id of the assignment")
    try:
        return first, manifest_of(first.job_id, first.entry)
    except ValueError as e:
        raise Refused(bad, f"malformed step: {e}") from e


async def install_push(messages: AsyncIterator[agent_pb2.CheckpointPush], root: Path,
                       m: Manifest) -> None:
    """Install step `m` into job folder `root` from the rest of a push; a full disk is
    Refused as RESOURCE_EXHAUSTED (the partial file deleted)."""
    try:
        await _install(messages, root, m)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the disk of the receiving end is full ({e.strerror}): "
                          f"stage {m.stage} step {m.step} was not copied") from e
        raise


async def _install(messages: AsyncIterator[agent_pb2.CheckpointPush], root: Path,
                   m: Manifest) -> None:
    """The files of `m` from `messages`, each checked and renamed into place, and the
    manifest last (a partial push leaves no step a worker would load)."""
    await asyncio.to_thread(ondisk.private_dir, ondisk.stage_dir(root, m.stage))
    # an old manifest must not vouch for files while they are replaced
    await asyncio.to_thread(ondisk.manifest_for(root, m.stage, m.step).unlink, True)
    pending = b""
    for f in m.files:
        part = ondisk.part_for(root, m.stage, f.name, f.sha256)
        await asyncio.to_thread(part.unlink, True)
        sink = Sink(part)
        await asyncio.to_thread(sink.open)
        try:
            while sink.size < f.size:
                if not pending:
                    pending = await _data(messages, f"{sink.size} of {f.size} bytes of "
                                                    f"{f.name}")
                take = f.size - sink.size
                await asyncio.to_thread(sink.write, pending[:take])
                pending = pending[take:]
            await asyncio.to_thread(sink.finish)
        except BaseException:
            sink.close()
            await asyncio.to_thread(part.unlink, True)
            raise
        if sink.sha.hexdigest() != f.sha256:
            await asyncio.to_thread(part.unlink, True)
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{f.name} fails its checksum (sha256 "
                          f"{sink.sha.hexdigest()[:16]}..., the step says "
                          f"{f.sha256[:16]}...); deleted")
        await asyncio.to_thread(install, part, ondisk.stage_dir(root, m.stage) / f.name)
    if pending or await _next(messages) is not None:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"the push sent more bytes than step {m.step}'s files hold")
    await settled(ondisk.write_manifest, root, m)


async def settled(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in a thread, waited for to its end even when the caller is cancelled (and
    the cancellation raised after): a call the pusher hangs up on while its step is committed
    leaves the thread writing on, and whoever keeps records of what is on disk must look only
    once the disk has settled."""
    done = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        await asyncio.wait([done])
        raise


async def _next(messages: AsyncIterator[agent_pb2.CheckpointPush]
                ) -> agent_pb2.CheckpointPush | None:
    """The next message, None at the end; a pusher silent for CHUNK_TIMEOUT_S is refused."""
    try:
        return await asyncio.wait_for(messages.__anext__(), CHUNK_TIMEOUT_S)
    except StopAsyncIteration:
        return None
    except TimeoutError:
        raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED,
                      f"the pusher sent nothing for {CHUNK_TIMEOUT_S:.0f} s") from None


async def _data(messages: AsyncIterator[agent_pb2.CheckpointPush], at: str) -> bytes:
    """The next message's bytes; refused when the push ends, or sends anything else."""
    msg = await _next(messages)
    if msg is None:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"the push ended after {at}")
    if msg.job_id or msg.HasField("entry") or not msg.data:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      "after the first message a push carries only bytes (data)")
    return msg.data


async def push_step(peer: Peer, job_id: str, root: Path, m: Manifest, newest: int,
                    metadata: Metadata = ()) -> int:
    """Upload step `m` of this agent's job folder `root` to `peer` (the call carrying
    `metadata`: `pusher_metadata` for the coordinator); the step it installed.
    A file pruned or shortened meanwhile ends the stream early: the peer refuses the step
    (nothing half-written is installed), and the next round sends the steps held then."""

    async def messages() -> AsyncIterator[agent_pb2.CheckpointPush]:
        yield agent_pb2.CheckpointPush(job_id=job_id, entry=entry_of(m), newest=newest)
        for f in m.files:
            try:
                fh = await asyncio.to_thread(open, ondisk.stage_dir(root, m.stage) / f.name,
                                             "rb")
            except OSError as e:
                log.info("checkpoint: %s of stage %d vanished before it was pushed (%s)",
                         f.name, m.stage, e.strerror)
                return
            with fh:  # an open file keeps its bytes even if the worker prunes the step
                left = f.size
                while left > 0:
                    data = await asyncio.to_thread(fh.read, min(CHUNK_BYTES, left))
                    if not data:
                        return
                    left -= len(data)
                    yield agent_pb2.CheckpointPush(data=data)

    reply = await peer.stub.PushCheckpoint(messages(), metadata=metadata or None)
    log.info("checkpoint: pushed stage %d step %d of job %s to %s", m.stage, m.step, job_id,
             peer.address)
    return reply.step
