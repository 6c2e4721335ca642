"""Two submitted jobs running side by side on disjoint agents of one coordinator
(coordinator/daemon/jobcalls.py, share.py, jobsplit.py): real coordinator and agent
processes on loopback, real gRPC. Each job trains exactly as it would alone; a job that ends
or is cancelled hands its agents to the next queued one without restarting them; a restarted
coordinator keeps its queue and the jobs that ran; callers without the token are refused."""

from __future__ import annotations

import os
import re
import signal
from typing import Any

import grpc
import pytest

from dtfm.rpc import CHANNEL_OPTIONS
from protos.dtfm.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.daemons import Daemons, wait_for
from tests.progress import job_losses
from tests.system.test_submit_jobs import JOB


def _call(daemons: Daemons, address: str, method: str, request: Any) -> Any:
    """One Coordinator call from this process, with the test token."""
    channel = daemons.channels.get(address)
    if channel is None:
        channel = daemons.channels[address] = grpc.insecure_channel(address,
                                                                    options=CHANNEL_OPTIONS)
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    return getattr(stub, method)(request, timeout=10,
                                 metadata=(("authorization", f"Bearer {daemons.token}"),))


def _rows(daemons: Daemons, address: str) -> dict[str, coordinator_pb2.JobEntry]:
    return {j.job_id: j for j in _call(daemons, address, "ListJobs",
                                       coordinator_pb2.ListJobsRequest()).jobs}


def _state(daemons: Daemons, address: str, job_id: str) -> str:
    row = _rows(daemons, address).get(job_id)
    return "" if row is None else coordinator_pb2.JobState.Name(row.state).removeprefix(
        "JOB_STATE_").lower()


def _submit(daemons: Daemons, address: str, steps: int) -> str:
    return _call(daemons, address, "SubmitJob", coordinator_pb2.SubmitJobRequest(
        args=[*JOB, "--steps", str(steps)])).job_id


def _agents_of(daemons: Daemons, job_id: str) -> set[str]:
    """The agents whose workers trained `job_id` (their progress files)."""
    return {p.relative_to(daemons.tmp).parts[0]
            for p in daemons.tmp.glob(f"*/work/{job_id}-e*-r*.progress.jsonl")}


@pytest.mark.timeout(300)
def test_two_jobs_side_by_side_a_restart_and_a_cancel_each_trains_as_alone(
        daemons: Daemons) -> None:
    state = str(daemons.tmp / "state")
    proc, address = daemons.coordinator("--state-dir", state)
    # no token: refused like every other call
    stub = coordinator_pb2_grpc.CoordinatorStub(
        grpc.insecure_channel(address, options=CHANNEL_OPTIONS))
    for call, request in ((stub.SubmitJob, coordinator_pb2.SubmitJobRequest(args=JOB)),
                          (stub.ListJobs, coordinator_pb2.ListJobsRequest()),
                          (stub.CancelJob, coordinator_pb2.CancelJobRequest(job_id="x"))):
        with pytest.raises(grpc.RpcError) as refused:
            call(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    agents = [daemons.agent(address, f"agent-{i}") for i in range(4)]
    # three queued: the first two run side by side on 2 agents each, the third waits
    long, short = _submit(daemons, address, 500), _submit(daemons, address, 3)
    later = _submit(daemons, address, 3)
    wait_for(lambda: all(_state(daemons, address, j) == "running" for j in (long, short)),
             90, "two jobs to run side by side", interval=0.2)
    rows = _rows(daemons, address)
    assert "holds 2 agent(s): 2 agent(s) of 2 wanted" in rows[short].message, rows[short]
    assert f"beside {long}" in rows[short].message, rows[short]
    # status shows the first job; the other by its id
    status = _call(daemons, address, "GetStatus", coordinator_pb2.StatusRequest())
    other = _call(daemons, address, "GetStatus", coordinator_pb2.StatusRequest(job_id=short))
    assert status.job.job_id == long and other.job.job_id == short
    assert other.job.state in (coordinator_pb2.JOB_STATE_RUNNING, coordinator_pb2.JOB_STATE_DONE)
    assert _state(daemons, address, later) == "queued"
    # a restart with a queue: the queue stays, the running jobs are adopted
    wait_for(lambda: _rows(daemons, address)[long].step >= 1, 90, "the long job to train")
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)
    proc, address = daemons.coordinator("--state-dir", state, port=int(address.rsplit(":")[1]))
    assert _state(daemons, address, later) == "queued"
    # the short job ends: its agents take the next queued job, beside the long one
    wait_for(lambda: _state(daemons, address, later) == "done", 120,
             "the queued job to train on the short job's agents", interval=0.2)
    assert _state(daemons, address, long) == "running" and _state(
        daemons, address, short) == "done"
    # cancelled in the middle: its agents are free, and a job submitted now runs alone
    _call(daemons, address, "CancelJob", coordinator_pb2.CancelJobRequest(job_id=long))
    assert _state(daemons, address, long) == "cancelled" and _rows(
        daemons, address)[long].step < 500
    last = _submit(daemons, address, 3)
    wait_for(lambda: _state(daemons, address, last) == "done", 120, "the last job to train",
             interval=0.2)
    # disjoint agents side by side; the next job on the agents an ended one gave back
    assert len(_agents_of(daemons, long)) == len(_agents_of(daemons, short)) == 2
    assert not _agents_of(daemons, long) & _agents_of(daemons, short)
    assert _agents_of(daemons, later) == _agents_of(daemons, short)
    assert all(a.poll() is None for a in agents)  # never restarted: the same processes
    # each trained exactly as the job alone did: the same flags and seed, the same losses
    assert re.search(rf"job {last}: starting .*; alone: every live agent", daemons.log(proc))
    alone = job_losses(daemons.tmp, last)
    assert sorted(alone) == [1, 2, 3]
    assert job_losses(daemons.tmp, short) == job_losses(daemons.tmp, later) == alone
