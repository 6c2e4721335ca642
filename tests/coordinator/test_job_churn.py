"""Churn in the job state machine (fake registry and agents, as in test_job_states): shrinking
on survivors, growing back at a checkpoint, a restart budget that progress refills, and a
coordinator restart that adopts the job from its state directory."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from coordinator.daemon.config import JobConfig
from coordinator.daemon.jobstore import JobStore
from coordinator.job.machine import job_fingerprint
from dtfm.core.spec import TrainConfig
from dtfm.core.workerstate import WorkerState
from protos.dtfm.v1 import coordinator_pb2
from tests.coordinator.test_job_states import Harness, RecordingJob, run, until

S = coordinator_pb2


def churn_config(**kw: Any) -> JobConfig:
    cfg = JobConfig(model="gpt-tiny", agents=6, stages=2, replicas=3,
                    train=TrainConfig(global_batch=12, micro_batches=2, steps=20,
                                      checkpoint_every=4),
                    measure_links=True, placement="scheduled", search_seconds=0.5, **kw)
    cfg.validate()
    return cfg


def with_state_dir(cfg: JobConfig, state_dir: Path) -> Harness:
    """A harness whose job keeps its state in `state_dir`, as `coordinator start --state-dir`
    does: a second one on the same directory is the coordinator restarted."""
    return Harness(cfg, JobStore(state_dir))


async def die_in_recovery(cfg: JobConfig, state_dir: Path, agents: int) -> None:
    """A coordinator keeping state in `state_dir` trains past the checkpoint of step 4, loses
    its last member, places the recovery's epoch 2 and dies (SIGKILL) before that trains."""
    h = with_state_dir(cfg, state_dir)
    h.registry.add(agents)
    task = asyncio.get_running_loop().create_task(h.job.run())
    await h.running_epoch(1)
    report_all(h, 6)
    await until(lambda: h.job.checkpoint_step == 4)
    lose(h, h.job.members[-1])
    await h.running_epoch(2)
    task.cancel()


def lose(h: Harness, agent_id: str) -> None:
    h.registry.states[agent_id] = S.AGENT_STATE_LOST  # the registry's sweep did this
    h.job.on_lost([h.registry.agents[agent_id]])


def report_all(h: Harness, step: int, state: WorkerState = WorkerState.TRAINING) -> None:
    for agent_id in h.job.members:
        h.report(agent_id, state, step=step)


def test_a_lost_agent_shrinks_the_job_to_fewer_replicas_on_the_same_stages() -> None:
    async def body(h: Harness) -> None:
        await h.running_epoch(1)
        grid = [list(row.agent_ids) for row in h.job.plan.grid]  # type: ignore[union-attr]
        report_all(h, 6)  # every member passed the checkpoint of step 4
        victim = grid[1][2]
        lose(h, victim)
        await h.running_epoch(2)
        plan = h.job.plan
        assert plan is not None and (plan.stages, plan.replicas) == (2, 2)
        # survivors stay on the stage whose checkpoints they hold
        for old, new in zip(grid, plan.grid, strict=True):
            assert set(new.agent_ids) <= set(old)
        assigns = {a: h.registry.agents[a].assignments()[-1] for a in h.job.members}
        # the global batch is kept: 12 sequences over 2 replicas in micro-batches of 2
        assert {a.train.micro_batches for a in assigns.values()} == {3}
        assert {a.train.global_batch for a in assigns.values()} == {12}
        rec = h.job.recoveries.items[-1]
        assert rec.layout_before == "2x3" and rec.layout_after == "2x2"
        assert victim in rec.reason and rec.last_step == 6
        report_all(h, 5)  # the new epoch resumed after step 4
        assert rec.resumed_step == 4 and rec.steps_lost == 2 and rec.stalled_s > 0
    run(churn_config(min_agents=4), body, agents=6)


def test_a_recovery_records_the_step_the_worker_says_it_resumed_from() -> None:
    """Heartbeats are a second apart and fast steps outrun them: the first one of the new
    epoch may carry step 8 of a run that resumed after step 4."""
    async def body(h: Harness) -> None:
        await h.running_epoch(1)
        report_all(h, 6)
        lose(h, h.job.members[-1])
        await h.running_epoch(2)
        for agent_id in h.job.members:
            h.report(agent_id, WorkerState.TRAINING, step=8, resumed_step=4)
        rec = h.job.recoveries.items[-1]
        assert rec.resumed_step == 4 and rec.steps_lost == 2, rec
    run(churn_config(min_agents=4), body, agents=6)


def test_without_min_agents_a_loss_waits_for_a_spare() -> None:
    async def body(h: Harness) -> None:
        await h.running_epoch(1)
        lose(h, h.job.members[0])
        await until(lambda: "5 of 6 alive" in h.job.message)
        await asyncio.sleep(0.1)
        assert h.job.state == S.JOB_STATE_RECOVERING and h.job.epoch == 1
    run(churn_config(), body, agents=6)


def test_the_job_grows_back_at_the_next_checkpoint_when_agents_join() -> None:
    async def body(h: Harness) -> None:
        h.links.remember = True
        await h.running_epoch(1)
        victim = h.job.members[-1]
        lose(h, victim)
        await h.running_epoch(2)
        assert h.job.plan is not None and h.job.plan.replicas == 2
        # the survivors keep their stages, and status still says how that grid was found
        assert h.job.plan.algorithm == "hybrid-ga + step-time polish, kept from epoch 1"
        assert len(h.measurer.rounds) == 1, "survivors' links are reused, not measured again"
        h.registry.add(1)  # a new agent joins
        newcomer = max(h.registry.agents)
        # its links are measured while the job trains, to the members and the spare survivor
        # (the measurer probes only links it has no figure for), never to the dead agent
        await until(lambda: len(h.measurer.rounds) == 2)
        assert newcomer in h.measurer.rounds[1] and victim not in h.measurer.rounds[1]
        assert set(h.job.members) < set(h.measurer.rounds[1])
        assert h.job.state == S.JOB_STATE_RUNNING and h.job.epoch == 2
        report_all(h, 5)  # resumed after the checkpoint of step 4: nothing new to grow at
        await asyncio.sleep(0.1)
        assert h.job.epoch == 2 and h.job.checkpoint_step == 4
        report_all(h, 9)  # passed the checkpoint of step 8: grow now
        await h.running_epoch(3)
        assert h.job.plan.replicas == 3 and h.job.restarts == 0
        assert h.job.plan.algorithm == "hybrid-ga + step-time polish, kept from epoch 2"
        grow = h.job.recoveries.items[-1]
        assert grow.planned and grow.layout_before == "2x2" and grow.layout_after == "2x3"
        assert len(h.measurer.rounds) == 2, "growing back did not stop to measure"
        assert newcomer in h.job.members
        assigns = [h.registry.agents[a].assignments()[-1] for a in h.job.members]
        assert {a.train.micro_batches for a in assigns} == {2}
    run(churn_config(min_agents=4), body, agents=6)


def test_progress_refills_the_restart_budget() -> None:
    async def body(h: Harness) -> None:
        await h.running_epoch(1)
        for epoch, step in ((1, 5), (2, 9), (3, 13)):  # each epoch passes a new checkpoint
            report_all(h, step - 4)  # its first step
            report_all(h, step)
            await until(lambda s=step: h.job.checkpoint_step == (s - 1) // 4 * 4)
            h.report(h.job.members[0], WorkerState.FAILED, error="peer died", error_kind="peer")
            await h.running_epoch(epoch + 1)
        assert h.job.state == S.JOB_STATE_RUNNING and h.job.restarts == 1
        h.report(h.job.members[0], WorkerState.FAILED, error="peer died", error_kind="peer")
        await until(lambda: h.job.state == S.JOB_STATE_FAILED)  # 2 in a row without progress
        assert "without a new checkpoint" in h.job.message
    run(churn_config(max_restarts=1), body, agents=6)


@pytest.mark.parametrize("sync_every,outer_delay", [(1, 0), (4, 1)])
def test_a_restarted_coordinator_adopts_the_running_job(tmp_path: Path, sync_every: int,
                                                        outer_delay: int) -> None:
    cfg = churn_config()
    cfg.train = replace(cfg.train, sync_every=sync_every, outer_delay=outer_delay)
    cfg.validate()

    async def main() -> None:
        first = with_state_dir(cfg, tmp_path)
        first.registry.add(6)
        task = asyncio.get_running_loop().create_task(first.job.run())
        await first.running_epoch(1)
        report_all(first, 9)
        await until(lambda: first.job.checkpoint_step == 8)
        task.cancel()  # the coordinator dies (SIGKILL: nothing more is written)
        job_id, members = first.job.job_id, list(first.job.members)

        second = with_state_dir(cfg, tmp_path)  # a new process: fresh registry, the same state dir
        assert second.job.job_id == job_id and second.job.epoch == 1
        second.registry.add(6)  # the agents re-join
        task = asyncio.get_running_loop().create_task(second.job.run())
        await until(lambda: second.job.state == S.JOB_STATE_RUNNING)
        assert second.job.members == members and second.measurer.rounds == []
        plan = second.job.plan  # what status shows of the adopted epoch: its H and delay too
        assert plan is not None and plan.placement == "adopted"
        assert (plan.sync_every, plan.outer_delay) == (sync_every, outer_delay)
        report_all(second, 12)  # the workers trained on meanwhile
        report_all(second, 20, WorkerState.DONE)
        await until(lambda: second.job.state == S.JOB_STATE_DONE)
        assert second.job.epoch == 1  # nothing was restarted
        task.cancel()
        third = RecordingJob(cfg, second.registry, second.measurer, second.links,
                             JobStore(tmp_path))
        assert third.job_id != job_id  # a finished job is not adopted again
    asyncio.run(main())


def test_a_coordinator_restarted_in_mid_recovery_finishes_the_recovery_record(
        tmp_path: Path) -> None:
    cfg = churn_config(min_agents=4)

    async def main() -> None:
        await die_in_recovery(cfg, tmp_path, agents=6)
        second = with_state_dir(cfg, tmp_path)
        second.registry.add(6)
        task = asyncio.get_running_loop().create_task(second.job.run())
        await until(lambda: second.job.state == S.JOB_STATE_RUNNING)
        assert second.job.epoch == 2
        report_all(second, 5)  # the adopted epoch resumed after the checkpoint of step 4
        rec = second.job.recoveries.items[-1]
        assert rec.layout_before == "2x3" and rec.layout_after == "2x2", rec
        assert rec.resumed_step == 4 and rec.steps_lost == 2 and rec.stalled_s > 0, rec
        assert not second.job.recoveries.pending
        task.cancel()
    asyncio.run(main())


def two_stage_config(**kw: Any) -> JobConfig:
    cfg = JobConfig(model="gpt-tiny", agents=2, stages=2, replicas=1,
                    train=TrainConfig(global_batch=4, micro_batches=2, steps=20,
                                      checkpoint_every=4),
                    measure_links=True, placement="rank-order", **kw)
    cfg.validate()
    return cfg


def test_too_few_agents_for_every_stage_re_plans_on_fewer_stages_and_grows_back(
        tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        h.links.remember = True
        await h.running_epoch(1)
        assert h.job.plan is not None and list(h.job.plan.layer_splits) == [2, 2]
        report_all(h, 6)  # every member passed the checkpoint of step 4
        await until(lambda: h.job.checkpoint_step == 4)
        victim = h.job.members[1]
        lose(h, victim)
        await h.running_epoch(2)
        plan = h.job.plan
        assert plan is not None and (plan.stages, plan.replicas) == (1, 1)
        assert list(plan.layer_splits) == [4]
        [a] = [h.registry.agents[m].assignments()[-1] for m in h.job.members]
        # the survivor reads both old stages' checkpoints, with the global batch kept
        assert list(a.checkpoint_splits) == [2, 2]
        assert (a.layer_begin, a.layer_end) == (0, 4)
        assert (a.train.global_batch, a.train.micro_batches) == (4, 2)
        rec = h.job.recoveries.items[-1]
        assert (rec.layout_before, rec.layout_after) == ("2x1", "1x1") and not rec.planned
        # until the one stage writes a checkpoint, the newest one is still cut in two
        report_all(h, 5)
        assert h.job.store is not None
        snap = h.job.store.unfinished(job_fingerprint(h.job.config))
        assert snap is not None and snap.checkpoint_splits == [2, 2] and snap.splits == [4]
        assert (snap.wanted_stages, snap.wanted_replicas) == (2, 1)
        report_all(h, 9)  # the checkpoint of step 8 holds the whole model in one stage
        await until(lambda: h.job.checkpoint_step == 8)
        snap = h.job.store.unfinished(job_fingerprint(h.job.config))
        assert snap is not None and snap.checkpoint_splits == [4]

        h.registry.states[victim] = S.AGENT_STATE_ALIVE  # the agent comes back
        h.job.on_join(h.registry.agents[victim])
        await until(lambda: h.links.complete_for([*h.job.members, victim]))
        report_all(h, 11)  # no new checkpoint passed: keep training
        await asyncio.sleep(0.1)
        assert h.job.epoch == 2
        report_all(h, 13)  # passed the checkpoint of step 12: grow back now
        await h.running_epoch(3)
        plan = h.job.plan
        assert plan is not None and (plan.stages, plan.replicas) == (2, 1)
        assert list(plan.layer_splits) == [2, 2] and victim in h.job.members
        assigns = [h.registry.agents[m].assignments()[-1] for m in h.job.members]
        # both stages re-split the one-stage checkpoint
        assert [list(x.checkpoint_splits) for x in assigns] == [[4], [4]]
        grow = h.job.recoveries.items[-1]
        assert grow.planned and (grow.layout_before, grow.layout_after) == ("1x1", "2x1")
        assert h.job.restarts == 0
        for m in h.job.members:
            h.report(m, WorkerState.TRAINING, step=13)
        report_all(h, 17)  # the two stages' own checkpoint of step 16
        await until(lambda: h.job.checkpoint_step == 16)
        snap = h.job.store.unfinished(job_fingerprint(h.job.config))
        assert snap is not None and snap.checkpoint_splits == [2, 2]
    run(two_stage_config(min_agents=1), body, agents=2, store=JobStore(tmp_path))


def test_fewer_stages_wait_when_the_survivors_cannot_hold_the_model() -> None:
    async def body(h: Harness) -> None:
        await h.running_epoch(1)
        for agent in h.registry.agents.values():  # room for half of gpt-tiny, not all of it
            agent.info.device.memory_bytes = 6_000_000
        lose(h, h.job.members[1])
        await until(lambda: "1 of 2 alive" in h.job.message)
        await asyncio.sleep(0.1)
        assert h.job.state == S.JOB_STATE_RECOVERING and h.job.epoch == 1
    run(two_stage_config(min_agents=1), body, agents=2)


def test_a_restarted_coordinator_keeps_the_stages_a_shrunk_job_grows_back_to(
        tmp_path: Path) -> None:
    cfg = two_stage_config(min_agents=1)

    async def main() -> None:
        await die_in_recovery(cfg, tmp_path, agents=2)  # shrunk to one stage
        second = with_state_dir(cfg, tmp_path)
        second.links.remember = True
        second.registry.add(2)  # both agents are back
        second.links.known.update(second.registry.agents)
        task = asyncio.get_running_loop().create_task(second.job.run())
        await until(lambda: second.job.state == S.JOB_STATE_RUNNING)
        assert second.job.epoch == 2 and second.job.status().stages == 1
        report_all(second, 5)
        report_all(second, 9)  # the one stage's own checkpoint of step 8: grow back now
        await second.running_epoch(3)
        plan = second.job.plan
        assert plan is not None and (plan.stages, plan.replicas) == (2, 1)
        assigns = [second.registry.agents[m].assignments()[-1] for m in second.job.members]
        assert [list(a.checkpoint_splits) for a in assigns] == [[4], [4]]
        task.cancel()
    asyncio.run(main())


def test_a_recovery_does_not_plan_or_measure_an_agent_silent_since_the_fault() -> None:
    """Issue 11's defect: re-measuring after a loss first probed the dead agent (about 40 s of
    probe timeouts), because the registry had not yet swept it. Only agents heard from since
    the fault count; the dead one is swept by its missed heartbeats meanwhile."""
    async def body(h: Harness) -> None:
        await h.running_epoch(1)
        dead = h.job.members[0]
        h.registry.agents[dead].silent_since = time.monotonic() - 1.0  # died a second ago
        h.report(h.job.members[1], WorkerState.FAILED, error="peer died", error_kind="peer")
        await until(lambda: "5 of 6 alive" in h.job.message)  # not planned, not measured
        assert len(h.measurer.rounds) == 1 and h.job.epoch == 1
        lose(h, dead)  # the registry's sweep
        await h.running_epoch(2)
        assert dead not in h.job.members
        assert all(dead not in r for r in h.measurer.rounds[1:]), h.measurer.rounds
        assert h.job.plan is not None and (h.job.plan.stages, h.job.plan.replicas) == (2, 2)
    run(churn_config(min_agents=4), body, agents=6)


def test_one_replica_stages_keep_checkpoints_from_the_oldest_step_a_mirror_holds() -> None:
    """Stage s is mirrored by stage s + 1's agent; every agent must keep the oldest step a
    mirror holds as its newest, since a recovery after losing a stage resumes there."""
    async def body(h: Harness) -> None:
        await h.running_epoch(1)
        grid = h.job.planner.grid_ids
        first, second = grid[0][0], grid[1][0]
        assert h.job.checkpoint_floor() == 1  # no mirror has copied yet: keep everything
        h.report(second, WorkerState.TRAINING, step=9, mirrored_steps={0: 8})
        assert h.job.checkpoint_floor() == 1  # stage 1's mirror still holds nothing
        h.report(first, WorkerState.TRAINING, step=9, mirrored_steps={1: 4})
        assert h.job.checkpoint_floor() == 4
        h.report(first, WorkerState.TRAINING, step=13, mirrored_steps={1: 12})
        assert h.job.checkpoint_floor() == 8
        h.report(second, WorkerState.TRAINING, step=13, mirrored_steps={0: 12})
        assert h.job.checkpoint_floor() == 12
    run(two_stage_config(), body, agents=2)


def test_replicated_stages_and_shared_checkpoint_dirs_need_no_floor() -> None:
    async def body(h: Harness) -> None:
        await h.running_epoch(1)
        for agent_id in h.job.members:
            h.report(agent_id, WorkerState.TRAINING, step=30, integrity_through=30)
        # no mirror's floor (it would hold an older step); with replica checks (R > 1) the
        # known-good checkpoint, 10 steps back (coordinator/integrity/rollback.py)
        replicated = h.job.plan is not None and h.job.plan.replicas > 1
        assert h.job.checkpoint_floor() == (20 if replicated else 0)

    for cfg in (churn_config(), two_stage_config()):
        if cfg.replicas == 1:
            cfg.train = TrainConfig(global_batch=4, micro_batches=2, steps=20,
                                    checkpoint_every=4, checkpoint_dir="/shared/ckpt")
        run(cfg, body, agents=cfg.agents)
