"""The coordinator's copy of last resort (coordinator/job/checkpointcopies.py, issue 32).

When no member of a job can be dialled, a stage's holder pushes it to the coordinator, which
keeps the newest step of each stage within --checkpoint-store-mib, serves it through the same
List/Fetch calls agents serve, shows it in its status, and deletes it when the job ends. Here
the coordinator is the daemon's own `CoordinatorService` on a real gRPC server (loopback, the
token required); the agents' ends are the agent's own `CheckpointPushes` and
`CheckpointCopier`, dialling `COORDINATOR_PEER`. No torch: the bytes are random, the
manifests real. Only a joined agent holding the stage in the running epoch may push it
(coordinator/daemon/pushgate.py): the pushers join through the real Join call, and the job's
grid is set as an epoch's plan sets it (no torch, no workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from coordinator.daemon.server import CoordinatorService
from dtfm import rpc
from dtfm.checkpoints.copies import CheckpointCopier, Peer
from dtfm.checkpoints.push import CheckpointPushes, Metadata, push_step, pusher_metadata
from dtfm.core import checkpoints as ondisk
from dtfm.core.assignment import COORDINATOR_PEER
from dtfm.core.checkpoints import FileEntry, Manifest
from protos.dtfm.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.agent.test_checkpoint_transfer import (
    SECURITY,
    SIZE,
    SPEC,
    eventually,
    payload,
    write_step,
)
from tests.coordinator.served import served, tiny_config

pytestmark = pytest.mark.timeout(60)
# grpc.aio may report a client stream the server refused early, while the client still
# writes, as INTERNAL "Internal error from Core" in place of the server's status
# (grpc/grpc#36066): the refusal's own code and reason are then in the coordinator's log
OR_RACE = (grpc.StatusCode.INTERNAL,)


@contextlib.asynccontextmanager
async def coordinator(state: Path, cap_bytes: int = 2**30
                      ) -> AsyncIterator[tuple[str, CoordinatorService]]:
    """A coordinator with a gpt-tiny job (not started), served on loopback."""
    async with served(tiny_config(state, 2, checkpoint_store_bytes=cap_bytes)) as (address, svc):
        yield address, svc


async def joined(address: str, agent_id: str) -> str:
    """The secret the coordinator issues `agent_id` at a real Join (the stream is then
    dropped: this coordinator sweeps nobody, so the agent stays alive)."""
    async with rpc.open_channel(address, SECURITY) as channel:
        call = coordinator_pb2_grpc.CoordinatorStub(channel).Join(coordinator_pb2.JoinRequest(
            agent=common_pb2.AgentInfo(agent_id=agent_id, host="127.0.0.1", port=9,
                                       device=common_pb2.DeviceInfo(kind="cpu"))))
        secret = (await call.read()).welcome.agent_secret
        call.cancel()
    assert len(secret) == 64
    return secret


async def running(address: str, svc: CoordinatorService, grid: list[list[str]]
                  ) -> dict[str, str]:
    """Join the agents of `grid` (stage rows of agent ids) and run epoch 1 on them, as
    `Job` sets an epoch; their secrets by id."""
    secrets = {a: await joined(address, a) for row in grid for a in row}
    svc.job.planner.grid_ids = grid
    svc.job.members = [a for row in grid for a in row]
    svc.job.epoch, svc.job.state = 1, coordinator_pb2.JOB_STATE_RUNNING
    return secrets


def assignment(job_id: str, stage: int, *, pushes: bool = False, peers: tuple[str, ...] = ()
               ) -> common_pb2.Assignment:
    return common_pb2.Assignment(
        job_id=job_id, stage=stage, layer_begin=2 * stage, layer_end=2 * stage + 2,
        model=SPEC.to_proto(), train=common_pb2.TrainConfig(checkpoint_every=2),
        checkpoint_peers=peers,
        checkpoint_pushes=[common_pb2.CheckpointMirror(stage=stage, peer=COORDINATOR_PEER)]
        if pushes else [])


def held_on_disk(state: Path, job_id: str, stage: int) -> list[int]:
    root = ondisk.job_dir(state / "checkpoints", job_id)
    return [s for s in ondisk.steps_available(root, stage)
            if ondisk.verify(root, stage, s, job_id=job_id) is None]


async def _status(address: str) -> coordinator_pb2.JobStatus:
    async with rpc.open_channel(address, SECURITY) as channel:
        reply = await coordinator_pb2_grpc.CoordinatorStub(channel).GetStatus(
            coordinator_pb2.StatusRequest(), timeout=10)
    return reply.job


async def push(address: str, holder: Path, job: str, m: Manifest, metadata: Metadata = (),
               security: rpc.Security = SECURITY) -> tuple[grpc.StatusCode, str]:
    """Push step `m` of agent root `holder` to the coordinator, the call with `metadata`:
    the status it ended with and its details."""
    async with rpc.open_channel(address, security) as channel:
        peer = Peer(address, coordinator_pb2_grpc.CoordinatorStub(channel))
        try:
            await push_step(peer, job, ondisk.job_dir(holder, job), m, newest=m.step,
                            metadata=metadata)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def test_a_pushed_stage_is_kept_newest_only_fetched_like_from_a_peer_and_removed_at_the_end(
        tmp_path: Path) -> None:
    state, holder, taker = tmp_path / "coordinator", tmp_path / "holder", tmp_path / "taker"

    async def main() -> None:
        async with coordinator(state) as (address, svc):
            job = svc.job.job_id
            secret = (await running(address, svc, [["h0"], ["h1"]]))["h0"]
            write_step(holder, 0, 2, payload(2), job=job)
            write_step(holder, 0, 4, payload(4), job=job)
            pushing = CheckpointPushes(holder, SECURITY, interval_s=0.1, coordinator=address)
            pushing.identity = lambda: ("h0", secret)
            pushing.start(assignment(job, 0, pushes=True))
            try:
                # only the newest step travels, and only it is kept
                await eventually(lambda: held_on_disk(state, job, 0) == [4], "step 4 held")
                write_step(holder, 0, 6, payload(6), job=job)  # the worker writes on
                await eventually(lambda: held_on_disk(state, job, 0) == [6], "only step 6")
            finally:
                await pushing.stop()
            # the status follows the disk: the record of a push is made once its files are in
            # place, so a loaded machine may show the old step for a moment
            deadline = asyncio.get_running_loop().time() + 10
            while True:
                shown = (await _status(address)).coordinator_checkpoints
                held = [(c.stage, c.step, c.bytes) for c in shown]
                if held == [(0, 6, SIZE)] or asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.05)
            assert held == [(0, 6, SIZE)]

            # an agent that lacks the stage fetches it from the coordinator as from a peer
            await CheckpointCopier(taker, SECURITY, coordinator=address).prepare(
                assignment(job, 0, peers=(COORDINATOR_PEER,)))
            root = ondisk.job_dir(taker, job)
            assert ondisk.steps_available(root, 0) == [6]
            assert ondisk.verify(root, 0, 6, job_id=job) is None

            await svc.copies.remove(job, "the job ended")
            assert not (await _status(address)).coordinator_checkpoints
            assert not ondisk.job_dir(state / "checkpoints", job).exists()

    asyncio.run(main())


def test_a_push_hung_up_on_while_its_manifest_is_written_is_recorded_as_the_disk_holds_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CI failure of stop 55: the pusher stopped (its call cancelled) in the instant the
    coordinator committed step 6; the manifest's thread wrote on, and the record (status, the
    keep floor) named step 4 for good while the disk held step 6. A cancelled call's commit now
    finishes and is recorded, the older step deleted."""
    state, holder = tmp_path / "coordinator", tmp_path / "holder"

    async def main() -> None:
        async with coordinator(state) as (address, svc):
            job = svc.job.job_id
            as_h0 = pusher_metadata("h0", (await running(address, svc, [["h0"], ["h1"]]))["h0"])
            s2 = write_step(holder, 0, 2, payload(2), job=job)
            s4 = write_step(holder, 0, 4, payload(4), job=job)
            assert (await push(address, holder, job, s2, as_h0))[0] == grpc.StatusCode.OK

            loop, writing = asyncio.get_running_loop(), asyncio.Event()
            write = ondisk.write_manifest

            def slow(root: Path, m: Manifest) -> Path:
                loop.call_soon_threadsafe(writing.set)
                time.sleep(0.5)  # the pusher hangs up meanwhile
                return write(root, m)

            monkeypatch.setattr(ondisk, "write_manifest", slow)
            call = asyncio.ensure_future(push(address, holder, job, s4, as_h0))
            await asyncio.wait_for(writing.wait(), 20)
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call
            await eventually(lambda: held_on_disk(state, job, 0) == [4], "step 4 committed")
            # the record follows the disk, once the cancelled handler has finished
            deadline = loop.time() + 10
            while [(c.stage, c.step) for c in svc.copies.held(job)] != [(0, 4)] and \
                    loop.time() < deadline:
                await asyncio.sleep(0.05)
            assert [(c.stage, c.step, c.bytes) for c in svc.copies.held(job)] == [(0, 4, SIZE)]
            assert ondisk.steps_available(ondisk.job_dir(state / "checkpoints", job), 0) == [4]

    asyncio.run(main())


def test_a_refused_push_leaves_the_record_as_the_disk_holds_it(tmp_path: Path) -> None:
    """A push refused for its checksum: of another step, the step held stays recorded as it
    was; of the step held itself (whose manifest the push took down first), the record goes
    with the manifest, instead of naming a step nobody can fetch."""
    state, holder = tmp_path / "coordinator", tmp_path / "holder"

    def spoiled(m: Manifest) -> Manifest:  # the file's bytes change after its manifest
        path = ondisk.stage_dir(ondisk.job_dir(holder, m.job_id), m.stage) / m.files[0].name
        data = bytearray(path.read_bytes())
        data[0] ^= 0xFF
        path.write_bytes(bytes(data))
        return m

    async def main() -> None:
        async with coordinator(state) as (address, svc):
            job = svc.job.job_id
            as_h0 = pusher_metadata("h0", (await running(address, svc, [["h0"], ["h1"]]))["h0"])
            s4 = write_step(holder, 0, 4, payload(4), job=job)
            assert (await push(address, holder, job, s4, as_h0))[0] == grpc.StatusCode.OK
            s6 = spoiled(write_step(holder, 0, 6, payload(6), job=job))
            code, _ = await push(address, holder, job, s6, as_h0)
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, *OR_RACE)
            assert [(c.step, c.bytes) for c in svc.copies.held(job)] == [(4, SIZE)]
            assert held_on_disk(state, job, 0) == [4]
            code, _ = await push(address, holder, job, spoiled(s4), as_h0)
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, *OR_RACE)
            assert held_on_disk(state, job, 0) == []
            assert svc.copies.held(job) == []

    asyncio.run(main())


def test_pushes_to_the_coordinator_are_authenticated_for_its_job_and_within_the_cap(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state, holder = tmp_path / "coordinator", tmp_path / "holder"

    async def main() -> None:
        # room for one stage: the second is refused, a newer step of the first replaces it
        async with coordinator(state, cap_bytes=SIZE + 1000) as (address, svc):
            job = svc.job.job_id
            secrets = await running(address, svc, [["h0"], ["h1"]])
            as_h0 = pusher_metadata("h0", secrets["h0"])
            s0 = write_step(holder, 0, 2, payload(2), job=job)
            s1 = write_step(holder, 1, 2, payload(3), job=job, layers=(2, 4))
            assert (await push(address, holder, job, s0, as_h0))[0] == grpc.StatusCode.OK
            with caplog.at_level(logging.WARNING):
                code, why = await push(address, holder, job, s1,
                                       pusher_metadata("h1", secrets["h1"]))
            assert code in (grpc.StatusCode.RESOURCE_EXHAUSTED, *OR_RACE), why
            assert "stage 1 step 2 of job" in caplog.text
            assert "raise --checkpoint-store-mib" in caplog.text
            assert held_on_disk(state, job, 1) == []
            newer = write_step(holder, 0, 4, payload(4), job=job)
            assert (await push(address, holder, job, newer, as_h0))[0] == grpc.StatusCode.OK
            assert held_on_disk(state, job, 0) == [4]

            # not the job it runs
            other = write_step(holder, 0, 2, payload(2), job="job-other")
            with caplog.at_level(logging.WARNING):
                code, why = await push(address, holder, "job-other", other, as_h0)
            assert code in (grpc.StatusCode.FAILED_PRECONDITION, *OR_RACE), why
            assert "only of the job it runs" in caplog.text and "not of job job-other" in \
                caplog.text
            # more than the model's layers allow: refused before a byte is written
            huge = Manifest(job, 0, 8, (0, 2), (FileEntry(ondisk.data_name(8), 10**12,
                                                          hashlib.sha256(b"").hexdigest()),))
            with caplog.at_level(logging.WARNING):
                code, why = await push(address, holder, job, huge, as_h0)
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, *OR_RACE), why
            assert "refused before downloading" in caplog.text
            # no token, no push: a newer step that a member's push would have kept (the
            # refusal may race the client's writes and read as INTERNAL, as above: CI saw it)
            unsigned = write_step(holder, 0, 6, payload(6), job=job)
            code, why = await push(address, holder, job, unsigned, as_h0,
                                   rpc.Security(token=""))
            assert code in (grpc.StatusCode.UNAUTHENTICATED, *OR_RACE), why
            assert held_on_disk(state, job, 0) == [4]
        # a coordinator restarted on the same --state-dir finds what it held
        async with coordinator(state) as (address, svc):
            assert [(c.stage, c.step) for c in svc.copies.held(job)] == [(0, 4)]
            await svc.copies.keep_only("job-next")  # another job: the old copies go
            assert not svc.copies.held(job) and not ondisk.job_dir(state / "checkpoints",
                                                                   job).exists()

    asyncio.run(main())


def test_a_holder_stops_pushing_once_the_coordinators_job_has_ended(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """After the job ends the coordinator takes no more copies of it; the holder (whose
    assignment lasts until its next one) stops pushing, instead of resending its newest step
    every second for as long as it idles."""
    state, holder = tmp_path / "coordinator", tmp_path / "holder"

    async def main() -> None:
        async with coordinator(state) as (address, svc):
            job = svc.job.job_id
            write_step(holder, 0, 2, payload(2), job=job)
            secret = (await running(address, svc, [["h0"]]))["h0"]
            svc.job.state = coordinator_pb2.JOB_STATE_DONE
            pushing = CheckpointPushes(holder, SECURITY, interval_s=0.05, coordinator=address)
            pushing.identity = lambda: ("h0", secret)
            pushing.start(assignment(job, 0, pushes=True))
            try:
                await eventually(lambda: "stopped pushing stage 0" in caplog.text, "the stop")
                refusals = caplog.text.count("refused a push")
                await asyncio.sleep(0.5)  # ten intervals: no push follows
                assert caplog.text.count("refused a push") == refusals
            finally:
                await pushing.stop()
            assert held_on_disk(state, job, 0) == []

    with caplog.at_level(logging.INFO):
        asyncio.run(main())
    assert "keeps checkpoint copies only of the job it runs (none now)" in caplog.text


def test_the_keep_from_floor_covers_the_steps_the_coordinator_holds(tmp_path: Path) -> None:
    """A stage lost with all its agents resumes from the coordinator's copy, which lags its
    holder: every agent must keep that step (the floor), else a fast job's survivors have
    pruned it and the job resumes from an older common step, or from 0."""
    state, holder = tmp_path / "coordinator", tmp_path / "holder"

    async def main() -> None:
        async with coordinator(state) as (address, svc):
            job = svc.job.job_id
            assert svc.copies.floor(job, 2, 0) == 0 and svc.copies.floor(job, 2, 7) == 7
            secrets = await running(address, svc, [["h0"], ["h1"]])
            for stage, step in ((0, 12), (1, 8)):
                m = write_step(holder, stage, step, payload(step), job=job,
                               layers=(2 * stage, 2 * stage + 2))
                assert (await push(address, holder, job, m, pusher_metadata(
                    f"h{stage}", secrets[f"h{stage}"])))[0] == grpc.StatusCode.OK
            assert svc.copies.floor(job, 2, 0) == 8  # no mirrors: the coordinator's oldest
            assert svc.copies.floor(job, 2, 10) == 8 and svc.copies.floor(job, 2, 4) == 4
            assert svc.copies.floor(job, 1, 0) == 12  # stage 1 is not of this layout
            assert svc.copies.floor("job-other", 2, 0) == 0

    asyncio.run(main())


def test_only_the_stages_holder_may_push_it_and_refused_pushes_fill_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 41 item 5: a bare client with the join token pushed "stage 0 at step 99,999,999"
    and stages 40-44 of a two-stage job until the store was full, and the real holder's push
    was then refused. Now every one of those is refused and logged before a byte is held,
    and the holder's push fits in a store with room for one stage."""
    state, holder, outsider = tmp_path / "coordinator", tmp_path / "holder", tmp_path / "outer"

    async def main() -> None:
        async with coordinator(state, cap_bytes=SIZE + 1000) as (address, svc):
            job = svc.job.job_id
            secrets = await running(address, svc, [["h0"], ["h1"]])
            outsider_secret = await joined(address, "spare")  # joined, in no stage
            absurd = write_step(outsider, 0, 99_999_999, payload(9), job=job)
            planted = [absurd] + [write_step(outsider, s, 2, payload(s), job=job)
                                  for s in range(40, 45)]
            refused = {
                "the join token alone": ((), grpc.StatusCode.UNAUTHENTICATED,
                                         "the join token alone may not push"),
                "an id that never joined": (pusher_metadata("ghost", "ab" * 32),
                                            grpc.StatusCode.PERMISSION_DENIED, "has not joined"),
                "another agent's id": (pusher_metadata("h0", outsider_secret),
                                       grpc.StatusCode.PERMISSION_DENIED,
                                       "wrong or missing agent_secret"),
            }
            for what, (metadata, code, reason) in refused.items():
                for m in planted:
                    caplog.clear()
                    with caplog.at_level(logging.WARNING):
                        got, why = await push(address, outsider, job, m, metadata)
                    assert got in (code, *OR_RACE), (what, m.stage, why)
                    assert "refused a push" in caplog.text and reason in caplog.text, what
            # a joined agent pushing stages it does not hold: the spare, and stage 1's holder
            for agent_id, secret in (("spare", outsider_secret), ("h1", secrets["h1"])):
                for m in planted[1:]:
                    caplog.clear()
                    with caplog.at_level(logging.WARNING):
                        got, why = await push(address, outsider, job, m,
                                              pusher_metadata(agent_id, secret))
                    assert got in (grpc.StatusCode.FAILED_PRECONDITION, *OR_RACE), why
                    assert f"agent {agent_id} does not hold stage {m.stage}" in caplog.text
            # the holder itself, at a step the job cannot have reached
            as_h0 = pusher_metadata("h0", secrets["h0"])
            with caplog.at_level(logging.WARNING):
                got, why = await push(address, outsider, job, absurd, as_h0)
            assert got in (grpc.StatusCode.INVALID_ARGUMENT, *OR_RACE), why
            assert "trains 100 steps (--steps)" in caplog.text
            ahead = write_step(holder, 0, 70, payload(70), job=job)  # 0 reported + 50 + 16 at most
            with caplog.at_level(logging.WARNING):
                got, why = await push(address, holder, job, ahead, as_h0)
            assert got in (grpc.StatusCode.OUT_OF_RANGE, *OR_RACE), why
            assert "have reported step 0 at most" in caplog.text
            assert not svc.copies.held(job)
            assert not any(ondisk.job_dir(state / "checkpoints", job).rglob("*.pt"))

            # the real holder's push is taken, into the store with room for one stage
            real = write_step(holder, 0, 40, payload(40), job=job)
            assert (await push(address, holder, job, real, as_h0))[0] == grpc.StatusCode.OK
            assert [(c.stage, c.step) for c in svc.copies.held(job)] == [(0, 40)]
            assert held_on_disk(state, job, 0) == [40]

    asyncio.run(main())
