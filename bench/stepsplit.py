"""Where the step goes, measured and predicted side by side (issue 44), for `bench/sync.py`.

The measured split of a job is the mean over its ranks and its steps >= 2 of each step
event's breakdown (`dtfm.core.breakdown.measured`: the parts add up to the mean step). The
predicted one is the coordinator's (`coordinator.scheduler.steptime.step_breakdown`, refreshed
with the compute its workers measured), or, for a job no coordinator planned (the loopback
ceiling, `agent local`), the step model replayed here on a network of free links with that
job's own measured compute: what the model says a network-free step costs. The lost time is
the WAN job's split less the network-free job's, part by part.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.scheduler.network import Network
from coordinator.scheduler.steptime import step_breakdown, step_shape
from dtfm.core.breakdown import MEASURED, PREDICTED, Breakdown, mean, measured
from dtfm.core.presets import get_preset

COLUMNS = ("compute", "pipeline_wait", "transfer", "latency_bubble", "norm_wait", "sync_wait",
           "codec", "other")
HEAD = {"compute": "compute", "pipeline_wait": "pp wait", "transfer": "transfer",
        "latency_bubble": "lat+bub", "norm_wait": "norm", "sync_wait": "sync", "codec": "codec",
        "other": "other"}


def measured_split(events: list[dict[str, Any]]) -> Breakdown:
    """The mean breakdown of the steps >= 2 of every rank (the first holds the start-up)."""
    return mean(measured(e) for e in events if e.get("event") == "step" and e["step"] >= 2)


def free_prediction(events: list[dict[str, Any]], model: str, stages: int, replicas: int,
                    batch: int, micro_batches: int, sync_every: int) -> Breakdown:
    """The step model's split of this job's step with every link free (0 ms, unbounded):
    each tasklet's compute is its rank's median measured compute (steps >= 2)."""
    compute: dict[tuple[int, int], list[float]] = {}
    for e in events:
        if e.get("event") == "step" and e["step"] >= 2:
            compute.setdefault((e["stage"], e["replica"]), []).append(e["compute_s"])
    grid = [[j * replicas + k for k in range(replicas)] for j in range(stages)]
    per_micro = [[statistics.median(compute[(j, k)]) / micro_batches for k in range(replicas)]
                 for j in range(stages)]
    n = stages * replicas
    free = Network(np.zeros((n, n)), np.full((n, n), 1e6))
    shape = step_shape(get_preset(model), stages, replicas, batch, micro_batches,
                       sync_every=sync_every)
    return step_breakdown(free, grid, shape, per_micro)


def cores_bound(events: list[dict[str, Any]], cores: int) -> float | None:
    """The least step the job's CPU time allows when every rank shares this machine's `cores`:
    the mean over steps >= 2 of the ranks' summed CPU seconds (`cpu_s`) over the cores. The
    step model prices each device as a processor of its own; here they are not."""
    per_step: dict[int, float] = {}
    for e in events:
        if e.get("event") == "step" and e["step"] >= 2 and isinstance(e.get("cpu_s"), float):
            per_step[e["step"]] = per_step.get(e["step"], 0.0) + e["cpu_s"]
    return statistics.fmean(per_step.values()) / cores if per_step else None


def _cells(b: Breakdown | None, names: tuple[str, ...]) -> str:
    return "".join(f"{getattr(b, c):>9.3f}" if b is not None and c in names else f"{'-':>9}"
                   for c in COLUMNS)


def table(rows: list[tuple[str, Breakdown | None, bool]]) -> str:
    """One line per (label, split, predicted?): the step, then each part (`-`: a part that
    kind of split does not have)."""
    lines = [f"{'':<34}{'step s':>8}" + "".join(f"{HEAD[c]:>9}" for c in COLUMNS)]
    for label, b, predicted in rows:
        names = PREDICTED if predicted else MEASURED
        step = f"{b.step_s:>8.3f}" if b is not None else f"{'-':>8}"
        lines.append(f"{label:<34}{step}{_cells(b, names)}")
    return "\n".join(lines)


def report(wan: Breakdown, wan_predicted: Breakdown | None, free: Breakdown,
           free_predicted: Breakdown) -> dict[str, Any]:
    """The four splits, the lost time part by part (measured, and predicted), and the table."""
    lost = wan.minus(free)
    lost_predicted = wan_predicted.minus(free_predicted) if wan_predicted else None
    text = table([("WAN, measured", wan, False), ("WAN, predicted", wan_predicted, True),
                  ("network removed, measured", free, False),
                  ("network removed, predicted", free_predicted, True),
                  ("lost to the network, measured", lost, False),
                  ("lost to the network, predicted", lost_predicted, True)])
    return {"wan": wan.to_json(), "wan_predicted": wan_predicted.to_json()
            if wan_predicted else None, "free": free.to_json(),
            "free_predicted": free_predicted.to_json(), "lost": lost.to_json(),
            "lost_predicted": lost_predicted.to_json() if lost_predicted else None,
            "ratio": free.step_s / wan.step_s if wan.step_s else None, "table": text}


def events_of(paths: set[Path]) -> list[dict[str, Any]]:
    from compress import progress_events  # bench/ is not a package: run from bench/

    return progress_events(paths)
