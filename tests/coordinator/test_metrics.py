"""Prometheus metrics: the series the collectors build, the HTTP endpoint, and a real
Prometheus server scraping a real coordinator and agent."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.daemon.config import JobConfig
from coordinator.daemon.metrics import coordinator_registry
from coordinator.daemon.registry import Registry
from coordinator.job.machine import Job
from coordinator.links.measure import LinkMeasurer
from coordinator.links.store import LinkStore
from dtfm.metrics import render
from protos.dtfm.v1 import common_pb2, coordinator_pb2
from tests.daemons import Daemons, free_port, wait_for

pytestmark = pytest.mark.timeout(90)


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _cluster() -> tuple[Registry, Job, LinkStore]:
    registry = Registry(5.0)
    links = LinkStore()
    job = Job(JobConfig(model="gpt-tiny", agents=2), registry, LinkMeasurer(registry, links),
              links)
    for name in ("a", "b"):
        registry.join(common_pb2.AgentInfo(agent_id=name, host="127.0.0.1", port=9,
                                           device=common_pb2.DeviceInfo(kind="cpu")))
    registry.heartbeat(coordinator_pb2.ProgressReport(
        agent_id="a", job_id=job.job_id, epoch=1, worker_state=common_pb2.WORKER_STATE_TRAINING,
        step=7, loss=3.5, tokens_per_s=900.0, step_s=0.5, compute_s=0.3, pp_wait_s=0.15, dp_s=0.05,
        pp_bytes_sent=4096, dp_bytes_sent=512))
    links.record("a", common_pb2.LinkSample(peer_id="b", delay_ms=20.0, bandwidth_gbps=8.0,
                                            reachable=True))
    links.mark_unreachable("b", "a", "refused")
    return registry, job, links


def test_coordinator_series_read_the_live_objects() -> None:
    registry, job, links = _cluster()
    samples = _samples(generate_latest(coordinator_registry(registry, job, links)))
    jid = ("job_id", job.job_id)
    assert samples[("dtfm_cluster_agents", (("state", "alive"),))] == 2
    assert samples[("dtfm_agent_up", (("agent", "b"),))] == 1
    assert samples[("dtfm_job_state", (jid, ("model", "gpt-tiny"), ("state", "waiting")))] == 1
    assert samples[("dtfm_job_state", (jid, ("model", "gpt-tiny"), ("state", "running")))] == 0
    assert samples[("dtfm_job_restarts_total", (jid, ("model", "gpt-tiny")))] == 0
    assert samples[("dtfm_worker_step", (("agent", "a"),))] == 7
    assert samples[("dtfm_worker_loss", (("agent", "a"),))] == 3.5
    split = {part: samples[("dtfm_worker_step_seconds", (("agent", "a"), ("part", part)))]
             for part in ("total", "compute", "pipeline_wait", "data_parallel")}
    assert split == {"total": 0.5, "compute": 0.3, "pipeline_wait": 0.15, "data_parallel": 0.05}
    sent = {t: samples[("dtfm_worker_sent_bytes_total", (("agent", "a"), ("traffic", t)))]
            for t in ("pipeline", "data_parallel")}
    assert sent == {"pipeline": 4096, "data_parallel": 512}
    assert ("dtfm_worker_step", (("agent", "b"),)) not in samples  # no worker, no series
    pair = (("dst", "b"), ("src", "a"))
    assert samples[("dtfm_link_delay_seconds", pair)] == pytest.approx(0.020)
    assert samples[("dtfm_link_bandwidth_bytes_per_second", pair)] == pytest.approx(1e9)
    assert samples[("dtfm_link_reachable", (("dst", "a"), ("src", "b")))] == 0
    assert ("dtfm_link_delay_seconds", (("dst", "a"), ("src", "b"))) not in samples


def test_each_registry_is_its_own() -> None:
    first, second = coordinator_registry(*_cluster()), coordinator_registry(*_cluster())
    assert first is not second
    assert b"dtfm_cluster_agents" in generate_latest(first)


def test_endpoint_answers_metrics_and_refuses_the_rest() -> None:
    registry = coordinator_registry(*_cluster())
    ok = render(registry, b"GET /metrics HTTP/1.1")
    assert ok.startswith(b"HTTP/1.1 200 OK") and b"dtfm_job_state" in ok
    assert render(registry, b"GET /nope HTTP/1.1").startswith(b"HTTP/1.1 404")
    assert render(registry, b"POST /metrics HTTP/1.1").startswith(b"HTTP/1.1 405")
    assert render(registry, b"garbage").startswith(b"HTTP/1.1 400")
    head = render(registry, b"HEAD /metrics HTTP/1.1")
    assert head.endswith(b"\r\n\r\n") and b"Content-Length" in head


# --- a real Prometheus server ---

def _get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.read()


def _ready(url: str) -> bool:
    with contextlib.suppress(OSError):
        return _get(url) is not None
    return False


@contextlib.contextmanager
def prometheus(tmp: Path, targets: dict[str, str]) -> Iterator[str]:
    """A Prometheus server scraping `targets` (job -> HOST:PORT) every second; its URL."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the `prometheus` binary is not installed (Debian: apt-get install "
                    "prometheus); the real-scrape test needs it")
    jobs = "".join(f"  - job_name: {job}\n    static_configs:\n      - targets: ['{t}']\n"
                   for job, t in targets.items())
    config = tmp / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                      f"scrape_configs:\n{jobs}")
    address = f"127.0.0.1:{free_port()}"
    log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([binary, f"--config.file={config}",
                             f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address={address}"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://{address}"
        wait_for(lambda: proc.poll() is not None or _ready(url + "/-/ready"), 20,
                 "prometheus to be ready")
        assert proc.poll() is None, (tmp / "prometheus.log").read_text()
        yield url
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


def _query(url: str, promql: str) -> list[dict]:
    reply = json.loads(_get(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})))
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


def test_prometheus_scrapes_coordinator_and_agent(daemons: Daemons, tmp_path: Path) -> None:
    coordinator_metrics = f"127.0.0.1:{free_port()}"
    agent_metrics = f"127.0.0.1:{free_port()}"
    _, address = daemons.coordinator("--metrics-listen", coordinator_metrics, "--model",
                                     "gpt-tiny", "--agents", "1", "--steps", "10000")
    daemons.agent(address, "agent-0", "--metrics-listen", agent_metrics)
    targets = {"dtfm-coordinator": coordinator_metrics, "dtfm-agent": agent_metrics}
    with prometheus(tmp_path, targets) as url:
        alive = wait_for(lambda: _query(url, 'dtfm_cluster_agents{state="alive"} == 1'), 20,
                         "prometheus to see the agent alive")
        assert alive[0]["metric"]["job"] == "dtfm-coordinator"
        assert wait_for(lambda: _query(url, "dtfm_agent_connected == 1"), 10,
                        "prometheus to see the agent connected")
        trained = wait_for(lambda: _query(url, "dtfm_job_step > 1"), 40,
                           "prometheus to see training steps")
        assert trained[0]["metric"]["model"] == "gpt-tiny"
        assert wait_for(lambda: _query(url, 'dtfm_worker_step_seconds{part="compute"} > 0'),
                        10, "the worker's step split")
        assert wait_for(lambda: _query(url, 'dtfm_agent_worker_state{state="training"} == 1'),
                        10, "the agent's own worker state")
