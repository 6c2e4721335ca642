"""Checkpoints copied agent to agent: listing, fetching, checksums, resuming, refusals, mirrors.

Real agent gRPC servers (the daemon's own `AgentService`, token and all) run in-process on
free loopback ports over their own checkpoint directories; the fetching side is the daemon's
own `CheckpointCopier`. Faults come through seams: a server subclass that cuts a transfer off
after its first chunk, a file damaged on the serving disk. No torch: the bytes are random, the
manifests real.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from agent.daemon.server import AgentService
from agent.daemon.supervisor import Supervisor
from dtfm import rpc
from dtfm.checkpoints.copies import CHUNK_BYTES, CheckpointCopier, CheckpointStore, Peer, held
from dtfm.core import checkpoints as ondisk
from dtfm.core.checkpoints import FileEntry, Manifest
from dtfm.core.presets import get_preset
from dtfm.core.workerstate import WorkerState
from protos.dtfm.v1 import agent_pb2, agent_pb2_grpc, common_pb2
from tests.agent.servers import serving as serving_agent
from tests.daemons import TOKEN
from tests.smalldisk import small_disk

pytestmark = pytest.mark.timeout(60)
JOB = "job-1a2b3c4d"
SECURITY = rpc.Security(token=TOKEN)
SIZE = 2 * CHUNK_BYTES + 12345  # three chunks: a cut after the first leaves a partial file
SPEC = get_preset("gpt-tiny")  # four layers: stages 0 and 1 of two layers each


def write_step(root: Path, stage: int, step: int, data: bytes, job: str = JOB,
               layers: tuple[int, int] | None = (0, 2)) -> Manifest:
    """What a worker's `save_stage` leaves in agent root `root`, without torch."""
    job_root = ondisk.job_dir(root, job)
    path = ondisk.path_for(job_root, stage, step)
    ondisk.atomic_write(path, lambda f: f.write(data))
    m = Manifest(job, stage, step, layers,
                 (FileEntry(path.name, len(data), hashlib.sha256(data).hexdigest()),))
    ondisk.write_manifest(job_root, m)
    ondisk.prune(job_root, stage, step)
    return m


def payload(step: int) -> bytes:
    return hashlib.sha256(str(step).encode()).digest() * (SIZE // 32) + b"x" * (SIZE % 32)


def assignment(peers: list[str], stage: int = 0, mirrors: tuple[tuple[int, str], ...] = (),
               ) -> common_pb2.Assignment:
    return common_pb2.Assignment(
        job_id=JOB, stage=stage, layer_begin=2 * stage, layer_end=2 * stage + 2,
        model=SPEC.to_proto(), train=common_pb2.TrainConfig(checkpoint_every=2),
        checkpoint_peers=peers,
        mirrors=[common_pb2.CheckpointMirror(stage=s, peer=p) for s, p in mirrors])


@contextlib.asynccontextmanager
async def serving(root: Path, service: type[AgentService] = AgentService
                  ) -> AsyncIterator[str]:
    """An agent's gRPC server over checkpoint root `root`; yields its address."""
    svc = service(common_pb2.AgentInfo(agent_id="t", host="127.0.0.1"), CheckpointStore(root))
    async with serving_agent(svc, SECURITY) as address:
        yield address


async def eventually(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def steps_held(root: Path, stage: int) -> list[int]:
    """Steps agent root `root` holds intact (the worker's check, sha256 included)."""
    job_root = ondisk.job_dir(root, JOB)
    return [s for s in ondisk.steps_available(job_root, stage)
            if ondisk.verify(job_root, stage, s, job_id=JOB) is None]


def leftovers(root: Path, stage: int) -> list[str]:
    d = ondisk.stage_dir(ondisk.job_dir(root, JOB), stage)
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def run(coro: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(coro())  # type: ignore[arg-type]


# ---- listing and fetching ----


def test_a_stage_is_listed_and_fetched_whole(tmp_path: Path) -> None:
    holder, taker = tmp_path / "holder", tmp_path / "taker"
    for step in (2, 4):
        write_step(holder, 0, step, payload(step))
    # neither an unfinished step (no manifest) nor a truncated one is offered
    job_root = ondisk.job_dir(holder, JOB)
    ondisk.path_for(job_root, 0, 6).write_bytes(b"half a write")
    ondisk.path_for(job_root, 1, 4).parent.mkdir()
    write_step(holder, 1, 4, payload(4), layers=(2, 4))
    with open(ondisk.path_for(job_root, 1, 4), "r+b") as f:
        f.truncate(100)

    async def main() -> None:
        async with serving(holder) as address:
            async with grpc.aio.insecure_channel(address) as ch:
                stub = agent_pb2_grpc.AgentStub(ch)
                auth = (("authorization", f"Bearer {TOKEN}"),)
                listed = await stub.ListCheckpoints(
                    agent_pb2.ListCheckpointsRequest(job_id=JOB, stage=0), metadata=auth)
                assert [(e.stage, e.step, list(e.layers)) for e in listed.entries] == \
                    [(0, 2, [0, 2]), (0, 4, [0, 2])]
                assert [(f.name, f.size) for f in listed.entries[1].files] == \
                    [("step-00000004.pt", SIZE)]
                assert listed.entries[1].files[0].sha256 == \
                    hashlib.sha256(payload(4)).hexdigest()
                damaged = await stub.ListCheckpoints(
                    agent_pb2.ListCheckpointsRequest(job_id=JOB, stage=1), metadata=auth)
                assert list(damaged.entries) == []
                other = await stub.ListCheckpoints(
                    agent_pb2.ListCheckpointsRequest(job_id="job-other", stage=0),
                    metadata=auth)
                assert list(other.entries) == []
            await CheckpointCopier(taker, SECURITY).prepare(assignment([address]))

    run(main)
    assert steps_held(taker, 0) == [2, 4]
    assert ondisk.path_for(ondisk.job_dir(taker, JOB), 0, 4).read_bytes() == payload(4)
    assert leftovers(taker, 0) == ["step-00000002.manifest.json", "step-00000002.pt",
                                   "step-00000004.manifest.json", "step-00000004.pt"]


def test_the_newest_step_comes_first_and_both_from_the_first_holder_listed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The coordinator lists the best link into the agent first: both steps come from that
    holder, the newest first (the one the worker resumes from, should the budget run out)."""
    best, second, taker = tmp_path / "best", tmp_path / "second", tmp_path / "taker"
    for root in (best, second):
        for step in (2, 4):
            write_step(root, 0, step, payload(step))

    async def main() -> tuple[str, str]:
        async with serving(best) as first, serving(second) as other:
            await CheckpointCopier(taker, SECURITY).prepare(assignment([first, other]))
            return first, other

    with caplog.at_level(logging.INFO, logger="dtfm.checkpoints.copies"):
        first, other = asyncio.run(main())
    assert steps_held(taker, 0) == [2, 4]
    newest = caplog.text.index(f"copied stage 0 step 4 of job {JOB} from {first}")
    assert newest < caplog.text.index(f"copied stage 0 step 2 of job {JOB} from {first}")
    assert other not in caplog.text


def test_an_agent_that_holds_the_newest_step_fetches_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    holder, taker = tmp_path / "holder", tmp_path / "taker"
    for step in (2, 4):
        write_step(holder, 0, step, payload(step))
    write_step(taker, 0, 4, payload(4))

    async def main() -> None:
        async with serving(holder) as address:
            await CheckpointCopier(taker, SECURITY).prepare(assignment([address]))

    with caplog.at_level(logging.INFO, logger="dtfm.checkpoints.copies"):
        run(main)
    assert steps_held(taker, 0) == [4]
    assert "holds step 4, no peer holds a newer one" in caplog.text


def test_a_rollback_fetches_the_steps_below_its_bound_not_the_newest(tmp_path: Path) -> None:
    """An agent moved to another stage by an integrity re-plan (an R = 2 dispute) resumes
    before the bound (`Assignment.resume_before`): it must fetch the newest step below it,
    even where it, or its peers, hold newer ones; before, it fetched the newest two, and the
    whole job resumed from step 0 (tests/system/test_wan_bad_peer.py)."""
    holder, taker = tmp_path / "holder", tmp_path / "taker"
    ondisk.write_floor(ondisk.job_dir(holder, JOB), 1)  # the holder keeps every step
    for step in (2, 4, 6, 8):
        write_step(holder, 0, step, payload(step))
    write_step(taker, 0, 8, payload(8))  # the abandoned timeline's
    assert ondisk.newest_intact(ondisk.job_dir(taker, JOB), 0, JOB, (0, 2)) == 8
    assert ondisk.newest_intact(ondisk.job_dir(taker, JOB), 0, JOB, (0, 2), below=8) == 0

    async def main() -> None:
        async with serving(holder) as address:
            a = assignment([address])
            a.resume_before = 5
            await CheckpointCopier(taker, SECURITY).prepare(a)

    run(main)
    assert steps_held(taker, 0) == [2, 4]


def test_checkpoints_of_other_layers_are_not_fetched(tmp_path: Path) -> None:
    """A job split anew gives stage 0 other layers: the old copy is useless to its worker."""
    holder, taker = tmp_path / "holder", tmp_path / "taker"
    write_step(holder, 0, 4, payload(4), layers=(0, 3))

    async def main() -> None:
        async with serving(holder) as address:
            await CheckpointCopier(taker, SECURITY).prepare(assignment([address]))

    run(main)
    assert steps_held(taker, 0) == []


def test_a_corrupted_copy_fails_its_checksum_and_is_never_installed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bad, good, taker = tmp_path / "bad", tmp_path / "good", tmp_path / "taker"
    write_step(bad, 0, 4, payload(4))
    write_step(good, 0, 4, payload(4))
    path = ondisk.path_for(ondisk.job_dir(bad, JOB), 0, 4)
    data = bytearray(path.read_bytes())
    data[SIZE // 2] ^= 1  # one flipped bit on the holder's disk: same size, listed as complete
    path.write_bytes(bytes(data))

    async def main() -> None:
        async with serving(bad) as bad_address:
            await CheckpointCopier(taker, SECURITY).prepare(assignment([bad_address]))
            assert leftovers(taker, 0) == []  # nothing under a final name, no partial
            async with serving(good) as good_address:
                await CheckpointCopier(taker, SECURITY).prepare(
                    assignment([bad_address, good_address]))

    with caplog.at_level(logging.INFO, logger="dtfm.checkpoints.copies"):
        run(main)
    assert "fails its checksum" in caplog.text and "not copied from 127.0.0.1:" in caplog.text
    assert steps_held(taker, 0) == [4]
    assert ondisk.path_for(ondisk.job_dir(taker, JOB), 0, 4).read_bytes() == payload(4)


def test_an_interrupted_download_resumes_from_its_offset(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first, second, taker = tmp_path / "first", tmp_path / "second", tmp_path / "taker"
    for root in (first, second):
        write_step(root, 0, 4, payload(4))
    offsets: list[int] = []

    class CutsOff(AgentService):
        """Sends the first chunk, then the connection "breaks"."""

        async def FetchCheckpoint(self, request: agent_pb2.FetchCheckpointRequest,
                                  context: grpc.aio.ServicerContext
                                  ) -> AsyncIterator[agent_pb2.CheckpointChunk]:
            async for chunk in super().FetchCheckpoint(request, context):
                yield chunk
                await context.abort(grpc.StatusCode.UNAVAILABLE, "link lost (test)")

    class Records(AgentService):
        async def FetchCheckpoint(self, request: agent_pb2.FetchCheckpointRequest,
                                  context: grpc.aio.ServicerContext
                                  ) -> AsyncIterator[agent_pb2.CheckpointChunk]:
            offsets.append(request.offset)
            async for chunk in super().FetchCheckpoint(request, context):
                yield chunk

    async def main() -> None:
        async with serving(first, CutsOff) as address:
            await CheckpointCopier(taker, SECURITY).prepare(assignment([address]))
        assert steps_held(taker, 0) == []
        (part,) = leftovers(taker, 0)  # only the partial file, under a hidden name
        assert part.startswith(".step-00000004.pt.") and part.endswith(".part")
        assert os.path.getsize(ondisk.stage_dir(ondisk.job_dir(taker, JOB), 0) / part) == \
            CHUNK_BYTES
        async with serving(second, Records) as address:
            await CheckpointCopier(taker, SECURITY).prepare(assignment([address]))

    with caplog.at_level(logging.INFO, logger="dtfm.checkpoints.copies"):
        run(main)
    assert offsets == [CHUNK_BYTES]
    assert "resuming stage 0 step 4" in caplog.text
    assert steps_held(taker, 0) == [4]
    assert ondisk.path_for(ondisk.job_dir(taker, JOB), 0, 4).read_bytes() == payload(4)
    assert leftovers(taker, 0) == ["step-00000004.manifest.json", "step-00000004.pt"]


# ---- refusals ----


def test_bad_requests_are_refused_with_a_reason_and_every_call_needs_the_token(
        tmp_path: Path) -> None:
    holder = tmp_path / "holder"
    write_step(holder, 0, 4, payload(4))
    (holder / "agent-secret").write_text("not for peers")

    async def code_of(call: Awaitable[object]) -> tuple[grpc.StatusCode, str]:
        try:
            result = await call  # type: ignore[misc]
            if hasattr(result, "__aiter__"):
                async for _ in result:  # type: ignore[attr-defined]
                    pass
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
        return grpc.StatusCode.OK, ""

    async def fetch(stub: agent_pb2_grpc.AgentStub, **kw: object) -> tuple[grpc.StatusCode, str]:
        request = agent_pb2.FetchCheckpointRequest(**{  # type: ignore[arg-type]
            "job_id": JOB, "stage": 0, "step": 4, "name": "step-00000004.pt", **kw})
        try:
            async for _ in stub.FetchCheckpoint(request, timeout=5):
                pass
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
        return grpc.StatusCode.OK, ""

    async def main() -> None:
        async with serving(holder) as address:
            ok = rpc.open_channel(address, SECURITY)
            stub = agent_pb2_grpc.AgentStub(ok)
            invalid = grpc.StatusCode.INVALID_ARGUMENT
            for name in ("../../agent-secret", "/etc/passwd", "step-00000004.manifest.json",
                         "step-00000005.pt", ""):
                code, why = await fetch(stub, name=name)
                assert code == invalid and "ListCheckpoints" in why, (name, code, why)
            for job in ("", "job\x00x"):
                code, why = await fetch(stub, job_id=job)
                assert code == invalid and "job_id" in why, (job, code)
                code, why = await code_of(stub.ListCheckpoints(
                    agent_pb2.ListCheckpointsRequest(job_id=job), timeout=5))
                assert code == invalid and "job_id" in why, (job, code)
            code, why = await fetch(stub, offset=SIZE + 1)
            assert code == invalid and "past the end" in why
            code, why = await fetch(stub, step=6, name="step-00000006.pt")
            assert code == grpc.StatusCode.NOT_FOUND and "ListCheckpoints again" in why
            # a job id that climbs out of the root is a digest under it: nothing there
            code, _ = await fetch(stub, job_id="../..")
            assert code == grpc.StatusCode.NOT_FOUND
            assert await fetch(stub, offset=SIZE) == (grpc.StatusCode.OK, "")
            await ok.close()
            for token in ("", "wrong-token-0123456789"):
                channel = rpc.open_channel(address, rpc.Security(token=token))
                stub = agent_pb2_grpc.AgentStub(channel)
                code, _ = await fetch(stub)
                assert code == grpc.StatusCode.UNAUTHENTICATED
                code, _ = await code_of(stub.ListCheckpoints(
                    agent_pb2.ListCheckpointsRequest(job_id=JOB), timeout=5))
                assert code == grpc.StatusCode.UNAUTHENTICATED
                await channel.close()

    run(main)


def test_a_peer_that_does_not_answer_is_skipped(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    holder, taker = tmp_path / "holder", tmp_path / "taker"
    write_step(holder, 0, 4, payload(4))

    async def main() -> None:
        async with serving(holder) as address:
            await CheckpointCopier(taker, SECURITY).prepare(
                assignment([f"127.0.0.1:{rpc.free_port()}", "not an address", address]))

    with caplog.at_level(logging.INFO, logger="dtfm.checkpoints.copies"):
        run(main)
    assert steps_held(taker, 0) == [4]
    assert "did not list stage 0" in caplog.text and "skipping peer 'not an address'" in \
        caplog.text
    assert "none of the" not in caplog.text  # one holder answered


def test_when_no_peer_can_be_dialled_the_log_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every holder behind a NAT (nothing answers where they advertise): the worker starts
    from what this agent holds, and the warning says why no copy came."""
    taker = tmp_path / "taker"

    async def main() -> None:
        await CheckpointCopier(taker, SECURITY).prepare(
            assignment([f"127.0.0.1:{rpc.free_port()}", f"127.0.0.1:{rpc.free_port()}"]))

    with caplog.at_level(logging.WARNING, logger="dtfm.checkpoints.copies"):
        run(main)
    assert steps_held(taker, 0) == []
    assert "none of the 2 peers could be asked for its checkpoints" in caplog.text
    assert "; the worker starts from step 0" in caplog.text



class Liar(AgentService):
    """Lists its real steps, each file declared 10^12 bytes: what a hostile token holder could
    send to fill a peer's disk; counts what is fetched from it."""

    fetched: list[str] = []

    async def ListCheckpoints(self, request: agent_pb2.ListCheckpointsRequest,
                              context: grpc.aio.ServicerContext) -> agent_pb2.CheckpointList:
        listed = await super().ListCheckpoints(request, context)
        for entry in listed.entries:
            for f in entry.files:
                f.size = 10**12
        return listed

    async def FetchCheckpoint(self, request: agent_pb2.FetchCheckpointRequest,
                              context: grpc.aio.ServicerContext
                              ) -> AsyncIterator[agent_pb2.CheckpointChunk]:
        Liar.fetched.append(request.name)
        async for chunk in super().FetchCheckpoint(request, context):
            yield chunk


def test_a_peer_declaring_more_than_the_model_holds_is_never_fetched(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    liar, honest, taker = tmp_path / "liar", tmp_path / "honest", tmp_path / "taker"
    for root in (liar, honest):
        write_step(root, 0, 4, payload(4))
    Liar.fetched = []

    async def main() -> None:
        async with serving(liar, Liar) as lying, serving(honest) as address:
            await CheckpointCopier(taker, SECURITY).prepare(assignment([lying]))
            assert steps_held(taker, 0) == [] and leftovers(taker, 0) == []
            channel = rpc.open_channel(lying, SECURITY)
            copied = await CheckpointCopier(taker, SECURITY).mirror_once(
                Peer(lying, agent_pb2_grpc.AgentStub(channel)), JOB, 0, SPEC)
            await channel.close()
            assert copied == []
            await CheckpointCopier(taker, SECURITY).prepare(assignment([lying, address]))

    with caplog.at_level(logging.WARNING, logger="dtfm.checkpoints.copies"):
        run(main)
    assert Liar.fetched == []
    assert "declares 1,000,000,000,000 bytes for layers [0, 2) of gpt-tiny" in caplog.text
    assert steps_held(taker, 0) == [4]


def test_a_full_disk_ends_the_copy_saying_so_and_frees_its_partial_file(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    for root in (first, second):
        write_step(root, 0, 4, payload(4))
    asked: list[int] = []

    class Records(AgentService):
        async def FetchCheckpoint(self, request: agent_pb2.FetchCheckpointRequest,
                                  context: grpc.aio.ServicerContext
                                  ) -> AsyncIterator[agent_pb2.CheckpointChunk]:
            asked.append(request.offset)
            async for chunk in super().FetchCheckpoint(request, context):
                yield chunk

    async def main(taker: Path) -> None:
        async with serving(first, Records) as a, serving(second, Records) as b:
            await CheckpointCopier(taker, SECURITY).prepare(assignment([a, b]))

    with small_disk(tmp_path / "disk", "1m") as taker:  # SIZE is over 2 MiB
        with caplog.at_level(logging.WARNING, logger="dtfm.checkpoints.copies"):
            run(lambda: main(taker))
        assert steps_held(taker, 0) == [] and leftovers(taker, 0) == []
    assert len(asked) == 1  # the second peer's copy would not fit either: not asked
    assert "disk full: the disk holding" in caplog.text
    assert "free space on this agent's disk" in caplog.text


# ---- mirrors ----


def test_a_mirror_follows_its_peer_and_prunes_like_a_worker(tmp_path: Path) -> None:
    holder, mirror = tmp_path / "holder", tmp_path / "mirror"
    write_step(holder, 0, 2, payload(2))

    async def main() -> None:
        async with serving(holder) as address:
            copier = CheckpointCopier(mirror, SECURITY, mirror_interval_s=0.05)
            copier.start_mirrors(assignment([], stage=1, mirrors=((0, address),)))
            try:
                await eventually(lambda: steps_held(mirror, 0) == [2], "step 2 mirrored")
                for step in (4, 6):
                    write_step(holder, 0, step, payload(step))
                await eventually(lambda: steps_held(mirror, 0) == [4, 6], "steps 4 and 6")
                # the job resumed from 4 and wrote a different step 6: the copy follows it
                write_step(holder, 0, 6, payload(66))
                job_root = ondisk.job_dir(mirror, JOB)
                await eventually(
                    lambda: ondisk.path_for(job_root, 0, 6).read_bytes() == payload(66)
                    and steps_held(mirror, 0) == [4, 6], "the rewritten step 6")
            finally:
                await copier.stop_mirrors()

    run(main)
    assert leftovers(mirror, 0) == ["step-00000004.manifest.json", "step-00000004.pt",
                                    "step-00000006.manifest.json", "step-00000006.pt"]


def test_a_mirror_drops_steps_its_peer_abandoned(tmp_path: Path) -> None:
    holder, mirror = tmp_path / "holder", tmp_path / "mirror"
    for step in (4, 6, 8):
        write_step(mirror, 0, step, payload(step))
    for step in (4, 6):  # the job resumed from 4 and wrote 6 again: 8 is abandoned
        write_step(holder, 0, step, payload(step + 100))

    async def main() -> None:
        async with serving(holder) as address:
            channel = rpc.open_channel(address, SECURITY)
            copier = CheckpointCopier(mirror, SECURITY)
            copied = await copier.mirror_once(
                Peer(address, agent_pb2_grpc.AgentStub(channel)), JOB, 0, SPEC)
            await channel.close()
            assert copied == [4, 6]

    run(main)
    mine = held(ondisk.job_dir(mirror, JOB), 0, JOB)
    assert sorted(mine.files) == [4, 6] and mine.newest == 6
    assert ondisk.path_for(ondisk.job_dir(mirror, JOB), 0, 6).read_bytes() == payload(106)


def test_no_copies_with_a_shared_checkpoint_dir_or_checkpoints_off(tmp_path: Path) -> None:
    holder, taker = tmp_path / "holder", tmp_path / "taker"
    write_step(holder, 0, 4, payload(4))

    async def main() -> None:
        async with serving(holder) as address:
            copier = CheckpointCopier(taker, SECURITY, mirror_interval_s=0.05)
            for train in (common_pb2.TrainConfig(checkpoint_every=2, checkpoint_dir="/shared"),
                          common_pb2.TrainConfig(checkpoint_every=0)):
                a = assignment([address], stage=1, mirrors=((0, address),))
                a.stage = 0
                a.train.CopyFrom(train)
                await copier.prepare(a)
                copier.start_mirrors(a)
                await asyncio.sleep(0.3)
                await copier.stop_mirrors()

    run(main)
    assert not (taker / JOB).exists()


# ---- the supervisor: a stop while fetching means no worker ----


def test_a_stop_during_the_fetch_cancels_it_and_no_worker_starts(tmp_path: Path) -> None:
    class Hangs(CheckpointCopier):
        """A fetch from a peer that never finishes."""

        def __init__(self) -> None:
            super().__init__(tmp_path / "checkpoints", SECURITY)
            self.fetching = asyncio.Event()

        async def prepare(self, a: common_pb2.Assignment) -> None:
            self.fetching.set()
            await asyncio.sleep(3600)

    async def main() -> None:
        copier = Hangs()
        sup = Supervisor(tmp_path / "work", python="/nonexistent/python", checkpoints=copier)
        start = asyncio.create_task(sup.start(assignment(["127.0.0.1:1"])))
        await asyncio.wait_for(copier.fetching.wait(), 5)
        assert sup.progress.state == WorkerState.STARTING
        await sup.stop("coordinator said stop")
        await asyncio.wait_for(start, 5)  # returns without launching anything
        assert sup.progress.state == WorkerState.IDLE and not sup.running
        assert not list((tmp_path / "work").glob("*.assignment.pb"))

    run(main)


# ---- the floor: steps kept for a lagging mirror ----


def test_a_floor_keeps_every_step_a_lagging_mirror_may_resume_from(tmp_path: Path) -> None:
    """Without the floor the writer keeps its newest KEEP steps only; with it, every step from
    the floor on (at most MAX_HELD), so a stage lost with its agent, whose mirror holds an
    older step, still shares that step with this one."""
    root = ondisk.job_dir(tmp_path, JOB)
    for step in (2, 4, 6, 8):
        write_step(tmp_path, 0, step, payload(step))
    assert steps_held(tmp_path, 0) == [6, 8]
    ondisk.write_floor(root, 8)
    for step in (10, 12, 14):
        write_step(tmp_path, 0, step, payload(step))
    assert steps_held(tmp_path, 0) == [8, 10, 12, 14]
    ondisk.write_floor(root, 12)  # the mirrors caught up: older steps may go
    write_step(tmp_path, 0, 16, payload(16))
    assert steps_held(tmp_path, 0) == [12, 14, 16]
    ondisk.write_floor(root, 0)  # forgotten: back to KEEP
    write_step(tmp_path, 0, 18, payload(18))
    assert steps_held(tmp_path, 0) == [16, 18]


def test_a_floor_holds_at_most_max_held_steps(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ondisk, "MAX_HELD_BYTES", 4 * SIZE)  # fewer than MAX_HELD steps fit
    root = ondisk.job_dir(tmp_path, JOB)
    ondisk.write_floor(root, 1)  # a mirror that never copies must not fill the disk
    last = 2 * (ondisk.MAX_HELD + 3)
    with caplog.at_level(logging.WARNING):
        for step in range(2, last + 1, 2):
            write_step(tmp_path, 0, step, payload(step))
    assert steps_held(tmp_path, 0) == list(range(last - 2 * ondisk.MAX_HELD + 2, last + 1, 2))
    assert "A mirror is failing to copy" in caplog.text


def test_small_checkpoints_hold_more_than_max_held_steps_for_a_mirror(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small model checkpointing every fraction of a second outruns a 5 s mirror by more
    than MAX_HELD steps; while they fit in MAX_HELD_BYTES, all of them stay."""
    monkeypatch.setattr(ondisk, "MAX_HELD", 3)
    monkeypatch.setattr(ondisk, "MAX_HELD_BYTES", 6 * SIZE)
    ondisk.write_floor(ondisk.job_dir(tmp_path, JOB), 1)
    for step in range(1, 11):
        write_step(tmp_path, 0, step, payload(step))
    assert steps_held(tmp_path, 0) == [5, 6, 7, 8, 9, 10]


def test_with_a_shared_checkpoint_dir_the_writing_replicas_agent_records_the_floor_there(
        tmp_path: Path) -> None:
    """`coordinator demo --bad-peer` (a shared --checkpoint-dir) rolled back to step 0: the
    floor went nowhere, replica 0's worker pruned the shared folder to its newest 2 steps,
    and the step before the attack was gone by the time it was proven."""
    shared, own = tmp_path / "shared", tmp_path / "own"

    async def main() -> None:
        for replica in (0, 1):
            copier = CheckpointCopier(own / str(replica), SECURITY)
            a = assignment([])
            a.replica, a.train.checkpoint_dir = replica, str(shared)
            await copier.prepare(a)
            await copier.keep_from(JOB, 4 + replica)
        assert ondisk.read_floor(ondisk.job_dir(shared, JOB)) == 4  # replica 1 writes nothing
        assert not (own / "0").exists() or ondisk.read_floor(ondisk.job_dir(own / "0", JOB)) == 0

    run(main)
    for step in (4, 8, 12, 16):  # what replica 0's worker writes and prunes there
        write_step(shared, 0, step, payload(step))
    ondisk.prune(ondisk.job_dir(shared, JOB), 0, 16)
    assert steps_held(shared, 0) == [4, 8, 12, 16]  # not only the newest 2


def test_a_mirror_reports_what_it_holds_and_the_agent_records_the_floor(
        tmp_path: Path) -> None:
    holder, mirror = tmp_path / "holder", tmp_path / "mirror"
    write_step(holder, 0, 2, payload(2))
    ondisk.write_floor(ondisk.job_dir(mirror, JOB), 40)  # left by an earlier epoch

    async def main() -> None:
        async with serving(holder) as address:
            copier = CheckpointCopier(mirror, SECURITY, mirror_interval_s=0.05)
            a = assignment([], stage=1, mirrors=((0, address),))
            await copier.prepare(a)  # a new epoch forgets the old floor
            assert ondisk.read_floor(ondisk.job_dir(mirror, JOB)) == 0
            copier.start_mirrors(a)
            try:
                await eventually(lambda: copier.mirrored == {0: 2}, "step 2 reported")
                write_step(holder, 0, 4, payload(4))
                await eventually(lambda: copier.mirrored == {0: 4}, "step 4 reported")
            finally:
                await copier.stop_mirrors()
            assert copier.mirrored == {}
            await copier.keep_from("job-other", 4)  # not this agent's job: ignored
            assert ondisk.read_floor(ondisk.job_dir(mirror, "job-other")) == 0
            await copier.keep_from(JOB, 4)
            assert ondisk.read_floor(ondisk.job_dir(mirror, JOB)) == 4

    run(main)
