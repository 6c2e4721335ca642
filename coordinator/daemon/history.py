"""The job's per-step history: loss and speed by step, as the members' heartbeats report them.

Owns what `coordinator report` shows (served by the `GetHistory` RPC). The coordinator's
ReportProgress handler feeds every accepted heartbeat here; one point per (epoch, step) keeps
the loss (from whichever member computes it: the last stage), the median of the members'
step times and the validation loss of that step's weights when a member evaluated them
(`--eval-every`, and after the last step; each with the step it evaluated, which may be
older than the heartbeat's). Heartbeats are periodic, so steps faster than the heartbeat are
sampled; a heartbeat carries its worker's newest few evaluations, so none is missed. The
store is bounded: past `limit` points the oldest are dropped.

`traffic_per_step` is a report's bytes per step by kind: `coordinator status` and the
metrics both show it, so it lives here, in the library, not in the status command.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, TypeVar

from coordinator.job.replanlog import replans_to_json, replans_to_text
from dtfm.core.workerstate import WorkerState
from protos.dtfm.v1 import coordinator_pb2

DEFAULT_LIMIT = 100_000
REORDER = 64  # newer points a late point may be put before (`History._point`)
T = TypeVar("T")


@dataclass
class _Point:
    epoch: int
    step: int
    unix_s: float
    loss: float = 0.0
    step_s: dict[str, float] = field(default_factory=dict)  # by agent id
    val_loss: float = 0.0  # 0: not evaluated

    def to_proto(self, tokens_per_step: int) -> coordinator_pb2.HistoryPoint:
        step_s = statistics.median(self.step_s.values()) if self.step_s else 0.0
        return coordinator_pb2.HistoryPoint(
            epoch=self.epoch, step=self.step, loss=self.loss, step_s=step_s,
            tokens_per_s=tokens_per_step / step_s if step_s > 0 else 0.0, unix_s=self.unix_s,
            val_loss=self.val_loss)


class History:
    """Points of one job by (epoch, step), in step order (within `REORDER` points)."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = limit
        self._points: OrderedDict[tuple[int, int], _Point] = OrderedDict()

    def __len__(self) -> int:
        return len(self._points)

    def record(self, agent_id: str, report: coordinator_pb2.ProgressReport) -> None:
        """Fold one member's heartbeat in; reports without a training step are ignored."""
        if report.step < 1 or WorkerState.from_wire(report.worker_state) not in (
                WorkerState.TRAINING, WorkerState.DONE):
            return
        point = self._point(report.epoch, report.step)
        if report.loss > 0:
            point.loss = report.loss
        if report.step_s > 0:
            point.step_s[agent_id] = report.step_s
        for v in report.validations:  # only weights it has reached; bogus values dropped
            if 1 <= v.step <= report.step and math.isfinite(v.loss) and v.loss > 0:
                self._point(report.epoch, v.step).val_loss = v.loss

    def _point(self, epoch: int, step: int) -> _Point:
        """The point of (epoch, step), made where it belongs in step order if it is new: an
        evaluation's step, or a lagging member's, may come after newer steps' points. At most
        `REORDER` newer points move aside for it (a bogus far-future step cannot make every
        insertion walk the history); past that it goes last."""
        key = (epoch, step)
        point = self._points.get(key)
        if point is None:
            newer: list[tuple[tuple[int, int], _Point]] = []
            while self._points and next(reversed(self._points)) > key:
                if len(newer) == REORDER:  # too far back: last, the others as they were
                    self._points.update(reversed(newer))
                    newer = []
                    break
                newer.append(self._points.popitem(last=True))
            point = self._points[key] = _Point(epoch, step, time.time())
            self._points.update(reversed(newer))
            while len(self._points) > self.limit:
                self._points.popitem(last=False)
        return point

    def to_proto(self, job: coordinator_pb2.JobStatus, tokens_per_step: int,
                 restarts: int, limit: int | None = None, tail: int | None = None
                 ) -> coordinator_pb2.JobHistory:
        """The history as `GetHistory` answers it; with `tail`, only the newest `tail` points;
        with `limit`, at most that many spread evenly (`thin`). Readers that poll (the web
        view, the TensorBoard log) need no 100,000 points each time: converting them all
        costs the coordinator's loop most of a second."""
        points = list(self._points.values())
        if tail is not None:
            points = points[-tail:] if tail else []
        if limit is not None:  # thinned, but the validation points are few: keep them
            kept = {id(p) for p in thin(points, limit)}
            kept |= {id(p) for p in thin([p for p in points if p.val_loss], limit)}
            points = [p for p in points if id(p) in kept]
        return coordinator_pb2.JobHistory(
            job_id=job.job_id, model=job.model, state=job.state, total_steps=job.total_steps,
            predicted_step_s=job.predicted_step_s, restarts=restarts,
            points=[p.to_proto(tokens_per_step) for p in points], replans=job.replans)


def thin(points: list[T], limit: int) -> list[T]:
    """At most `limit` of `points` spread evenly over them, the first and the newest kept."""
    if len(points) <= limit:
        return points
    if limit < 2:
        return points[-limit:] if limit else []
    stride = (len(points) - 1) / (limit - 1)
    return [points[round(i * stride)] for i in range(limit)]


def history_to_json(history: coordinator_pb2.JobHistory) -> dict[str, Any]:
    """The `coordinator report --json` shape (also what the plot reads)."""
    return {
        "job_id": history.job_id, "model": history.model,
        "state": coordinator_pb2.JobState.Name(history.state).removeprefix("JOB_STATE_").lower(),
        "total_steps": history.total_steps, "predicted_step_s": history.predicted_step_s,
        "restarts": history.restarts,
        "points": [{"epoch": p.epoch, "step": p.step, "loss": p.loss, "step_s": p.step_s,
                    "tokens_per_s": p.tokens_per_s, "unix_s": p.unix_s, "val_loss": p.val_loss}
                   for p in history.points],
        "replans": replans_to_json(history.replans),
    }


def history_to_text(data: dict[str, Any]) -> str:
    """A table: one row per recorded step."""
    head = (f"job {data['job_id'] or '-'} ({data['model'] or 'no model'}): {data['state']}, "
            f"{len(data['points'])} steps recorded of {data['total_steps']}, "
            f"{data['restarts']} restarts")
    if data["predicted_step_s"]:
        head += f", predicted {data['predicted_step_s']:.3f} s/step"
    lines = [head, f"{'epoch':>5} {'step':>7} {'loss':>9} {'s/step':>9} {'tok/s':>11} "
                   f"{'val loss':>9}"]
    for p in data["points"]:
        loss = f"{p['loss']:.4f}" if p["loss"] else "-"
        step_s = f"{p['step_s']:.3f}" if p["step_s"] else "-"
        tokens = f"{p['tokens_per_s']:.0f}" if p["tokens_per_s"] else "-"
        val = f"{p['val_loss']:.4f}" if p.get("val_loss") else "-"
        lines.append(f"{p['epoch']:>5} {p['step']:>7} {loss:>9} {step_s:>9} {tokens:>11} "
                     f"{val:>9}")
    replans = data.get("replans", [])
    lines.extend(replans_to_text(replans, last=len(replans)))
    return "\n".join(lines)


def traffic_per_step(p: coordinator_pb2.ProgressReport) -> dict[str, Any]:
    """A worker's bytes per step by traffic kind over this epoch's steps so far, and its
    local-steps round and drift (`--sync-every`)."""
    done = p.step - (p.resumed_step if p.HasField("resumed_step") else 0)
    return {"pp_bytes_per_step": p.pp_bytes_sent / done if done > 0 else 0.0,
            "dp_bytes_per_step": p.dp_bytes_sent / done if done > 0 else 0.0,
            "sync_every": max(p.sync_every, 1), "sync_round": p.sync_round, "drift": p.drift}
