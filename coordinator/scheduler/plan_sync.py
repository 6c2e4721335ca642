"""`coordinator plan --sync-every H`: the step model's price of local steps for the plan.

Owns the planner's `--sync-every` flag (the training flag of the same name: replicas sync
every H steps, `agent/worker/outer.py`) and the lines that show what it buys: the predicted
step of the planned grid and its parts, with the data-parallel exchange amortised over the
round of H steps, beside the same grid synchronous; `--sync-every auto` shows the H a job
would choose on these links (`sync_auto.choose`, within `--sync-overhead`). With `--polish`
the polish itself prices
the amortised exchange (`plan_uneven.workload` carries H), so a large H lets it favour faster
pipelines over data-parallel groups inside one city. The paper's objective, which the
evolutionary search ranks by, stays the paper's. Needs `--model`; without the flag the plan
and its output are unchanged.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from coordinator.scheduler import Network, sync_auto
from coordinator.scheduler.compute import Workload, tasklet_seconds
from coordinator.scheduler.steptime import StepTime, simulate_step
from dtfm import flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("local steps (need --model)")
    g.add_argument("--sync-every", type=flags.sync_every_setting, default=1, metavar="H|auto",
                   help="replicas sync every H steps (the training flag): price the "
                   "data-parallel exchange once per H steps; auto: the H a job would choose "
                   "on these links (default: %(default)s)")
    g.add_argument("--sync-overhead", type=flags.number(float, 0, above=True, maximum=1.0),
                   default=sync_auto.DEFAULT_OVERHEAD, metavar="FRACTION",
                   help="with --sync-every auto: the share of a step the amortised exchange "
                   "may cost (default: %(default)s)")
    flags.add_train_arg(g, "outer_delay")  # the training flag: price the overlapped exchange
    flags.add_train_arg(g, "pipeline_delay")  # ... and the pipeline flushing at sync points


def every(args: argparse.Namespace) -> int:
    """The flag's H; SYNC_AUTO (0) for auto."""
    return int(getattr(args, "sync_every", 1))


def describe(net: Network, grid: list[list[int]], work: Workload, flops: list[float],
             splits: list[int] | None, auto: bool = False,
             overhead: float = sync_auto.DEFAULT_OVERHEAD) -> dict[str, Any]:
    """The `--json` field `sync`: the grid's predicted step with local steps, and without;
    with `auto`, at the H `--sync-every auto` chooses, and why."""
    note = ""
    if auto:
        choice = sync_auto.choose(net, grid, replace(work, sync_every=1), flops, splits,
                                  steps=sync_auto.MAX_AUTO, overhead=overhead)
        work, note = replace(work, sync_every=choice.every), choice.note
    compute = tasklet_seconds(work, grid, flops, splits)
    local = simulate_step(net, grid, work.step_shape(splits), compute)
    sync = simulate_step(net, grid, replace(work, sync_every=1).step_shape(splits), compute)

    def parts(t: StepTime) -> dict[str, float]:
        return {"step_s": t.step_s, "pipeline_s": t.pipeline_s, "dp_s": t.dp_s,
                "dp_exchange_s": t.dp_exchange_s, "sync_s": t.sync_s,
                "compute_s": t.compute_s, "hidden_s": t.hidden_s}

    return {"sync": {"every": work.sync_every, "note": note, "predicted": parts(local),
                     "synchronous": parts(sync)}}


def format_lines(out: dict[str, Any]) -> list[str]:
    sync = out.get("sync")
    if not sync:
        return []
    p, s, h = sync["predicted"], sync["synchronous"], sync["every"]
    note = [f"--sync-every {sync['note']}"] if sync.get("note") else []
    if h == 1:  # auto chose synchronous training: nothing amortised to show
        return ["", *note]
    return ["", *note, f"local steps: sync every {h} steps: predicted step {p['step_s']:.3f} s = "
            f"pipeline {p['pipeline_s']:.3f} + norm exchange {p['sync_s']:.3f} + data-parallel "
            f"{p['dp_s']:.4f} (one {p['dp_exchange_s']:.3f} s exchange every {h} steps"
            + (f", {p['hidden_s']:.3f} s of it under the next round" if p.get("hidden_s") else "")
            + "); "
            f"synchronous {s['step_s']:.3f} s (data-parallel {s['dp_s']:.3f} s), "
            f"{s['step_s'] / p['step_s']:.2f}x"]
