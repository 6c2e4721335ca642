"""Jobs submitted to a running coordinator (`coordinator submit`, `jobs`, `cancel`): real
coordinator and agent processes on loopback, real gRPC, the CLI as a person runs it."""

from __future__ import annotations

import json
import os
import signal

import grpc
import pytest

from dtfm.rpc import CHANNEL_OPTIONS
from protos.dtfm.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.daemons import Daemons, wait_for
from tests.progress import job_losses

JOB = ["--model", "gpt-tiny", "--agents", "2", "--stages", "2", "--replicas", "1",
       "--batch", "4", "--micro-batches", "2", "--search-seconds", "0.2", "--no-measure",
       "--seed", "7"]


def _cli(daemons: Daemons, address: str, *args: str) -> dict:
    out = daemons.cli("coordinator", *args, "--coordinator", address, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _jobs(daemons: Daemons, address: str) -> dict[str, dict]:
    """`coordinator jobs`, asked from this process (ListJobs, as the CLI asks it)."""
    stub = coordinator_pb2_grpc.CoordinatorStub(
        grpc.insecure_channel(address, options=CHANNEL_OPTIONS))
    reply = stub.ListJobs(coordinator_pb2.ListJobsRequest(), timeout=10,
                          metadata=(("authorization", f"Bearer {daemons.token}"),))
    return {j.job_id: {"state": coordinator_pb2.JobState.Name(j.state).removeprefix(
        "JOB_STATE_").lower(), "step": j.step} for j in reply.jobs}


def _state(daemons: Daemons, address: str, job_id: str) -> str:
    return _jobs(daemons, address).get(job_id, {}).get("state", "")


@pytest.mark.timeout(240)
def test_queued_jobs_run_in_turn_cancel_and_train_as_alone(daemons: Daemons) -> None:
    _, address = daemons.coordinator()
    for i in range(2):
        daemons.agent(address, f"agent-{i}")
    first = _cli(daemons, address, "submit", *JOB, "--steps", "4")["job_id"]
    second = _cli(daemons, address, "submit", *JOB, "--steps", "4")["job_id"]
    long = _cli(daemons, address, "submit", *JOB, "--steps", "500")["job_id"]
    queued = _cli(daemons, address, "submit", *JOB, "--steps", "4")
    last = _cli(daemons, address, "submit", *JOB, "--steps", "3")["job_id"]
    assert queued["position"] >= 2, queued
    # a queued job cancelled never runs
    cancelled = _cli(daemons, address, "cancel", queued["job_id"])
    assert "had not started" in cancelled["message"]
    wait_for(lambda: _state(daemons, address, long) == "running"
             and _jobs(daemons, address)[long]["step"] >= 2, 120,
             "the first two jobs to end and the long one to train", interval=0.2)
    jobs = _jobs(daemons, address)
    assert jobs[first]["state"] == jobs[second]["state"] == "done", jobs
    assert jobs[queued["job_id"]]["state"] == "cancelled", jobs
    # the second job ran on the same agents after the first, and trained as it would alone:
    # the same flags and seed give the same loss at every step
    alone, after = job_losses(daemons.tmp, first), job_losses(daemons.tmp, second)
    assert sorted(alone) == [1, 2, 3, 4] and after == alone, (alone, after)
    # cancelled in the middle: its members stop and the next job starts on them
    _cli(daemons, address, "cancel", long, "--reason", "test")
    wait_for(lambda: _state(daemons, address, last) == "done", 90, "the last job to train")
    jobs = _jobs(daemons, address)
    assert jobs[long]["state"] == "cancelled" and jobs[long]["step"] < 500, jobs
    assert sorted(job_losses(daemons.tmp, last)) == [1, 2, 3]
    assert not list(daemons.tmp.glob(f"*/work/{queued['job_id']}-*"))
    text = daemons.cli("coordinator", "status", "--all", "--coordinator", address)
    assert text.returncode == 0 and long in text.stdout and "cancelled" in text.stdout


@pytest.mark.timeout(180)
def test_a_restarted_coordinator_keeps_its_queue_and_outsiders_are_refused(
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
    for i in range(2):
        daemons.agent(address, f"agent-{i}")
    running = _cli(daemons, address, "submit", *JOB, "--steps", "500")["job_id"]
    waiting = _cli(daemons, address, "submit", *JOB, "--steps", "3")["job_id"]
    wait_for(lambda: _jobs(daemons, address).get(running, {}).get("step", 0) >= 1, 90,
             "the first job to train")
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)
    _, address = daemons.coordinator("--state-dir", state, port=int(address.rsplit(":")[1]))
    jobs = _jobs(daemons, address)
    assert jobs[waiting]["state"] == "queued" and running in jobs, jobs
    wait_for(lambda: _state(daemons, address, running) == "running", 60,
             "the running job to be adopted")
    _cli(daemons, address, "cancel", running)
    wait_for(lambda: _state(daemons, address, waiting) == "done", 90, "the queued job to run")
    assert sorted(job_losses(daemons.tmp, waiting)) == [1, 2, 3]
