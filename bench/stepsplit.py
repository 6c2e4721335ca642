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

import itertools
import math
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


def by_replica(events: list[dict[str, Any]]) -> dict[int, Breakdown]:
    """`measured_split` for each replica's pipeline apart (its ranks' steps >= 2): where one
    pipeline's sync wait is the other's step difference, the wait is the faster replica
    waiting for the slower one, not the exchange."""
    replicas = sorted({e.get("replica", -1) for e in events if e.get("event") == "step"})
    return {r: measured_split([e for e in events if e.get("replica", -1) == r])
            for r in replicas if r >= 0}


def checks_share(events: list[dict[str, Any]]) -> dict[str, float] | None:
    """What the replica checks (`--verify`) cost, read inside one run from the workers' own
    timers (`StepEvent.verify_s`) rather than as two runs' tokens/s, which move by 15 % on a
    shared machine: the job's seconds in the checks over its seconds of step (every rank's
    steps >= 2), and the same for the rank that spends the most. None: no step says."""
    steps = [e for e in events if e.get("event") == "step" and e["step"] >= 2
             and isinstance(e.get("verify_s"), int | float) and math.isfinite(e["verify_s"])
             and e.get("step_s", 0) > 0]
    if not steps:
        return None
    by_rank: dict[int, list[float]] = {}
    for e in steps:
        got = by_rank.setdefault(e.get("rank", -1), [0.0, 0.0])
        got[0] += e["verify_s"]
        got[1] += e["step_s"]
    return {"share": math.fsum(e["verify_s"] for e in steps) / math.fsum(e["step_s"]
                                                                       for e in steps),
            "worst_rank_share": max(v / s for v, s in by_rank.values()),
            "verify_s_per_step": statistics.mean(e["verify_s"] for e in steps)}


def latency_floor(grid: list[list[str]], links: dict[str, Any], sync_every: int = 1,
                  outer_delay: int = 0) -> float:
    """Seconds a step spends on one-way delays whatever its codecs, with a pipeline flushed
    every step: each pipeline's activations cross its S - 1 links forward and their
    gradients cross them back (the fill and drain), and stage 0's last bucket (its
    embedding's gradient, the last that backward finishes) goes to its owner and comes back
    averaged before the optimizer can step and the next step begin. So: the slowest
    pipeline's delays both ways, plus twice the longest delay between stage 0's replicas,
    the latter once per `sync_every` steps with local steps, and not at all with the outer
    step one round late (`outer_delay`: the next round hides it). `grid`: agent ids, a row
    per stage; `links`: a links file (`delay_ms`, `agents`)."""
    at = {a: i for i, a in enumerate(links["agents"])}
    delay = links["delay_ms"]
    pipes = []
    for r in range(len(grid[0])):
        col = [at[row[r]] for row in grid]
        pipes.append(sum(delay[a][b] + delay[b][a] for a, b in itertools.pairwise(col)))
    first = [at[a] for a in grid[0]]
    dp = max((delay[a][b] for a in first for b in first if a != b), default=0.0)
    exchange = 0.0 if outer_delay and sync_every > 1 else 2 * dp / max(sync_every, 1)
    return (max(pipes, default=0.0) + exchange) / 1000


def free_prediction(events: list[dict[str, Any]], model: str, stages: int, replicas: int,
                    batch: int, micro_batches: int, sync_every: int, schedule: str = "gpipe",
                    pipeline_delay: int = 0) -> Breakdown:
    """The step model's split of this job's step (its `schedule`, flushing as
    `pipeline_delay` says) with every link free (0 ms, unbounded): each tasklet's compute
    is its rank's median measured compute (steps >= 2)."""
    compute: dict[tuple[int, int], list[float]] = {}
    for e in events:
        if e.get("event") == "step" and e["step"] >= 2:
            compute.setdefault((e["stage"], e["replica"]), []).append(e["compute_s"])
    grid = [[j * replicas + k for k in range(replicas)] for j in range(stages)]
    per_micro = [[statistics.median(compute[(j, k)]) / micro_batches for k in range(replicas)]
                 for j in range(stages)]
    n = stages * replicas
    free = Network(np.zeros((n, n)), np.full((n, n), 1e6))
    shape = step_shape(get_preset(model), stages, replicas, batch, micro_batches, schedule,
                       sync_every=sync_every, pipeline_delay=pipeline_delay)
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
           free_predicted: Breakdown, wan_replicas: dict[int, Breakdown] | None = None,
           free_replicas: dict[int, Breakdown] | None = None) -> dict[str, Any]:
    """The four splits, the lost time part by part (measured, and predicted), and the table;
    each replica's pipeline's measured split below, where given (`by_replica`)."""
    lost = wan.minus(free)
    lost_predicted = wan_predicted.minus(free_predicted) if wan_predicted else None
    rows = [("WAN, measured", wan, False), ("WAN, predicted", wan_predicted, True),
            ("network removed, measured", free, False),
            ("network removed, predicted", free_predicted, True),
            ("lost to the network, measured", lost, False),
            ("lost to the network, predicted", lost_predicted, True)]
    rows += [(f"WAN, replica {r}", b, False) for r, b in (wan_replicas or {}).items()]
    rows += [(f"network removed, replica {r}", b, False)
             for r, b in (free_replicas or {}).items()]
    text = table(rows)
    return {"wan": wan.to_json(), "wan_predicted": wan_predicted.to_json()
            if wan_predicted else None, "free": free.to_json(),
            "free_predicted": free_predicted.to_json(), "lost": lost.to_json(),
            "lost_predicted": lost_predicted.to_json() if lost_predicted else None,
            "ratio": free.step_s / wan.step_s if wan.step_s else None, "table": text}


def events_of(paths: set[Path]) -> list[dict[str, Any]]:
    from compress import progress_events  # bench/ is not a package: run from bench/

    return progress_events(paths)
