"""How a job's tasklets are placed on its agents: `coordinator start --placement`.

- `scheduled` (default): the paper's search over the measured links (`scheduler.search_plan`),
  then polished against the step model (`polished_grid`).
- `rank-order`: what a network-blind launcher does (Megatron, torchrun with a host file):
  agents in address order, stage-major, stage j = agents j*R .. j*R+R-1.
- `random[:SEED]`: one uniformly random placement (seed 0 when not given).
- a file: a plan as `coordinator plan --json` writes it, pinned. Its `grid` holds device
  indices; with an `agents` list they name agents by id (the job then waits for exactly those
  agents), without one they index the job's agents in address order.

Every placement is scored by the same cost model, so status and benchmarks compare like with
like. Owns parsing and validating the choice and turning it into a grid; no grpc, no torch.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator.scheduler import Network, plan_cost
from coordinator.scheduler.compression import Compression
from coordinator.scheduler.compute import Workload, tasklet_seconds
from coordinator.scheduler.steptime import placed_step_s, polish
from dtfm.core.words import stages_x_replicas

KINDS = ("scheduled", "rank-order", "random")


@dataclass(frozen=True)
class PinnedPlan:
    """A plan read from a file: grid[stage][replica] -> device index, optional agent ids."""

    grid: list[list[int]]
    agents: list[str] = field(default_factory=list)

    @property
    def stages(self) -> int:
        return len(self.grid)

    @property
    def replicas(self) -> int:
        return len(self.grid[0])


@dataclass(frozen=True)
class Placement:
    kind: str  # scheduled, rank-order, random or file
    seed: int = 0
    path: str = ""
    pinned: PinnedPlan | None = None

    @property
    def label(self) -> str:
        if self.kind == "random":
            return f"random:{self.seed}"
        if self.kind == "file":
            return f"file:{self.path}"
        return self.kind

    @classmethod
    def parse(cls, text: str) -> Placement:
        """`scheduled`, `rank-order`, `random[:SEED]` or the path of a plan file."""
        text = text.strip()
        if text in ("scheduled", "rank-order", "random"):
            return cls(text)
        if text.startswith("random:"):
            raw = text.removeprefix("random:")
            try:
                seed = int(raw)
            except ValueError:
                raise ValueError(f"--placement {text!r}: the seed after 'random:' must be a "
                                 f"whole number, e.g. random:3") from None
            if seed < 0:
                raise ValueError(f"--placement {text!r}: the seed must be >= 0")
            return cls("random", seed=seed)
        if not text:
            raise ValueError("--placement is empty: use scheduled, rank-order, random[:SEED] "
                             "or the path of a plan written by `coordinator plan --json`")
        return cls("file", path=text, pinned=load_plan_file(text))


def load_plan_file(path: str) -> PinnedPlan:
    """A plan written by `coordinator plan --json`, checked so that a bad file fails at start."""
    hint = "write one with `coordinator plan --links FILE --json > plan.json`"
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except OSError as e:
        raise ValueError(f"--placement {path!r}: cannot read the plan file ({e.strerror}); "
                         f"give scheduled, rank-order, random[:SEED] or a plan file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--placement {path!r} is not JSON ({e}); {hint}") from None
    grid = obj.get("grid") if isinstance(obj, dict) else None
    ok = (isinstance(grid, list) and grid and all(isinstance(r, list) and r for r in grid)
          and len({len(r) for r in grid}) == 1
          and all(isinstance(d, int) and not isinstance(d, bool) for r in grid for d in r))
    if not ok:
        raise ValueError(f"--placement {path!r} has no 'grid' of device indices "
                         f"(a list of equally long lists of integers); {hint}")
    n = len(grid) * len(grid[0])
    if sorted(d for row in grid for d in row) != list(range(n)):
        raise ValueError(f"--placement {path!r}: the grid must use each device 0..{n - 1} "
                         f"exactly once")
    agents = obj.get("agents") or []
    if agents and (not all(isinstance(a, str) and a for a in agents) or len(agents) != n
                   or len(set(agents)) != n):
        raise ValueError(f"--placement {path!r}: 'agents' must list {n} distinct agent ids, "
                         f"one per device index")
    return PinnedPlan(grid=[list(r) for r in grid], agents=list(agents))


def address_key(host: str, port: int) -> tuple[int, Any, int]:
    """Sort key for agents in address order (IPs numerically, names after them)."""
    try:
        return (0, int(ipaddress.ip_address(host)), port)
    except ValueError:
        return (1, host, port)


def rank_order_grid(stages: int, replicas: int) -> list[list[int]]:
    return np.arange(stages * replicas).reshape(stages, replicas).tolist()


def random_grid(stages: int, replicas: int, seed: int) -> list[list[int]]:
    perm = np.random.default_rng(seed).permutation(stages * replicas)
    return perm.reshape(stages, replicas).tolist()


def fixed_grid(placement: Placement, stages: int, replicas: int,
               ids: list[str]) -> list[list[int]] | None:
    """The grid of a placement that needs no search (None for `scheduled`).

    `ids` are the members in the order the grid's indices refer to.
    """
    if placement.kind == "rank-order":
        return rank_order_grid(stages, replicas)
    if placement.kind == "random":
        return random_grid(stages, replicas, placement.seed)
    if placement.kind == "file":
        pinned = placement.pinned
        assert pinned is not None
        if (pinned.stages, pinned.replicas) != (stages, replicas):
            raise ValueError(f"the pinned plan {placement.path} is "
                             f"{stages_x_replicas(pinned.stages, pinned.replicas)}, but the job "
                             f"runs {stages_x_replicas(stages, replicas)}")
        if not pinned.agents:
            return pinned.grid
        index = {a: i for i, a in enumerate(ids)}
        return [[index[pinned.agents[d]] for d in row] for row in pinned.grid]
    return None


def score(net: Network, grid: list[list[int]], dp_gb: float, pp_gb: float,
          compression: Compression | None = None) -> dict[str, float]:
    cost, dp, pp = plan_cost(net, grid, dp_gb, pp_gb, compression)
    return {"cost": cost, "dp_cost": dp, "pp_cost": pp}


POLISH_RANDOM_STARTS = 3


def polished_grid(net: Network, grid: list[list[int]], work: Workload, flops: list[float],
                  seed: int, seconds: float) -> tuple[list[list[int]], float, float]:
    """`grid` (the paper's search's answer) polished against the step model: a swap descent
    from it, from rank order and from a few random grids (`steptime.polish`; it starts from
    `grid` and keeps it unless another rates strictly faster). Returns the grid and the
    predicted step before and after. The even split's compute counts where every agent's
    FLOP/s is known (`flops`, 0: unknown)."""
    s, r = len(grid), len(grid[0])
    shape = work.step_shape(None)
    compute = None
    if flops and all(f > 0 for f in flops):
        every = [list(range(len(flops)))] * s  # each device on each stage
        compute = tasklet_seconds(work, every, flops, None).T
    starts = [grid, rank_order_grid(s, r)]
    starts += [random_grid(s, r, seed + 1 + i) for i in range(POLISH_RANDOM_STARTS)]
    before = placed_step_s(net, grid, shape, compute)
    best, after = polish(net, starts, shape, seconds, compute, seed)
    return best, before, after
