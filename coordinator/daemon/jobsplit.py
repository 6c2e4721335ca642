"""How many agents each of two jobs started at once gets: the split by predicted cost.

When the queue's next jobs can all be met from the free agents (each its `--min-agents`, or
`--agents` without it), they start side by side. Each first gets the least it runs on; the
agents left over go to those that could use more (up to `--agents`), in proportion to each
job's predicted cost: the compute of one training step by the FLOP count the scheduler's
step and compute models use (`coordinator.scheduler.flops.stage_flops`, the whole model for
the global batch) times its steps. A job with twice the work gets twice the spare agents, so
two jobs started together end nearer the same time. Pure arithmetic; the daemon's scheduler
(coordinator/daemon/jobcalls.py) logs and shows the `why` of each split.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.daemon.config import JobConfig
from coordinator.scheduler.flops import stage_flops


@dataclass(frozen=True)
class Ask:
    """What one job asks of the pool: the least it runs on, the most it uses, its cost."""

    job_id: str
    need: int
    want: int
    cost: float  # predicted FLOPs of the whole job


def job_cost(config: JobConfig) -> float:
    """The job's predicted compute: one step's FLOPs (forward and backward, the whole model,
    the global batch) times its steps."""
    spec, train = config.model_spec(), config.train
    return stage_flops(spec, 0, spec.n_layers, train.global_batch * spec.seq_len,
                       train.lora_rank, train.lora_targets) * train.steps


def ask_of(job_id: str, config: JobConfig) -> Ask:
    return Ask(job_id, config.min_agents or config.agents, config.agents, job_cost(config))


def split(free: int, asks: list[Ask]) -> list[int] | None:
    """Agents for each of `asks` out of `free` (None when their needs do not all fit): each
    its `need`, the rest shared in proportion to `cost`, none past its `want`."""
    counts = [a.need for a in asks]
    left = free - sum(counts)
    if left < 0:
        return None
    while left > 0:
        open_ = [i for i, a in enumerate(asks) if counts[i] < a.want]
        if not open_:
            break
        total = sum(asks[i].cost for i in open_)
        shares = {i: left * (asks[i].cost / total if total > 0 else 1 / len(open_))
                  for i in open_}
        given = 0
        for i in sorted(open_, key=lambda i: -shares[i]):  # the costliest first: remainders
            extra = min(asks[i].want - counts[i], max(int(shares[i]), 0), left - given)
            counts[i] += extra
            given += extra
        if given == 0:  # every share rounded down: one more to the costliest that can use it
            i = max(open_, key=lambda i: shares[i])
            counts[i] += 1
            given = 1
        left -= given
    return counts


def why(asks: list[Ask], counts: list[int]) -> list[str]:
    """One line per job saying what it got and why."""
    total = sum(a.cost for a in asks) or 1.0
    return [f"{n} agent(s) of {a.want} wanted (at least {a.need}); its predicted cost "
            f"{a.cost:.3g} FLOPs is {100 * a.cost / total:.0f} % of the jobs started with it"
            for a, n in zip(asks, counts, strict=True)]
