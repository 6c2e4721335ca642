"""`coordinator start --tensorboard DIR` on a real job: TensorBoard's own reader finds the
loss, throughput and step times of the steps the coordinator saw."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.coordinator.test_tblog import read
from tests.daemons import Daemons, wait_for

pytestmark = pytest.mark.timeout(400)


def test_a_job_leaves_event_files_tensorboard_reads(daemons: Daemons, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    _, address = daemons.coordinator(
        "--tensorboard", str(runs), "--model", "gpt-tiny", "--agents", "2", "--stages", "2",
        "--replicas", "1", "--steps", "12", "--batch", "4", "--micro-batches", "2",
        "--search-seconds", "1", "--no-measure")
    for i in range(2):
        daemons.agent(address, f"agent-{i}")
    wait_for(lambda: daemons.status(address)["job"]["state"] == "done", 300,
             "the job to finish", interval=1.0)
    report = daemons.cli("coordinator", "report", "--coordinator", address, "--json")
    assert report.returncode == 0, report.stderr
    seen = [p["step"] for p in json.loads(report.stdout)["points"] if p["loss"] > 0]
    got = wait_for(lambda: (g := read(runs)).get("loss/train", [(0, 0)])[-1][0] == seen[-1]
                   and g, 10, "the last point to be written (the job is done)")
    assert [s for s, _ in got["loss/train"]] == seen  # every step the coordinator saw
    assert all(v > 0 for _, v in got["loss/train"])
    assert all(v > 0 for _, v in got["throughput/tokens_per_s"])
    assert got["step_time/predicted_s"] and got["step_time/predicted_s"][-1][1] > 0
    assert got["traffic/pipeline_bytes_per_step"][-1][1] > 0  # two stages talk
    assert got["job/recoveries"][-1][1] == 0
