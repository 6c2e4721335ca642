"""The job's scalars as TensorBoard event files (`coordinator start --tensorboard DIR`).

Reads what `coordinator report` and `status` read (the history's points, the job's status and
its members' heartbeats), on the coordinator's loop every `EVERY_S`, and appends what is new
to an event file in DIR with the `tensorboard` package's own writer (the optional extra
`dtfm[tensorboard]`; torch's SummaryWriter wraps the same writer and would load torch into the
coordinator). Tags, by the job's step:

- `loss/train`, `throughput/tokens_per_s`, `step_time/measured_s`: each history point, once
  it is complete (a newer point exists, or the job ended): the loss comes from the last stage
  and may arrive after the first member's step time;
- `loss/validation`: each point's validation loss (`--eval-every`, and after the last step),
  as soon as it is known: an evaluation ends after its step's point was written;
- `step_time/predicted_s`, `traffic/pipeline_bytes_per_step`, `traffic/data_parallel_bytes_per_step`
  (summed over the job's workers), `job/epoch`, `job/recoveries`, `job/replans`: at the newest
  step written, as the job stands then.

A recovery resumes from a checkpoint, so steps repeat; TensorBoard shows the newer values.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from coordinator.daemon.history import traffic_per_step
from dtfm.rpc import ConfigError
from protos.dtfm.v1 import coordinator_pb2

log = logging.getLogger(__name__)

EVERY_S = 2.0
TAIL = 4096  # history points read per round: the newest (points come about one per heartbeat)
FINISHED = (coordinator_pb2.JOB_STATE_DONE, coordinator_pb2.JOB_STATE_FAILED)


def check_installed() -> None:
    """Refuse `--tensorboard` where the package is missing, before the daemon starts."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard writes TensorBoard event files with the tensorboard "
                          "package: pip install 'dtfm[tensorboard]' (or leave the flag out)")


class TensorBoardLog:
    """One event file in `directory`, appended from the coordinator's live answers."""

    def __init__(self, directory: str, history: Callable[[], coordinator_pb2.JobHistory],
                 status: Callable[[], tuple[coordinator_pb2.ClusterStatus, int]]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self._writer = EventFileWriter(directory)
        self._history = history
        self._status = status
        self._written: set[tuple[int, int]] = set()
        self._validated: set[tuple[int, int]] = set()  # points whose validation loss is written

    def _scalars(self, step: int, values: dict[str, float], wall: float) -> None:
        self._writer.add_event(self._event(wall_time=wall, step=step, summary=self._summary(
            value=[self._summary.Value(tag=t, simple_value=v) for t, v in values.items()])))

    def write_new(self) -> int:
        """Append the points completed since the last call; returns how many."""
        history = self._history()
        finished = history.state in FINISHED
        points = list(history.points) if finished else list(history.points)[:-1]
        new = [p for p in points if (p.epoch, p.step) not in self._written]
        for p in new:
            values = {"loss/train": p.loss, "throughput/tokens_per_s": p.tokens_per_s,
                      "step_time/measured_s": p.step_s}
            self._scalars(p.step, {k: v for k, v in values.items() if v > 0}, p.unix_s)
            self._written.add((p.epoch, p.step))
        if new:
            self._scalars(new[-1].step, self._job_values(), time.time())
        validated = [p for p in history.points
                     if p.val_loss > 0 and (p.epoch, p.step) not in self._validated]
        for p in validated:
            self._scalars(p.step, {"loss/validation": p.val_loss}, time.time())
            self._validated.add((p.epoch, p.step))
        if new or validated:
            self._writer.flush()
        present = {(p.epoch, p.step) for p in history.points}
        self._written &= present  # the history drops its oldest points past its limit
        self._validated &= present
        return len(new)

    def _job_values(self) -> dict[str, float]:
        status, _ = self._status()
        job = status.job
        traffic: dict[str, float] = {"pp_bytes_per_step": 0.0, "dp_bytes_per_step": 0.0}
        for a in status.agents:
            if a.progress.job_id and a.progress.job_id == job.job_id:
                per_step: dict[str, Any] = traffic_per_step(a.progress)
                for key in traffic:
                    traffic[key] += per_step[key]
        return {"step_time/predicted_s": job.predicted_step_s,
                "traffic/pipeline_bytes_per_step": traffic["pp_bytes_per_step"],
                "traffic/data_parallel_bytes_per_step": traffic["dp_bytes_per_step"],
                "job/epoch": float(job.epoch), "job/recoveries": float(len(job.recoveries)),
                "job/replans": float(len(job.replans))}

    async def run(self, every_s: float = EVERY_S) -> None:
        while True:
            try:
                self.write_new()
            except Exception:  # a full disk must not take the coordinator down
                log.exception("writing the TensorBoard events failed")
            await asyncio.sleep(every_s)

    def close(self) -> None:
        try:
            self.write_new()
        finally:
            self._writer.close()
