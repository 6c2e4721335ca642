"""`--sync-every auto`: how often the replicas sync, chosen from the measured links.

Owns the rule. Fewer local steps between syncs is the more exact training: the replicas
drift apart less, and the loss per token stays closest to synchronous training's
(bench/sync.py measures it per H). So auto takes the smallest H whose data-parallel exchange,
amortised over the H steps of a round, costs at most `--sync-overhead` (default 10 %) of the
step without it, by the
step model (`scheduler.steptime.simulate_step`) on the planned grid, the measured links and
the devices' measured speed. H = 1, exact synchronous training, when
its step (whose exchange overlaps the backward pass) is already within that overhead of the
step without any exchange. H is a power of two up to MAX_AUTO (64, the largest H the
benchmark measured), and at most the job's steps. A job where even 64 misses the overhead
gets 64 and says by how much.

Without measured links (`--no-measure` and no `--links` file) the step model sees every link
alike at a made-up 1 ms and 1 Gbit/s, so any H it picked would answer links nobody measured
(it picked 16): auto then takes H = 1, exact synchronous training, which trades no loss for a
speed-up nobody can predict, and says why; give a number to train with local steps.

The job decides once, on its first plan, and keeps H for its life (recoveries, re-plans and
a restarted coordinator keep the rounds, and with them the checkpoints' sync points, where
they were); `coordinator plan --sync-every auto` shows the choice for a links file.

With `--outer-delay 1` auto takes the same H, by the waiting exchange, and predicts the step
with what the next round does not hide. A smaller H that the delay would make cheap is not
the more exact training: at 4 replicas a round late cost more validation loss at H = 4 than
waiting at H = 16 (docs/benchmarks.md, "Outer step one round late"), so H stays the loss's
choice and the delay only takes the wait away.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from coordinator.scheduler import Network
from coordinator.scheduler.compute import Workload, tasklet_seconds
from coordinator.scheduler.steptime import exposed_exchange_s, simulate_step

MAX_AUTO = 64
DEFAULT_OVERHEAD = 0.10


@dataclass(frozen=True)
class SyncChoice:
    every: int
    inner_s: float  # the predicted step without data-parallel traffic
    exchange_s: float  # one data-parallel exchange of pseudo-gradients
    step_s: float  # the predicted step with `every`
    note: str  # why, for the plan and the log


def choose(net: Network, grid: list[list[int]], work: Workload, flops: list[float],
           splits: list[int] | None, steps: int, overhead: float = DEFAULT_OVERHEAD,
           measured: bool = True) -> SyncChoice:
    """The smallest H whose amortised exchange is at most `overhead` of the inner step.
    `flops`: each device's FLOP/s (0: unknown, priced as no compute, which errs toward a
    larger H). `measured`: whether `net` holds measured links (False: H = 1, see above)."""
    compute = tasklet_seconds(work, grid, [f if f > 0 else math.inf for f in flops], splits)
    local = simulate_step(net, grid, replace(work, sync_every=2, outer_delay=0).step_shape(
        splits), compute)
    inner, exchange = local.step_s - local.dp_s, local.dp_exchange_s
    synchronous = simulate_step(net, grid, replace(work, sync_every=1).step_shape(splits),
                                compute).step_s
    budget = f"{100 * overhead:g} % of the {inner:.2f} s step without it"
    limit = min(MAX_AUTO, steps)
    why = ""
    if len(grid[0]) < 2:
        why = "one replica per stage: nothing to sync"
    elif not measured:
        why = ("no measured links to choose from (--no-measure): give --sync-every N to "
               "train with local steps")
    elif limit < 2:
        why = f"the job has {steps} step{'s' if steps != 1 else ''}"
    elif synchronous <= (1 + overhead) * inner:
        why = (f"synchronous training's exchange adds {synchronous - inner:.2f} s a step, "
               f"within {budget}")
    if why:
        return SyncChoice(1, inner, exchange, synchronous, f"auto: every step ({why})")

    def cost(every: int, delay: int) -> float:  # a step's share of what a round waits for
        return exposed_exchange_s(exchange, inner, every, delay) / every

    every = 2
    while every < limit and cost(every, 0) > overhead * inner:
        every *= 2
    every = min(every, limit)
    within = cost(every, 0) <= overhead * inner
    late = (f"; one round late, the next round hides all but {cost(every, 1):.3f} s a step"
            if work.outer_delay else "")
    note = (f"auto: every {every} steps (one {exchange:.2f} s exchange every {every} steps "
            f"adds {cost(every, 0):.3f} s a step, {'within' if within else 'over'} {budget}"
            + ("" if within else f"; {every} is the most auto takes") + late + ")")
    return SyncChoice(every, inner, exchange, inner + cost(every, work.outer_delay), note)
