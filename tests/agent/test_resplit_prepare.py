"""An agent whose stage was cut anew fetches every old stage that held its layers before its
worker starts (`CheckpointCopier.prepare` with `Assignment.checkpoint_splits`).

Real agent gRPC servers over their own checkpoint directories, as in
test_checkpoint_transfer; the bytes are random, the manifests real (no torch).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dtfm.checkpoints.copies import CheckpointCopier
from dtfm.core.presets import get_preset
from protos.dtfm.v1 import common_pb2
from tests.agent.test_checkpoint_transfer import (
    SECURITY,
    payload,
    serving,
    steps_held,
    write_step,
)

pytestmark = pytest.mark.timeout(60)


def resplit(stage: int, layers: tuple[int, int], old: list[int],
            peers: list[str]) -> common_pb2.Assignment:
    """Stage `stage` of gpt-tiny (4 layers) whose checkpoints are cut as `old`."""
    return common_pb2.Assignment(
        job_id="job-1a2b3c4d", stage=stage, layer_begin=layers[0], layer_end=layers[1],
        model=get_preset("gpt-tiny").to_proto(),
        train=common_pb2.TrainConfig(checkpoint_every=2), checkpoint_peers=peers,
        checkpoint_splits=old)


def test_one_stage_fetches_both_old_stages(tmp_path: Path) -> None:
    """2 stages -> 1: the survivor held stage 0; stage 1 comes from the peer that held it."""
    mine, peer = tmp_path / "mine", tmp_path / "peer"
    write_step(mine, 0, 4, payload(4), layers=(0, 2))
    for step in (2, 4):
        write_step(peer, 1, step, payload(step), layers=(2, 4))

    async def main() -> None:
        async with serving(peer) as address:
            await CheckpointCopier(mine, SECURITY).prepare(
                resplit(0, (0, 4), [2, 2], [address]))
    asyncio.run(main())
    assert steps_held(mine, 0) == [4]
    assert steps_held(mine, 1) == [2, 4]


def test_growing_back_fetches_only_the_steps_cut_as_the_record_says(tmp_path: Path) -> None:
    """1 stage -> 2: the new stage 1 reads old stage 0, whose folder on the peer also holds
    an older step of the 2-stage cut (layers 0-1 only): that one is not fetched."""
    mine, peer = tmp_path / "mine", tmp_path / "peer"
    write_step(peer, 0, 4, payload(4), layers=(0, 2))
    write_step(peer, 0, 8, payload(8), layers=(0, 4))

    async def main() -> None:
        async with serving(peer) as address:
            await CheckpointCopier(mine, SECURITY).prepare(resplit(1, (2, 4), [4], [address]))
    asyncio.run(main())
    assert steps_held(mine, 0) == [8]
    assert steps_held(mine, 1) == []
