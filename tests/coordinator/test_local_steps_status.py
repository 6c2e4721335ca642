"""Local steps in what the coordinator shows: the round, bytes per step by traffic kind and
the replicas' drift, in `coordinator status` (text and JSON) and in Prometheus."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.commands.status import status_to_json, status_to_text
from coordinator.daemon.config import JobConfig
from coordinator.daemon.metrics import coordinator_registry
from coordinator.daemon.registry import Registry
from coordinator.job.machine import Job
from coordinator.links.measure import LinkMeasurer
from coordinator.links.store import LinkStore
from protos.dtfm.v1 import common_pb2, coordinator_pb2

TRAINING = common_pb2.WORKER_STATE_TRAINING


def _report(agent: str, job_id: str, **extra: object) -> coordinator_pb2.ProgressReport:
    # resumed after step 8, now at step 12: 4 steps this epoch, one sync point of 4 MB
    return coordinator_pb2.ProgressReport(
        agent_id=agent, job_id=job_id, epoch=2, worker_state=TRAINING, step=12, loss=3.0,
        step_s=0.5, pp_bytes_sent=400_000, dp_bytes_sent=4_000_000, resumed_step=8,
        **extra)  # type: ignore[arg-type]


def test_status_and_metrics_show_the_round_bytes_per_step_and_drift() -> None:
    registry, links = Registry(5.0), LinkStore()
    job = Job(JobConfig(model="gpt-tiny", agents=2), registry, LinkMeasurer(registry, links),
              links)
    for name in ("a", "b"):
        registry.join(common_pb2.AgentInfo(agent_id=name, host="127.0.0.1", port=9,
                                           device=common_pb2.DeviceInfo(kind="cpu")))
    registry.heartbeat(_report("a", job.job_id, sync_every=4, sync_round=3, drift=0.25))
    registry.heartbeat(_report("b", job.job_id, sync_every=4, sync_round=3, drift=0.5))
    status = coordinator_pb2.ClusterStatus(job=job.status(),
                                           agents=[r.to_proto() for r in registry.all()])
    data = status_to_json(status)
    worker = data["agents"][0]["worker"]
    assert worker["dp_bytes_per_step"] == 1_000_000 and worker["pp_bytes_per_step"] == 100_000
    assert data["local_steps"] == {"every": 4, "round": 3, "dp_bytes_per_step": 2_000_000,
                                   "pp_bytes_per_step": 200_000, "drift": 0.5}
    assert ("local steps: sync every 4 steps, round 3; per step data-parallel 2 MB, pipeline "
            "0.2 MB; drift at the last sync 0.5") in status_to_text(status)

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(
                   generate_latest(coordinator_registry(registry, job, links)).decode())
               for s in family.samples}
    assert samples[("dtfm_worker_sync_round", (("agent", "a"),))] == 3
    assert samples[("dtfm_worker_drift", (("agent", "b"),))] == 0.5
    assert samples[("dtfm_worker_bytes_per_step",
                    (("agent", "a"), ("traffic", "data_parallel")))] == 1_000_000


def test_a_synchronous_job_shows_no_local_steps() -> None:
    status = coordinator_pb2.ClusterStatus(job=coordinator_pb2.JobStatus(job_id="j"))
    status.agents.add().progress.CopyFrom(_report("a", "j"))
    data = status_to_json(status)
    assert data["local_steps"] is None
    assert data["agents"][0]["worker"]["sync_every"] == 1
    assert "local steps" not in status_to_text(status)
