"""Benchmark of the scheduler on the paper's scenarios (PAPER.md), one process, one core.

Prints a table and writes `bench/results/scheduler.json`. Per scenario (8 stages x 8
replicas, c_DP = 0.65 GB, c_PP = 0.471 GB): ours for --seconds (default 10) with the paper's
gain, ours with a plain Kernighan-Lin gain, best of --random random allocations, rank order,
the published scheduler's numbers, and a convergence check: ours again with --long-factor
(default 30) times the candidates the timed run evaluated. Then a scaling row: the world
scenario with 32 and 128 devices per city (256 and 1,024 devices; heuristic TSP).

    .venv/bin/python bench/scheduler.py                 # everything (about 30 minutes)
    .venv/bin/python bench/scheduler.py --long-factor 0 --no-scaling   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.scheduler import scenarios, search_plan
from coordinator.scheduler.baselines import random_best, rank_order
from coordinator.scheduler.costmodel import CostModel

PUBLISHED = {"dc-ondemand": 3.44, "multi-dc": 16.09, "regional": 34.80, "world": 49.22}
PUBLISHED_RANDOM = {"dc-ondemand": 19.80, "multi-dc": 43.23, "regional": 58.61, "world": 137.45}
DP, PP = scenarios.PAPER_DP_GB, scenarios.PAPER_PP_GB
OUT = Path(__file__).resolve().parent / "results" / "scheduler.json"


def _pin_one_core(core: int | None) -> None:
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        try:
            os.sched_setaffinity(0, {cores[0] if core is None else core})
        except (OSError, IndexError):
            pass


def scenario_row(name: str, seconds: float, random_k: int, long_factor: int) -> dict[str, Any]:
    net = scenarios.get_scenario(name)
    model = CostModel(net, 8, 8, DP, PP)
    ours = search_plan(net, 8, 8, DP, PP, seed=0, seconds=seconds)
    kl = search_plan(net, 8, 8, DP, PP, seed=0, seconds=seconds, gain="kl")
    t = time.perf_counter()
    rnd = random_best(model, random_k, np.random.default_rng(1))
    rnd_s = time.perf_counter() - t
    row: dict[str, Any] = {
        "scenario": name,
        "ours": ours.cost,
        "ours_dp": ours.dp_cost,
        "ours_pp": ours.pp_cost,
        "ours_seconds": ours.seconds,
        "ours_evaluated": ours.evaluated,
        "ours_structured_seed": ours.structured_cost,
        "ours_grid": ours.grid,
        "kl": kl.cost,
        "kl_seconds": kl.seconds,
        "kl_evaluated": kl.evaluated,
        "random": rnd.cost,
        "random_k": random_k,
        "random_seconds": rnd_s,
        "rank_order": rank_order(model).cost,
        "published": PUBLISHED.get(name),
        "published_random": PUBLISHED_RANDOM.get(name),
    }
    if long_factor > 0:
        budget = long_factor * ours.evaluated
        long = search_plan(net, 8, 8, DP, PP, seed=1, budget=budget)
        row.update(
            long=long.cost, long_budget=budget, long_seconds=long.seconds,
            within_1pct=ours.cost <= long.cost * 1.01,
        )
    return row


def scaling_row(per_city: int, seconds: float, random_k: int) -> dict[str, Any]:
    net = scenarios.world(per_city)
    s = r = int(round(np.sqrt(net.size)))
    model = CostModel(net, s, r, DP, PP)
    t = time.perf_counter()
    rnd = random_best(model, random_k, np.random.default_rng(1))
    rnd_s = time.perf_counter() - t
    res = search_plan(net, s, r, DP, PP, seed=0, seconds=seconds)
    return {
        "scenario": f"world x{per_city}",
        "devices": net.size,
        "stages": s,
        "replicas": r,
        "ours": res.cost,
        "ours_seconds": res.seconds,
        "ours_evaluated": res.evaluated,
        "tsp_exact": res.tsp_exact,
        "ours_structured_seed": res.structured_cost,
        "random": rnd.cost,
        "random_k": random_k,
        "random_seconds": rnd_s,
        "rank_order": rank_order(model).cost,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--random", type=int, default=5000)
    p.add_argument("--long-factor", type=int, default=30)
    p.add_argument("--scenarios", nargs="*", default=list(scenarios.SCENARIOS))
    p.add_argument("--no-scaling", action="store_true")
    p.add_argument("--scaling-seconds", type=float, default=100.0)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--core", type=int, default=None, help="CPU core to pin to (first)")
    args = p.parse_args()
    _pin_one_core(args.core)
    rows = []
    head = (
        f"{'scenario':<12}{'ours':>8}{'ours-KL':>9}{'random':>9}{'rank':>8}{'paper':>8}"
        f"{'30x':>8}{'<=1%':>6}{'s(ours)':>9}{'cands':>7}"
    )
    print(head, flush=True)
    for name in args.scenarios:
        row = scenario_row(name, args.seconds, args.random, args.long_factor)
        rows.append(row)
        pub = f"{row['published']:.2f}" if row["published"] else "-"
        lng = f"{row['long']:.2f}" if "long" in row else "-"
        ok = ("yes" if row["within_1pct"] else "NO") if "long" in row else "-"
        print(
            f"{name:<12}{row['ours']:>8.2f}{row['kl']:>9.2f}{row['random']:>9.2f}"
            f"{row['rank_order']:>8.2f}{pub:>8}{lng:>8}{ok:>6}{row['ours_seconds']:>9.1f}"
            f"{row['ours_evaluated']:>7}",
            flush=True,
        )
    scaling = []
    if not args.no_scaling:
        print(f"\n{'scaling':<12}{'devices':>8}{'shape':>7}{'ours':>9}{'random':>9}{'rank':>9}"
              f"{'seconds':>9}{'cands':>7}{'TSP':>10}", flush=True)
        for per_city in (32, 128):
            row = scaling_row(per_city, args.scaling_seconds, 20)
            scaling.append(row)
            print(
                f"{row['scenario']:<12}{row['devices']:>8}{row['stages']:>4}x{row['replicas']:<2}"
                f"{row['ours']:>9.2f}{row['random']:>9.2f}{row['rank_order']:>9.2f}"
                f"{row['ours_seconds']:>9.1f}{row['ours_evaluated']:>7}"
                f"{'exact' if row['tsp_exact'] else 'heuristic':>10}",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "settings": {
            "dp_gb": DP, "pp_gb": PP, "stages": 8, "replicas": 8, "seconds": args.seconds,
            "random": args.random, "long_factor": args.long_factor,
            "scaling_seconds": args.scaling_seconds,
        },
        "machine": {"python": platform.python_version(), "cpu": platform.processor(),
                    "cores_used": 1},
        "scenarios": rows,
        "scaling": scaling,
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
