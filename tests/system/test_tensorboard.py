"""`coordinator start --tensorboard DIR` on a real job: TensorBoard's own reader finds the
loss, throughput and step times of the steps the coordinator saw, and the validation losses
of `--eval-every`, which the job's history, its status and the web view's JSON carry too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.coordinator.test_tblog import read
from tests.daemons import Daemons, free_port, wait_for
from tests.system.test_web_access import get, login

pytestmark = pytest.mark.timeout(400)


def test_a_job_leaves_event_files_tensorboard_reads(daemons: Daemons, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    web = f"127.0.0.1:{free_port()}"
    _, address = daemons.coordinator(
        "--tensorboard", str(runs), "--model", "gpt-tiny", "--agents", "2", "--stages", "2",
        "--replicas", "1", "--steps", "12", "--batch", "4", "--micro-batches", "2",
        "--search-seconds", "1", "--no-measure", "--eval-every", "4", "--eval-batches", "2",
        "--web", web)
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

    # validation: every 4 steps and after the last, none missed however fast the steps were
    points = json.loads(report.stdout)["points"]
    validated = [(p["step"], p["val_loss"]) for p in points if p["val_loss"] > 0]
    assert [step for step, _ in validated] == [4, 8, 12], points
    job = daemons.status(address)["job"]
    assert (job["val_step"], job["val_loss"]) == validated[-1]
    board = wait_for(lambda: len((g := read(runs)).get("loss/validation", [])) == 3 and g, 10,
                     "the validation losses to be written")
    assert [s for s, _ in board["loss/validation"]] == [s for s, _ in validated]
    # TensorBoard keeps float32
    assert [v for _, v in board["loss/validation"]] == pytest.approx([v for _, v in validated],
                                                                     rel=1e-6)
    _, cookie = login(daemons, web)
    status, _, body = get(int(web.rsplit(":", 1)[1]), "/api/view", cookie)
    assert status == 200
    view = json.loads(body)
    assert [(p["step"], p["val_loss"]) for p in view["history"]["points"]
            if p["val_loss"] > 0] == validated
    assert view["status"]["job"]["val_step"] == 12
