"""The daemon handing its agents from one job to the next (`CoordinatorService.use_job`,
coordinator/daemon/jobs.py), on the daemon's own service over real gRPC: the next job keeps
the coordinator's relay, the metrics and the push gate follow it, and an agent a confirmed
fault excluded stays out of it until `coordinator admit`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from coordinator.daemon.jobs import Submitted
from coordinator.daemon.metrics import coordinator_registry
from coordinator.jobflags import parse_submitted
from dtfm.net.relay import Relay
from protos.dtfm.v1 import coordinator_pb2
from tests.coordinator.test_checkpoint_copies import coordinator, joined

pytestmark = pytest.mark.timeout(60)


def test_the_next_job_keeps_the_relay_the_exclusions_and_the_metrics_follow_it(
        tmp_path: Path) -> None:
    async def main() -> None:
        async with coordinator(tmp_path) as (target, svc):
            await joined(target, "bad")
            first = svc.job
            relay = first.dataplane.relay = Relay(None, port=1)  # the coordinator's
            assert first.integrity.ledger.record("bad", "weight_digest", 5, "odd one out",
                                                 reporter="good", confirmed=True)
            scrape = coordinator_registry(svc.registry, lambda: svc.job, svc.links)
            args = ["--model", "gpt-tiny", "--agents", "2", "--steps", "3"]
            ended = asyncio.get_running_loop().create_future()
            ended.set_result(None)  # the first job's drive is over: it goes to the archive
            svc.runs[first.job_id].driving = ended
            svc.reap()
            assert not svc.runs and not svc.pool.shares and svc.job is first
            svc.use_job(Submitted("job-next", parse_submitted(args), args, 0.0))
            job = svc.job
            assert job is not first and job.job_id == "job-next"
            assert job.dataplane.relay is relay and svc.measurer.punching is job.dataplane
            assert "coordinator admit bad" in job.integrity.refusal("bad")
            assert job.integrity.ledger.rollback_before == 0  # the old job's bound stays there
            assert b'job_id="job-next"' in generate_latest(scrape)
            status, _ = svc.status_answer()
            assert status.job.job_id == "job-next"
            assert status.job.state == coordinator_pb2.JOB_STATE_WAITING

    asyncio.run(main())
