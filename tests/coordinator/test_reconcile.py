"""Failed saves of the job's state are seen, and a restart reconciles a stale snapshot with what
the members report.

A full --state-dir is a seam here (a JobStore whose write raises sqlite's "database or disk is
full"), not a real full disk. The restart: a coordinator whose saves failed after epoch 1 while
the job went on to epoch 3 must not show step 0 for the adoption wait and then restart the
workers into an epoch number they already used.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from coordinator.commands.status import status_to_json, status_to_text
from coordinator.daemon.config import JobConfig
from coordinator.daemon.jobstore import JobSnapshot, JobStore
from coordinator.daemon.metrics import coordinator_registry
from coordinator.daemon.registry import Registry
from coordinator.job.machine import Job
from coordinator.links.measure import LinkMeasurer
from coordinator.links.store import LinkStore
from dtfm.core.workerstate import WorkerState
from protos.dtfm.v1 import coordinator_pb2
from tests.coordinator.test_job_churn import churn_config, report_all, with_state_dir
from tests.coordinator.test_job_states import Harness, until

S = coordinator_pb2


class FullDisk(JobStore):
    """A state directory that refuses writes while `full` is set."""

    full = False

    def write(self, snap: JobSnapshot, finished: bool = False) -> None:
        if self.full:
            raise sqlite3.OperationalError("database or disk is full")
        super().write(snap, finished)


def test_failed_saves_show_in_status_json_text_and_metrics_until_one_works(
        tmp_path: Path) -> None:
    async def main() -> None:
        store = FullDisk(tmp_path)
        h = Harness(churn_config(), store)
        h.registry.add(6)
        task = asyncio.get_running_loop().create_task(h.job.run())
        await h.running_epoch(1)
        saved = store.saved_unix_s
        assert saved > 0 and h.job.status().state_save_failures == 0
        store.full = True
        report_all(h, 5)  # passing the checkpoint of step 4 saves the state
        await until(lambda: h.job.checkpoint_step == 4)
        status = coordinator_pb2.ClusterStatus(job=h.job.status(), now_unix_s=saved + 30)
        saves = status_to_json(status)["job"]["state_saves"]
        assert saves["failures"] >= 1 and "disk is full" in saves["error"], saves
        assert saves["saved_unix_s"] == saved
        text = status_to_text(status)
        assert "STATE NOT SAVED" in text and "last saved 30 s ago" in text, text
        store.full = False
        report_all(h, 9)
        await until(lambda: h.job.checkpoint_step == 8)
        assert h.job.status().state_save_failures == 0 and store.saved_unix_s > saved
        assert "STATE NOT SAVED" not in status_to_text(
            coordinator_pb2.ClusterStatus(job=h.job.status()))
        task.cancel()
    asyncio.run(main())


def test_a_restart_on_a_stale_snapshot_re_plans_at_once_into_a_newer_epoch(
        tmp_path: Path) -> None:
    cfg = churn_config()

    async def main() -> None:
        first = with_state_dir(cfg, tmp_path)
        first.registry.add(6)
        task = asyncio.get_running_loop().create_task(first.job.run())
        await first.running_epoch(1)
        task.cancel()  # the state of epoch 1 is the last one saved; the job went on to epoch 3
        job_id = first.job.job_id

        second = with_state_dir(cfg, tmp_path)
        assert second.job.epoch == 1
        second.registry.add(6)
        task = asyncio.get_running_loop().create_task(second.job.run())
        await until(lambda: second.job.state == S.JOB_STATE_RUNNING)
        member = second.job.members[0]
        second.job.on_progress(second.registry.agents[member], S.ProgressReport(
            agent_id=member, job_id=job_id, epoch=3, step=40,
            worker_state=WorkerState.TRAINING.to_wire()))
        await second.running_epoch(4)  # at once, not after the adoption wait of 60 s
        reason = second.job.recoveries.items[-1].reason
        assert "held epoch 1" in reason and "reports epoch 3" in reason, reason
        assigned = second.registry.agents[member].assignments()
        assert assigned and assigned[-1].epoch == 4  # newer than any epoch the agents ran
        task.cancel()
    asyncio.run(main())


def test_failed_saves_show_in_the_metrics(tmp_path: Path) -> None:
    registry, links = Registry(5.0), LinkStore()
    store = FullDisk(tmp_path)
    job = Job(JobConfig(model="gpt-tiny", agents=2), registry, LinkMeasurer(registry, links),
              links, store)
    store.full = True
    for _ in range(2):
        with pytest.raises(sqlite3.OperationalError):
            store.save(JobSnapshot(job_id=job.job_id, fingerprint="f"))
    metrics = generate_latest(coordinator_registry(registry, job, links)).decode()
    want = f'dtfm_job_state_save_failures{{job_id="{job.job_id}",model="gpt-tiny"}} 2.0'
    assert want in metrics, [m for m in metrics.splitlines() if "state_save" in m]
