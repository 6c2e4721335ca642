"""Jobs submitted to a running coordinator (`coordinator submit`, `jobs`, `cancel`): real
coordinator and agent processes on loopback, real gRPC, the CLI as a person runs it."""

from __future__ import annotations

import json

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


def _stub(daemons: Daemons, address: str) -> coordinator_pb2_grpc.CoordinatorStub:
    if address not in daemons.channels:
        daemons.channels[address] = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return coordinator_pb2_grpc.CoordinatorStub(daemons.channels[address])


def _jobs(daemons: Daemons, address: str) -> dict[str, dict]:
    """`coordinator jobs`, asked from this process (ListJobs, as the CLI asks it)."""
    reply = _stub(daemons, address).ListJobs(coordinator_pb2.ListJobsRequest(), timeout=10,
                          metadata=(("authorization", f"Bearer {daemons.token}"),))
    return {j.job_id: {"state": coordinator_pb2.JobState.Name(j.state).removeprefix(
        "JOB_STATE_").lower(), "step": j.step} for j in reply.jobs}


def _state(daemons: Daemons, address: str, job_id: str) -> str:
    return _jobs(daemons, address).get(job_id, {}).get("state", "")


def _submit(daemons: Daemons, address: str, *args: str) -> str:
    """SubmitJob from this process (a CLI per call costs a Python start on CI's two cores)."""
    return _stub(daemons, address).SubmitJob(
        coordinator_pb2.SubmitJobRequest(args=args), timeout=10,
        metadata=(("authorization", f"Bearer {daemons.token}"),)).job_id


@pytest.mark.timeout(150)
def test_queued_jobs_run_in_turn_and_the_second_trains_as_alone(daemons: Daemons) -> None:
    _, address = daemons.coordinator()
    for i in range(2):
        daemons.agent(address, f"agent-{i}")
    first = _cli(daemons, address, "submit", *JOB, "--steps", "4")["job_id"]
    second = _submit(daemons, address, *JOB, "--steps", "4")
    queued = _submit(daemons, address, *JOB, "--steps", "4")
    # a queued job cancelled never runs
    assert "had not started" in _cli(daemons, address, "cancel", queued)["message"]
    wait_for(lambda: _state(daemons, address, second) == "done", 120,
             "both jobs to train in turn", interval=0.2)
    jobs = _jobs(daemons, address)
    assert jobs[first]["state"] == "done" and jobs[queued]["state"] == "cancelled", jobs
    # the second job ran on the same agents after the first, and trained as it would alone:
    # the same flags and seed give the same loss at every step
    alone, after = job_losses(daemons.tmp, first), job_losses(daemons.tmp, second)
    assert sorted(alone) == [1, 2, 3, 4] and after == alone, (alone, after)
    assert not list(daemons.tmp.glob(f"*/work/{queued}-*"))
    # each job keeps its own history (`coordinator report --job`)
    auth = (("authorization", f"Bearer {daemons.token}"),)
    history = _stub(daemons, address).GetHistory(
        coordinator_pb2.HistoryRequest(job_id=first), timeout=10, metadata=auth)
    assert history.job_id == first and history.state == coordinator_pb2.JOB_STATE_DONE
    assert {p.loss for p in history.points} <= set(alone.values()), history
    with pytest.raises(grpc.RpcError) as missing:
        _stub(daemons, address).GetHistory(coordinator_pb2.HistoryRequest(job_id="job-none"),
                                           timeout=10, metadata=auth)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    # ... and its own export, gathered from the agents after the next job ran on them
    out = daemons.tmp / "first-model"
    exported = _cli(daemons, address, "export", "--job", first, "--out", str(out))
    assert exported["step"] == 4 and (out / "config.json").is_file(), exported
    text = daemons.cli("coordinator", "status", "--all", "--coordinator", address)
    assert text.returncode == 0 and queued in text.stdout and "cancelled" in text.stdout
