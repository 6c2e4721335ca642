"""Real workers' step breakdown reaches the coordinator (issue 44): a 2 x 2 gloo job with
compressed pipeline and data-parallel links trains for real (`agent local`), each rank's step
events go through the agent's supervisor into the heartbeat (`ProgressReport.breakdown`),
the coordinator accepts the report, and `coordinator status` shows the split, whose parts add
up to each worker's measured step."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent.daemon.session import CoordinatorSession
from agent.daemon.supervisor import WorkerProgress
from coordinator.commands.status import status_to_text
from coordinator.daemon.statusjson import status_to_json
from coordinator.daemon.validate import validate_progress
from dtfm.core.breakdown import Breakdown
from dtfm.core.events import parse_event
from dtfm.core.workerstate import WorkerState
from protos.dtfm.v1 import common_pb2, coordinator_pb2
from tests.agent.worker.testlib import run_local


def heartbeat(progress: WorkerProgress, agent: str) -> coordinator_pb2.ProgressReport:
    """The report the heartbeat sends (`CoordinatorSession.progress_report`) for `progress`."""
    session = SimpleNamespace(
        supervisor=SimpleNamespace(progress=progress, checkpoints=None),
        info=SimpleNamespace(agent_id=agent), secret="0" * 64, tuning=None, relay=None,
        reported_state=lambda: WorkerState.TRAINING)
    return CoordinatorSession.progress_report(session)  # type: ignore[arg-type]


@pytest.mark.timeout(90)
def test_the_breakdown_of_real_steps_arrives_in_the_report(tmp_path: Path) -> None:
    run = run_local("--model", "gpt-tiny", "--stages", "2", "--replicas", "2", "--steps", "2",
                    "--batch", "8", "--micro-batches", "2", "--eval-batches", "0",
                    "--pp-compress", "int8", "--dp-compress", "int8",
                    "--workdir", str(tmp_path), timeout=80)
    assert run.rc == 0, run.stderr[-2000:]
    agents = []
    for rank in range(4):
        progress = WorkerProgress(job_id="local")
        lines = (tmp_path / f"rank{rank}.progress.jsonl").read_text().splitlines()
        for line in lines:
            if (event := parse_event(line)) is not None:
                progress.apply(event)
        last = json.loads([x for x in lines if '"event": "step"' in x][-1])
        report = heartbeat(progress, f"a{rank}")
        assert validate_progress(report) is None
        assert report.HasField("breakdown")
        b = Breakdown.from_proto(report.breakdown)
        assert b.step_s == pytest.approx(last["step_s"])
        assert b.total() == pytest.approx(b.step_s)
        assert b.compute > 0 and b.codec > 0  # every rank compresses something
        assert 0 < last["cpu_s"] and last["codec_hidden_s"] >= 0 and last["pp_codec_s"] > 0
        assert min(b.compute, b.pipeline_wait, b.norm_wait, b.sync_wait, b.codec) >= 0
        agents.append(coordinator_pb2.AgentStatus(info=common_pb2.AgentInfo(agent_id=f"a{rank}"),
                                                  progress=report))
    status = coordinator_pb2.ClusterStatus(agents=agents,
                                           job=coordinator_pb2.JobStatus(job_id="local",
                                                                         model="gpt-tiny"))
    data = status_to_json(status)
    assert data["breakdown"]["step_s"] > 0
    assert sum(v for k, v in data["breakdown"].items() if k != "step_s") == \
        pytest.approx(data["breakdown"]["step_s"], abs=1e-5)
    assert "step split, measured (mean of the workers' last steps):" in status_to_text(status)
