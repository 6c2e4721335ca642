"""Validation losses (`--eval-every`) on the coordinator's side: the history keeps each on the
point of the step it evaluated, thinning keeps them, the status JSON carries the newest, and
TensorBoard gets `loss/validation` even when it arrives after its step's point was written."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from coordinator.daemon.history import History, history_to_json
from coordinator.daemon.statusjson import status_to_json
from protos.dtfm.v1 import common_pb2, coordinator_pb2

TRAINING = common_pb2.WORKER_STATE_TRAINING


def report(step: int, validations: tuple[tuple[int, float], ...] = (), **kw: float
           ) -> coordinator_pb2.ProgressReport:
    return coordinator_pb2.ProgressReport(
        agent_id="a", job_id="j", epoch=1, step=step, worker_state=TRAINING,
        validations=[coordinator_pb2.Validation(step=s, loss=v) for s, v in validations],
        **kw)  # type: ignore[arg-type]


def test_the_history_keeps_each_validation_on_its_step() -> None:
    h = History()
    h.record("a", report(3, loss=5.0))
    # steps 2 and 4 were never sampled: both evaluations finished between two heartbeats
    h.record("a", report(5, ((2, 4.75), (4, 4.5)), loss=4.0))
    h.record("b", report(6, ((2, 4.75), (4, 4.5)), loss=3.9))  # the same, from another rank
    for bogus in ((9, 1.0),  # past the reporter's own step
                  (6, math.nan), (6, math.inf), (6, -1.0), (0, 1.0)):
        h.record("a", report(6, (bogus,)))
    job = coordinator_pb2.JobStatus(job_id="j", state=coordinator_pb2.JOB_STATE_RUNNING)
    points = history_to_json(h.to_proto(job, 1, 0))["points"]
    assert sorted((p["step"], p["loss"], p["val_loss"]) for p in points) == [
        (2, 0.0, 4.75), (3, 5.0, 0.0), (4, 0.0, 4.5), (5, 4.0, 0.0), (6, 3.9, 0.0)]


def test_a_heartbeat_with_too_many_or_unreal_validations_is_refused() -> None:
    from coordinator.daemon.validate import validate_progress
    from dtfm.core.limits import MAX_VALIDATIONS

    def problem(validations: tuple[tuple[int, float], ...]) -> str | None:
        r = report(9, validations, agent_secret="ab" * 32)
        r.agent_id = "agent-1"
        return validate_progress(r)

    assert problem(tuple((s, 1.0) for s in range(1, MAX_VALIDATIONS + 1))) is None
    assert "limit is 8" in (problem(tuple((s, 1.0) for s in range(MAX_VALIDATIONS + 1)))
                            or "")
    assert "finite" in (problem(((3, math.nan),)) or "")
    assert ">= 0" in (problem(((3, -2.0),)) or "")


def test_thinning_for_the_web_view_keeps_the_validation_points() -> None:
    h = History()
    for step in range(1, 5001):
        h.record("a", report(step, ((step, 2.0),) if step % 250 == 7 else (), loss=3.0,
                             step_s=1.0))
    page = h.to_proto(coordinator_pb2.JobStatus(), 1, 0, limit=400).points
    assert [p.step for p in page if p.val_loss] == list(range(7, 5001, 250))
    assert len(page) <= 400 + 20 and (page[0].step, page[-1].step) == (1, 5000)


def test_the_status_json_carries_the_newest_validation() -> None:
    status = coordinator_pb2.ClusterStatus()
    status.job.job_id = "j"
    for agent_id, epoch, val_step, val_loss in (("a", 1, 8, 4.0), ("b", 2, 4, 3.5),
                                                ("c", 2, 0, 0.0)):
        a = status.agents.add()
        a.info.agent_id = agent_id
        a.progress.job_id, a.progress.epoch = "j", epoch
        if val_step:
            a.progress.validations.add(step=val_step - 2, loss=val_loss + 1)
            a.progress.validations.add(step=val_step, loss=val_loss)
    doc = status_to_json(status)
    assert (doc["job"]["val_loss"], doc["job"]["val_step"]) == (3.5, 4)  # the newest epoch's
    assert (doc["agents"][0]["worker"]["val_loss"], doc["agents"][0]["worker"]["val_step"]
            ) == (4.0, 8)
    from coordinator.commands.status import status_to_text

    status.job.model = "gpt-tiny"
    assert "loss 0.0000  val loss 3.5000 (step 4)  0 tok/s" in status_to_text(status)
    status.job.job_id = "other"
    assert (status_to_json(status)["job"]["val_step"]) == 0


def test_tensorboard_gets_a_validation_that_arrives_late(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="no tensorboard: pip install 'dtfm[tensorboard]'")
    from coordinator.daemon.tblog import TensorBoardLog
    from tests.coordinator.test_tblog import read

    history = coordinator_pb2.JobHistory(state=coordinator_pb2.JOB_STATE_RUNNING)
    for step in (1, 2, 3):
        history.points.add(epoch=1, step=step, loss=5.0 - step, unix_s=1000.0 + step)
    board = TensorBoardLog(str(tmp_path), lambda: history,
                           lambda: (coordinator_pb2.ClusterStatus(), 0))
    assert board.write_new() == 2
    history.points[1].val_loss = 3.25  # step 2's evaluation, after its point was written
    board.write_new()
    board.write_new()  # written once
    history.state = coordinator_pb2.JOB_STATE_DONE
    history.points[2].val_loss = 2.5  # the final evaluation
    board.close()
    got = read(tmp_path)
    assert got["loss/validation"] == [(2, 3.25), (3, 2.5)]
    assert got["loss/train"] == [(1, 4.0), (2, 3.0), (3, 2.0)]


def test_the_report_plot_draws_the_validation_points(tmp_path: Path) -> None:
    from coordinator.commands.plots import plot_history
    from tests.coordinator.test_report import png_size

    def data(validated: bool) -> dict:
        points = [{"epoch": 1, "step": s, "loss": 6.0 / (1 + s / 10), "step_s": 0.5,
                   "tokens_per_s": 2000.0, "unix_s": 0.0} for s in range(1, 41)]
        for p in points if validated else []:  # an older report's JSON has no val_loss
            p["val_loss"] = 4.0 if p["step"] % 10 == 0 else 0.0
        return {"job_id": "j", "model": "gpt-tiny", "state": "done", "total_steps": 40,
                "predicted_step_s": 0.4, "restarts": 0, "points": points}

    plot_history(data(True), str(tmp_path / "with.png"))
    plot_history(data(False), str(tmp_path / "without.png"))
    assert png_size(tmp_path / "with.png") == png_size(tmp_path / "without.png")
    assert (tmp_path / "with.png").read_bytes() != (tmp_path / "without.png").read_bytes()


def test_a_late_point_takes_its_place_in_step_order() -> None:
    from coordinator.daemon.history import REORDER

    h = History()
    h.record("last", report(8, loss=4.0))
    h.record("last", report(9, ((4, 4.5), (8, 4.25)), loss=3.9))  # step 4: never sampled
    h.record("first", report(6))  # a lagging member's step
    job = coordinator_pb2.JobStatus()
    assert [p.step for p in h.to_proto(job, 1, 0).points] == [4, 6, 8, 9]
    far = History()  # a bogus step far ahead moves aside; past REORDER newer points, last
    far.record("a", report(1000))
    far.record("a", report(5))
    for step in range(10, 11 + REORDER):
        far.record("a", report(step))
    far.record("a", report(7))
    steps = [p.step for p in far.to_proto(job, 1, 0).points]
    assert steps[:3] == [5, 10, 11] and steps[-2:] == [1000, 7]
