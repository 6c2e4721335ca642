"""Checkpoint copies pushed by an agent nobody can dial (dtfm/checkpoints/push.py, issue 32).

The holder of a one-replica stage sits behind a NAT: it serves no port here at all (nothing
could dial it), its mirror is a real agent gRPC server (the daemon's own `AgentService`, with
the token). The assignments come from `build_assignments(member_dialable=...)`, as the
coordinator builds them. No torch: the bytes are random, the manifests real.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from agent.daemon.server import AgentService
from dtfm import rpc
from dtfm.checkpoints.copies import CheckpointCopier, CheckpointStore, entry_of
from dtfm.checkpoints.push import CheckpointPushes, pusher_of
from dtfm.core import checkpoints as ondisk
from dtfm.core.assignment import build_assignments
from dtfm.core.checkpoints import FileEntry, Manifest
from dtfm.core.layout import Layout
from dtfm.core.spec import TrainConfig
from dtfm.rpc import free_port
from protos.dtfm.v1 import agent_pb2, agent_pb2_grpc, common_pb2
from tests.agent.servers import serving
from tests.agent.test_checkpoint_transfer import (
    JOB,
    SECURITY,
    SPEC,
    eventually,
    leftovers,
    payload,
    steps_held,
    write_step,
)

pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def mirror(root: Path) -> AsyncIterator[tuple[str, CheckpointPushes, CheckpointCopier]]:
    """A dialable agent keeping pushed copies in `root`: its address, pushes and copier."""
    copier = CheckpointCopier(root, SECURITY, mirror_interval_s=0.1)
    pushes = CheckpointPushes(root, SECURITY, copier, interval_s=0.1)
    svc = AgentService(common_pb2.AgentInfo(agent_id="mirror", host="127.0.0.1"),
                       CheckpointStore(root), pushes)
    async with serving(svc, SECURITY) as address:
        try:
            yield address, pushes, copier
        finally:
            await pushes.stop()
            await copier.stop_mirrors()


def assignments(mirror_address: str) -> list[common_pb2.Assignment]:
    """A 2-stage, 1-replica job: rank 0 (stage 0) behind a NAT, rank 1 its mirror."""
    host, port = mirror_address.rsplit(":", 1)
    return build_assignments(
        job_id=JOB, epoch=1, layout=Layout(2, 1), spec=SPEC,
        train=TrainConfig(global_batch=2, micro_batches=1, checkpoint_every=2),
        master_addr="127.0.0.1", master_port=1,
        members=[("192.168.1.2", free_port()), (host, int(port))],
        member_ids=["natted", "mirror"], member_dialable=[False, True])


def test_an_undialable_holders_steps_reach_its_mirror_by_push(tmp_path: Path) -> None:
    holder_root, mirror_root = tmp_path / "holder", tmp_path / "mirror"
    write_step(holder_root, 0, 2, payload(2))
    write_step(holder_root, 0, 4, payload(4))

    async def main() -> None:
        async with mirror(mirror_root) as (address, receiving, copier):
            natted, kept = assignments(address)
            assert [(p.stage, p.peer) for p in natted.checkpoint_pushes] == [(0, address)]
            assert [(m.stage, m.pushed) for m in kept.mirrors] == [(0, True)]
            # stage 1's holder (the mirror) is dialable: the NATed agent pulls it as before
            assert [(m.stage, m.pushed) for m in natted.mirrors] == [(1, False)]
            receiving.start(kept)
            copier.start_mirrors(kept)  # a pushed mirror is not pulled: nothing dials rank 0
            claimed: list[tuple[str, str]] = []
            receive = receiving.receive

            async def recording(requests: AsyncIterator[agent_pb2.CheckpointPush],
                                context: grpc.aio.ServicerContext
                                ) -> agent_pb2.CheckpointPushReply:
                claimed.append(pusher_of(context))
                return await receive(requests, context)

            receiving.receive = recording  # type: ignore[method-assign]
            pushing = CheckpointPushes(holder_root, SECURITY, interval_s=0.1)
            pushing.identity = lambda: ("natted", "ab" * 32)  # for the coordinator alone
            pushing.start(natted)
            try:
                await eventually(lambda: steps_held(mirror_root, 0) == [2, 4], "steps 2, 4")
                await eventually(lambda: copier.mirrored.get(0) == 4, "mirrored step 4")
                write_step(holder_root, 0, 6, payload(6))  # the worker writes on
                await eventually(lambda: steps_held(mirror_root, 0) == [4, 6], "steps 4, 6")
                await eventually(lambda: copier.mirrored.get(0) == 6, "mirrored step 6")
            finally:
                await pushing.stop()
            # a peer never sees the pusher's secret: it would let the peer act as the pusher
            assert claimed and set(claimed) == {("", "")}, claimed
        assert not [n for n in leftovers(mirror_root, 0) if n.startswith(".")]

    asyncio.run(main())


async def _push(stub: agent_pb2_grpc.AgentStub, *messages: agent_pb2.CheckpointPush
                ) -> tuple[grpc.StatusCode, str]:
    async def stream() -> AsyncIterator[agent_pb2.CheckpointPush]:
        for m in messages:
            yield m

    try:
        await stub.PushCheckpoint(stream(), timeout=10)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def test_pushes_are_authenticated_expected_capped_and_checked(tmp_path: Path) -> None:
    holder_root, mirror_root = tmp_path / "holder", tmp_path / "mirror"
    m = write_step(holder_root, 0, 4, payload(4))
    data = payload(4)
    head = agent_pb2.CheckpointPush(job_id=JOB, entry=entry_of(m), newest=4)
    huge = Manifest(JOB, 0, 8, (0, 2), (FileEntry(ondisk.data_name(8), 10**12,
                                                  hashlib.sha256(b"").hexdigest()),))
    bad = bytes(reversed(data))

    async def main() -> None:
        async with mirror(mirror_root) as (address, receiving, _):
            async with rpc.open_channel(address, SECURITY) as channel:
                stub = agent_pb2_grpc.AgentStub(channel)
                body = agent_pb2.CheckpointPush(data=data)
                code, why = await _push(stub, head, body)  # no assignment mirrors it yet
                assert code == grpc.StatusCode.FAILED_PRECONDITION and "keeps no pushed" in why
                receiving.start(assignments(address)[1])
                async with rpc.open_channel(address, rpc.Security(token="")) as anon:
                    code, _ = await _push(agent_pb2_grpc.AgentStub(anon), head, body)
                    assert code == grpc.StatusCode.UNAUTHENTICATED
                code, why = await _push(stub, agent_pb2.CheckpointPush(
                    job_id=JOB, entry=entry_of(huge)))
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "refused before" in why
                code, why = await _push(stub, head, agent_pb2.CheckpointPush(data=bad))
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "checksum" in why
                code, why = await _push(stub, head, agent_pb2.CheckpointPush(data=data[:100]))
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "ended after 100" in why
                code, why = await _push(stub, head, body, agent_pb2.CheckpointPush(data=b"x"))
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "more bytes" in why
                assert steps_held(mirror_root, 0) == []
                assert not [n for n in leftovers(mirror_root, 0) if n.startswith(".")]
                assert await _push(stub, head, body) == (grpc.StatusCode.OK, "")
                assert steps_held(mirror_root, 0) == [4]

    asyncio.run(main())
