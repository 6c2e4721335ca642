"""The job's history (`coordinator report`), both plots, and `coordinator status --watch`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator.commands.status import CLEAR_SCREEN
from coordinator.daemon.history import History, history_to_json, history_to_text
from dtfm import rpc
from protos.dtfm.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.daemons import TOKEN, Daemons

pytestmark = pytest.mark.timeout(60)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk; fails unless `path` starts like a PNG."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert head[12:16] == b"IHDR", f"{path}: first chunk is not IHDR"
    return struct.unpack(">II", head[16:24])


def _report(step: int, **kw: float | str) -> coordinator_pb2.ProgressReport:
    fields = {"agent_id": "a", "job_id": "job-1", "epoch": 1,
              "worker_state": common_pb2.WORKER_STATE_TRAINING,
              "step": step, **kw}
    return coordinator_pb2.ProgressReport(**fields)  # type: ignore[arg-type]


def test_history_keeps_one_point_per_step_with_loss_and_median_step_time() -> None:
    h = History(limit=3)
    h.record("a", _report(1, step_s=1.0))  # first stage: no loss
    h.record("b", _report(1, loss=5.0, step_s=3.0))  # last stage
    h.record("a", _report(0))  # not training yet: ignored
    # not a training report: ignored
    h.record("a", _report(2, worker_state=common_pb2.WORKER_STATE_IDLE))
    job = coordinator_pb2.JobStatus(job_id="job-1", model="gpt-tiny", total_steps=9,
                                    state=coordinator_pb2.JOB_STATE_RUNNING)
    data = history_to_json(h.to_proto(job, tokens_per_step=1000, restarts=0))
    assert [(p["step"], p["loss"], p["step_s"]) for p in data["points"]] == [(1, 5.0, 2.0)]
    assert data["points"][0]["tokens_per_s"] == 500.0 and data["state"] == "running"
    for step in range(2, 6):
        h.record("a", _report(step, loss=4.0, step_s=1.0))
    assert len(h) == 3  # bounded: the oldest went
    text = history_to_text(history_to_json(h.to_proto(job, 1000, 1)))
    assert "1 restarts" in text and "    1       5    4.0000     1.000        1000" in text


def _history_data(points: int = 40) -> dict:
    return {"job_id": "job-1", "model": "gpt-tiny", "state": "done", "total_steps": points,
            "predicted_step_s": 0.4, "restarts": 1,
            "points": [{"epoch": 1 + (s > 25), "step": s, "loss": 6.0 / (1 + s / 10),
                        "step_s": 0.5 + 0.01 * (s % 5), "tokens_per_s": 2000.0 / (1 + s % 3),
                        "unix_s": 0.0} for s in range(1, points + 1)]}


def test_history_plot_is_a_png(tmp_path: Path) -> None:
    from coordinator.commands.plots import plot_history

    path = tmp_path / "history.png"
    plot_history(_history_data(), str(path))
    width, height = png_size(path)
    assert width >= 600 and height >= 400 and path.stat().st_size > 20_000


def test_plan_plot_is_a_png(tmp_path: Path) -> None:
    path = tmp_path / "plan.png"
    out = subprocess.run([sys.executable, "-m", "coordinator", "plan", "--scenario", "world",
                          "--per-city", "1", "--stages", "4", "--replicas", "2", "--budget",
                          "50", "--plot", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "allocation" in out.stdout and f"wrote {path}" in out.stderr
    width, height = png_size(path)
    assert width > height >= 400 and path.stat().st_size > 20_000


async def _feed(address: str, job_id: str, steps: int) -> None:
    """A stand-in agent: join, then heartbeat `steps` training steps."""
    info = common_pb2.AgentInfo(agent_id="fake-0", host="127.0.0.1", port=9,
                                device=common_pb2.DeviceInfo(kind="cpu"))
    async with rpc.open_channel(address, rpc.Security(token=TOKEN)) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        stream = stub.Join(coordinator_pb2.JoinRequest(agent=info))
        secret = (await stream.read()).welcome.agent_secret
        for step in range(1, steps + 1):
            await stub.ReportProgress(coordinator_pb2.ProgressReport(
                agent_id="fake-0", job_id=job_id, epoch=0,
                worker_state=common_pb2.WORKER_STATE_TRAINING, step=step,
                loss=6.0 - step * 0.1, step_s=0.5, tokens_per_s=100.0, agent_secret=secret),
                timeout=5)
        stream.cancel()


def test_report_prints_and_plots_the_coordinators_history(daemons: Daemons,
                                                          tmp_path: Path) -> None:
    _, address = daemons.coordinator("--model", "gpt-tiny", "--agents", "2")
    empty = daemons.cli("coordinator", "report", "--coordinator", address, "--plot",
                        str(tmp_path / "none.png"))
    assert empty.returncode == 1 and "no steps recorded yet" in empty.stderr
    job_id = daemons.status(address)["job"]["id"]
    asyncio.run(_feed(address, job_id, steps=12))
    out = daemons.cli("coordinator", "report", "--coordinator", address, "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["job_id"] == job_id and [p["step"] for p in data["points"]] == list(range(1, 13))
    assert data["points"][0]["tokens_per_s"] > 0  # global batch x sequence length / 0.5 s
    assert data["points"][-1]["loss"] == pytest.approx(4.8)
    plot = tmp_path / "report.png"
    table = daemons.cli("coordinator", "report", "--coordinator", address, "--plot", str(plot))
    assert table.returncode == 0, table.stderr
    assert "s/step" in table.stdout and "     12    4.8000     0.500" in table.stdout
    assert png_size(plot)[0] >= 600 and plot.stat().st_size > 20_000


def test_status_watch_redraws_until_ctrl_c(daemons: Daemons) -> None:
    _, address = daemons.coordinator()
    proc = subprocess.Popen([sys.executable, "-m", "coordinator", "status", "--coordinator",
                             address, "--watch", "0.2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            env={**daemons.env(), "PYTHONFAULTHANDLER": "1"})
    seen = b""
    try:
        # Ctrl-C only once it has drawn twice: a fixed sleep sent it mid-import on a loaded
        # machine, where Python's own KeyboardInterrupt traceback is the right answer
        assert proc.stdout is not None
        deadline = time.monotonic() + 40
        while seen.count(CLEAR_SCREEN.encode()) < 2 and time.monotonic() < deadline:
            if not (chunk := os.read(proc.stdout.fileno(), 65536)):
                break
            seen += chunk
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        try:
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired as hung:  # where it hangs: faulthandler's stacks
            proc.send_signal(signal.SIGABRT)
            stdout, stderr = proc.communicate(timeout=10)
            raise AssertionError(f"still running 10 s after Ctrl-C: {stderr.decode()[-4000:]}"
                                 ) from hung
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    stdout = seen + stdout
    frames = stdout.decode().split(CLEAR_SCREEN)
    assert len(frames) >= 3, stdout  # at least two redraws
    assert f"coordinator {address}, every 0.2 s" in frames[-1]
    assert "agents: 0 alive of 0" in frames[-1]
    assert b"Traceback" not in stderr
