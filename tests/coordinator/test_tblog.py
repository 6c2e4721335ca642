"""`--tensorboard DIR`: the job's scalars as event files, read back with TensorBoard's reader."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.daemon.config import CoordinatorConfig
from dtfm.rpc import ConfigError, Security
from protos.dtfm.v1 import coordinator_pb2

accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="no tensorboard: pip install 'dtfm[tensorboard]'")


def read(directory: Path) -> dict[str, list[tuple[int, float]]]:
    acc = accumulator.EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def test_points_are_written_once_complete_and_the_job_figures_beside_them(tmp_path: Path
                                                                          ) -> None:
    from coordinator.daemon.tblog import TensorBoardLog

    history = coordinator_pb2.JobHistory(state=coordinator_pb2.JOB_STATE_RUNNING)
    for step, loss in ((1, 5.5), (2, 5.25), (3, 0.0)):  # step 3: no loss reported yet
        history.points.add(epoch=1, step=step, loss=loss, step_s=0.5, tokens_per_s=100.0,
                           unix_s=1000.0 + step)
    status = coordinator_pb2.ClusterStatus()
    status.job.job_id, status.job.epoch, status.job.predicted_step_s = "j", 1, 0.25
    status.job.recoveries.add(reason="lost")
    for pp, dp in ((1000, 0), (0, 3000)):
        a = status.agents.add()
        a.progress.job_id, a.progress.step = "j", 2
        a.progress.pp_bytes_sent, a.progress.dp_bytes_sent = pp, dp
    board = TensorBoardLog(str(tmp_path), lambda: history, lambda: (status, 0))
    assert board.write_new() == 2 and board.write_new() == 0  # the newest waits
    history.points[2].loss = 5.0
    history.state = coordinator_pb2.JOB_STATE_DONE
    board.close()
    got = read(tmp_path)
    assert got["loss/train"] == [(1, 5.5), (2, 5.25), (3, 5.0)]
    assert got["throughput/tokens_per_s"] == [(1, 100.0), (2, 100.0), (3, 100.0)]
    assert got["step_time/measured_s"][-1] == (3, 0.5)
    assert got["step_time/predicted_s"] == [(2, 0.25), (3, 0.25)]
    assert got["traffic/pipeline_bytes_per_step"][-1] == (3, 500.0)  # 1000 B over 2 steps
    assert got["traffic/data_parallel_bytes_per_step"][-1] == (3, 1500.0)
    assert got["job/recoveries"][-1] == (3, 1.0) and got["job/replans"][-1] == (3, 0.0)


def test_the_flag_is_checked_before_the_daemon_starts(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    config = CoordinatorConfig(security=Security(token="test-token-0123456789"),
                               tensorboard_dir=str(tmp_path / "file"))
    with pytest.raises(ConfigError, match="--tensorboard"):
        config.validate()
    config.tensorboard_dir = str(tmp_path / "runs")
    config.validate()
