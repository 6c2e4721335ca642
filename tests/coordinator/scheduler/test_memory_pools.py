"""The memory check counts shared memory once and AdamW's moments at their stored width.

Several agents on one machine each report the whole machine's free memory; before memory
pools, eight of them on one box passed a check the box could never meet. These tests pin the
pool arithmetic (`coordinator.scheduler.memory`), what an agent reports as its pool
(`agent.probing.device.memory_pool`), and that a coordinated job refuses such a plan up front with
the numbers and what to do (the job is real, its agents are registry entries: no grpc, no workers).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from agent.probing import device
from coordinator.scheduler import Network
from coordinator.scheduler.compute import Devices, Workload, even_is_enough, plan_split
from coordinator.scheduler.memory import (
    DoesNotFit,
    MemoryShape,
    advice,
    check_fit,
    packs,
    param_state_bytes,
    shortfalls,
    stage_bytes,
    stages_bytes,
)
from dtfm.core.layout import Layout
from dtfm.core.presets import get_preset
from dtfm.core.spec import TrainConfig
from protos.dtfm.v1 import common_pb2
from tests.coordinator import test_job
from tests.coordinator.test_job import Cluster, _until, config, run

S = test_job.S
GRID = [[0, 1], [2, 3]]  # stage 0 on devices 0 and 1, stage 1 on 2 and 3
NEED = [1000, 1500]


def test_bf16_moments_save_four_bytes_per_parameter() -> None:
    assert param_state_bytes("fp32") == 16 and param_state_bytes("bf16") == 12
    spec = get_preset("gpt-1.3b")
    wide = MemoryShape(spec, 8, 1, micro_size=1, micro_batches=1)
    narrow = MemoryShape(spec, 8, 1, micro_size=1, micro_batches=1, moments_dtype="bf16")
    assert stage_bytes(wide, 0, 0, 3) - stage_bytes(narrow, 0, 0, 3) == \
        4 * spec.stage_params(0, 3)
    work = Workload(spec, 8, 1, 1, 1, moments_dtype="bf16")
    assert work.memory() == narrow  # the job's Workload carries the width to the check


def test_devices_alone_fit_but_their_shared_pool_does_not() -> None:
    check_fit(GRID, NEED, [3000] * 4)  # each device alone: fine
    check_fit(GRID, NEED, [3000] * 4, pools=["", "", "", ""])  # no pools: as before
    with pytest.raises(DoesNotFit) as err:
        check_fit(GRID, NEED, [3000] * 4, names=["a", "b", "c", "d"], pools=["m"] * 4)
    msg = str(err.value)
    assert "the 4 agents sharing one machine's memory (a, b, c, d; memory pool m)" in msg
    assert "cannot hold stages 0, 1 together" in msg
    assert "(5000 bytes)" in msg and "(3000 bytes)" in msg and msg.endswith(advice())
    assert err.value.worst.missing == 2000 and err.value.worst.devices == (0, 1, 2, 3)


def test_each_pool_is_held_against_its_own_memory() -> None:
    pools = ["x", "y", "x", "y"]  # a stage-0 and a stage-1 device on each machine: 2500 each
    check_fit(GRID, NEED, [2500] * 4, pools=pools)
    short = shortfalls(GRID, NEED, [2400] * 4, pools=pools)
    assert [(s.pool, s.needed, s.available) for s in short] == [("x", 2500, 2400),
                                                                ("y", 2500, 2400)]


def test_a_pool_has_the_most_any_member_reported_and_unknown_is_not_checked() -> None:
    # reports taken at different moments differ; 0 is "unknown"
    check_fit(GRID, NEED, [0, 5000, 4000, 0], pools=["m"] * 4)
    with pytest.raises(DoesNotFit, match=r"\(4999 bytes\)"):
        check_fit(GRID, NEED, [0, 4999, 4000, 0], pools=["m"] * 4)
    check_fit(GRID, NEED, [0, 0, 0, 0], pools=["m"] * 4)


def test_a_device_too_small_on_its_own_is_still_named() -> None:
    with pytest.raises(DoesNotFit) as err:
        check_fit(GRID, NEED, [10_000, 10_000, 1200, 10_000], names=list("abcd"),
                  pools=["", "", "", ""])
    assert str(err.value).startswith("c cannot hold stage 1: it needs")


def test_packing_counts_a_pool_once_and_matches_largest_first_without_pools() -> None:
    assert packs([1500, 1500, 1000, 1000], [1500, 1500, 1000, 1000])
    assert not packs([1500, 1500, 1000, 1000], [1500, 1400, 1000, 1000])
    assert packs([1500, 1500, 1000, 1000], [0, 0, 0, 0])  # unknown: taken to fit
    assert not packs([1000] * 5, [0] * 4)  # one tasklet per device
    # two machines of 2500, two devices each: only one stage-0 and one stage-1 per machine
    assert packs([1500, 1500, 1000, 1000], [2500] * 4, ["x", "x", "y", "y"])
    assert not packs([1500, 1500, 1000, 1000], [2400] * 4, ["x", "x", "y", "y"])
    # a pool has the most any member reported, and is unknown only if every member is
    assert packs([1500, 1000], [0, 2500], ["x", "x"])
    assert not packs([1500, 1000], [0, 2400], ["x", "x"])
    assert packs([1500, 1000], [0, 0], ["x", "x"])


def test_the_split_planner_moves_a_heavy_stage_off_a_crowded_machine() -> None:
    # alike devices on two machines; the grid puts both replicas of a stage on one machine,
    # which each device alone holds but the machine does not. Before pools counted here the
    # planner called the even split on this grid "enough" and the job failed in check_fit.
    work = Workload(get_preset("gpt-tiny"), 2, 2, 8, 2)
    need = stages_bytes(work.memory())
    room = sum(need) + 1
    assert 2 * max(need) > room
    memory, pools = [room] * 4, ["x", "x", "y", "y"]
    dev = Devices.of([1e10] * 4, memory, pools)
    with pytest.raises(DoesNotFit):
        check_fit(GRID, need, memory, pools=pools)
    assert not even_is_enough(GRID, work, dev)
    flat = Network(np.where(np.eye(4) > 0, 0.0, 10.0), np.full((4, 4), 1.0))
    placed = plan_split(flat, GRID, work, dev).best
    assert placed.missing_bytes == 0
    check_fit(placed.grid, stages_bytes(work.memory(), placed.splits), memory, pools=pools)


def test_the_elastic_layout_check_counts_shared_memory() -> None:
    # 2x2 on two machines of two agents: fits (one tasklet of each stage per machine, as
    # `packs` puts them); on one machine it does not. A shrink to one pipeline doubles each
    # replica's micro-batch: too much for one machine, enough for two.
    need = _job_needs("fp32")
    room = sum(need) + 1
    c = Cluster(config(placement="rank-order"), _pool_devices(room))
    two_machines = Devices.of([1e10] * 4, [room] * 4, ["x", "x", "y", "y"])
    one_machine = Devices.of([1e10] * 4, [room] * 4, ["x"] * 4)
    micro = c.job.config.train.micro_batches
    assert c.job.planner.fits(Layout(2, 2), micro, two_machines)
    assert not c.job.planner.fits(Layout(2, 2), micro, one_machine)
    assert not c.job.planner.fits(Layout(2, 1), micro,
                                  Devices.of([1e10] * 2, [room] * 2, ["x"] * 2))
    assert c.job.planner.fits(Layout(2, 1), micro, Devices.of([1e10] * 2, [room] * 2, ["x", "y"]))


def test_devices_carry_their_pools() -> None:
    assert Devices.of([1.0, 1.0], [5, 5], ["p", ""]).pools == ("p", "")
    assert Devices.of([1.0, 1.0]).pools == ()
    with pytest.raises(ValueError, match="1 memory pools for 2 devices"):
        Devices.of([1.0, 1.0], [5, 5], ["p"])


# --- what an agent reports ---

def test_agents_on_one_machine_report_one_pool_and_pinned_memory_none() -> None:
    pool = device.memory_pool()
    assert pool and pool == device.memory_pool()  # the same for every agent of this kernel
    assert len(pool) == 32 and int(pool, 16) >= 0
    boot = device.BOOT_ID.read_text().strip()
    assert boot not in pool  # the machine's own id never leaves it
    assert device.memory_pool(gpu="GPU-1") != device.memory_pool(gpu="GPU-2") != pool
    info = device.detect("cpu", flops=1e9)
    assert info.memory_pool == pool
    assert device.detect("cpu", flops=1e9, memory=2**30).memory_pool == ""


# --- the coordinated job ---

def _pool_devices(memory: int, pool: str = "box") -> list[common_pb2.DeviceInfo]:
    return [common_pb2.DeviceInfo(kind="cpu", flops=1e10, memory_bytes=memory,
                                  free_memory_bytes=memory, memory_pool=pool)
            for _ in range(4)]


def _job_needs(moments: str) -> list[int]:
    cfg = config(placement="rank-order")
    work = Workload(get_preset(cfg.model), 2, 2, cfg.train.global_batch,
                    cfg.train.micro_batches, moments_dtype=moments)
    return stages_bytes(work.memory())


def _fails(c: Cluster) -> asyncio.Future[None]:
    return _until(lambda: c.job.state == S.JOB_STATE_FAILED)  # type: ignore[return-value]


def test_a_job_whose_agents_share_too_little_memory_is_refused_with_the_numbers() -> None:
    need = _job_needs("fp32")
    room = 2 * max(need)  # every agent alone holds its stage; all four together do not

    async def body(c: Cluster) -> None:
        await _fails(c)
        msg = c.job.message
        assert "does not fit" in msg and "the 4 agents sharing one machine's memory" in msg
        assert f"({2 * sum(need)} bytes)" in msg and f"({room} bytes)" in msg, msg
        assert "--moments-dtype bf16" in msg and c.job.epoch == 0
    run(body, config(placement="rank-order"), _pool_devices(room))


def test_the_same_agents_on_separate_machines_run() -> None:
    room = 2 * max(_job_needs("fp32"))

    async def body(c: Cluster) -> None:
        await c.assignments()
        assert c.job.state == S.JOB_STATE_RUNNING
    devices = _pool_devices(room)
    for i, d in enumerate(devices):
        d.memory_pool = f"machine-{i}"
    run(body, config(placement="rank-order"), devices)


def test_a_scheduled_job_on_two_crowded_machines_runs_with_one_stage_of_each_per_machine(
        ) -> None:
    need = _job_needs("fp32")
    room = sum(need) + 1  # one tasklet of each stage per machine, not two of one
    devices = _pool_devices(room)
    for i, d in enumerate(devices):
        d.memory_pool = "box-a" if i in (0, 2) else "box-b"  # rank order crowds both boxes

    async def body(c: Cluster) -> None:
        got = await c.assignments()
        assert c.job.state == S.JOB_STATE_RUNNING
        per_box: dict[str, list[int]] = {}
        for i, agent in enumerate(c.ids):
            per_box.setdefault(devices[i].memory_pool, []).append(got[agent].stage)
        assert sorted(map(sorted, per_box.values())) == [[0, 1], [0, 1]], per_box
    run(body, config(), devices)


def test_bf16_moments_make_the_shared_machine_fit() -> None:
    wide, narrow = 2 * sum(_job_needs("fp32")), 2 * sum(_job_needs("bf16"))
    room = (wide + narrow) // 2
    assert narrow < room < wide

    async def fits(c: Cluster) -> None:
        await c.assignments()
        assert c.job.state == S.JOB_STATE_RUNNING

    async def refused(c: Cluster) -> None:
        await _fails(c)
    run(refused, config(placement="rank-order"), _pool_devices(room))
    bf16 = config(placement="rank-order")
    bf16.train = TrainConfig(global_batch=8, micro_batches=2, steps=5, moments_dtype="bf16")
    run(fits, bf16, _pool_devices(room))


# --- the headline on one 23 GiB machine (docs/benchmarks.md) ---

@pytest.mark.parametrize(("model", "moments", "fits"), [
    ("gpt-1.3b", "fp32", False),  # 16 bytes per parameter: 21 GiB before any activation
    ("gpt-1.3b", "bf16", False),  # full 2048-token sequences: 24.3 GiB
    ("gpt-1.3b:seq=512", "bf16", True),  # 19.4 GiB
])
def test_eight_gpt_1_3b_stages_on_one_23_gib_machine(model: str, moments: str,
                                                     fits: bool) -> None:
    shape = MemoryShape(get_preset(model), 8, 1, micro_size=1, micro_batches=1,
                        moments_dtype=moments)
    need = stages_bytes(shape)
    grid = [[d] for d in range(8)]
    box = 23 * 2**30
    check_fit(grid, need, [box] * 8)  # what every agent alone reports: always "fits"
    if fits:
        check_fit(grid, need, [box] * 8, pools=["box"] * 8)
    else:
        with pytest.raises(DoesNotFit, match="the 8 agents sharing one machine's memory"):
            check_fit(grid, need, [box] * 8, pools=["box"] * 8)


def test_the_advice_suggests_bf16_moments_only_when_they_are_not_on() -> None:
    for moments, suggested in (("fp32", True), ("bf16", False)):
        with pytest.raises(DoesNotFit) as err:
            check_fit(GRID, NEED, [3000] * 4, pools=["m"] * 4, moments_dtype=moments)
        assert ("--moments-dtype bf16" in str(err.value)) is suggested
