"""deploy/grafana/: the dashboard queries only series the coordinator exports, and its
installer puts it where the provider it installs tells Grafana to look."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from coordinator.daemon.config import JobConfig
from coordinator.daemon.metrics import coordinator_registry
from coordinator.daemon.registry import Registry
from coordinator.job.machine import Job
from coordinator.links.measure import LinkMeasurer
from coordinator.links.store import LinkStore
from protos.dtfm.v1 import common_pb2

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "deploy" / "grafana"


def exported() -> set[str]:
    """Every series name the coordinator's collector can serve (counters with `_total`)."""
    registry = Registry(5.0)
    links = LinkStore()
    job = Job(JobConfig(model="gpt-tiny", agents=2), registry, LinkMeasurer(registry, links),
              links)
    job.plan = common_pb2.Plan(stages=1, replicas=1)
    job.plan.grid.add().agent_ids.append("a")
    registry.join(common_pb2.AgentInfo(agent_id="a", host="127.0.0.1", port=9,
                                       device=common_pb2.DeviceInfo(kind="cpu")))
    links.record("a", common_pb2.LinkSample(peer_id="b", delay_ms=2.0, bandwidth_gbps=1.0,
                                            reachable=True))
    return {f.name + ("_total" if f.type == "counter" else "")
            for f in coordinator_registry(registry, job, links).collect()}


def test_every_query_names_an_exported_series() -> None:
    dashboard = json.loads((GRAFANA / "dtfm-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"\bdtfm_[a-z_]+", e)}
    assert used and used <= exported(), used - exported()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(set(ids)) == len(ids) and dashboard["uid"] == "dtfm-job"
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])


def test_the_installer_puts_it_where_the_provider_looks(tmp_path: Path) -> None:
    out = subprocess.run([str(GRAFANA / "install-dashboard.sh")], capture_output=True,
                         text=True, env={**os.environ, "DESTDIR": str(tmp_path)}, timeout=30)
    assert out.returncode == 0, out.stderr
    provider = (tmp_path / "etc/grafana/provisioning/dashboards/dtfm.yaml").read_text()
    folder = re.search(r"path: (\S+)", provider)
    assert folder is not None
    placed = tmp_path / folder.group(1).lstrip("/") / "dtfm-dashboard.json"
    assert json.loads(placed.read_text())["uid"] == "dtfm-job"
    assert "deploy/grafana/install-dashboard.sh" in (REPO / "deploy/install.sh").read_text()
