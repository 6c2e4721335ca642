"""Benchmark: the paper's claim, measured. Scheduled placement against network-blind ones,
training the same model for the same steps across emulated hosts of the world-wide WAN.

N agents, `--per-city` in each of the paper's 8 cities, each in its own network namespace
with the paper's one-way delays and its bandwidths scaled to Mbit/s (`--scale` Mbit/s per
Gbit/s, so that a CPU model is communication-bound and one machine carries every link). The
links are measured once by the agents (as a deployment does), then one job per placement runs
on that same matrix (`coordinator start --links`): `scheduled`, `rank-order` and `random:SEED`
for each seed. For each the table shows the cost model's objective, the predicted step time
(link terms plus each worker's measured compute), the measured step time (median of steady
steps), tokens/s, and the ratios to scheduled; then, per placement, the time from the
assignment to the first step and its median split over the workers (`bench/startup.py`).
Writes bench/results/wan.json.

Needs root (network namespaces). Run: `python bench/wan.py` (16 agents, about 15 minutes).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python bench/wan.py`
    sys.path.insert(0, str(REPO))

from bench.startup import breakdown  # noqa: E402
from bench.startup import summarize as startup_summary  # noqa: E402
from bench.startup import table as startup_table  # noqa: E402
from coordinator.scheduler.scenarios import world_links  # noqa: E402
from dtfm.wan import WanEmulator  # noqa: E402
from dtfm.wan.cluster import WanCluster, measurement_wan  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "wan.json"


def add_world_arguments(p: argparse.ArgumentParser, *, per_city: int, steps: int, batch: int,
                        steps_help: str = "", batch_help: str = "") -> None:
    """The flags every benchmark on the emulated world shares: its size, the job's shape."""
    p.add_argument("--per-city", type=int, default=per_city, help="agents per city (8 cities)")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--model", default="gpt-mini")
    p.add_argument("--steps", type=int, default=steps, help=steps_help or None)
    p.add_argument("--batch", type=int, default=batch, help=batch_help or None)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--scale", type=float, default=25.0, help="emulated Mbit/s per Gbit/s")


def emulator_missing() -> bool:
    """True, having said why on stderr, when this machine cannot emulate a WAN (root and
    network namespaces): the benchmarks on the emulated world then exit 2."""
    ok, why = WanEmulator.available()
    if not ok:
        print(f"cannot emulate a WAN here: {why}", file=sys.stderr)
    return not ok


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_world_arguments(p, per_city=2, steps=8, batch=16)
    p.add_argument("--seeds", default="1,2,3", help="random placements to run")
    p.add_argument("--placements", default="",
                   help="comma-separated placements instead of scheduled, rank-order, randoms")
    p.add_argument("--timeout", type=float, default=900.0, help="per job, seconds")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--workdir", default="", help="keep the daemons' logs here")
    return p.parse_args(argv)


def run_job(cluster: WanCluster, args: argparse.Namespace, placement: str,
            links: Path, extra: Sequence[str] = (), label: str = "") -> dict[str, Any]:
    """Train one job under `placement` (plus `extra` job flags); return what the
    coordinator reported. `label` names the job in progress lines (default: placement)."""
    agents = cluster.agents
    job_args = ["--model", args.model, "--agents", str(agents), "--stages", str(args.stages),
                "--replicas", str(agents // args.stages), "--steps", str(args.steps),
                "--batch", str(args.batch), "--micro-batches", str(args.micro_batches),
                "--search-seconds", "10", "--layer-split", "even", *extra]

    def watch(status: dict[str, Any], now: float) -> None:
        job = status["job"]
        print(f"  [{label or placement}] {now:6.0f}s {job['state']:<10} step {job['step']:>3}/"
              f"{job['total_steps']} loss {job['loss']:.3f} measured "
              f"{job['measured_step_s']:.2f} s/step", file=sys.stderr, flush=True)

    return cluster.train(job_args, placement, links, args.timeout, watch,
                         prewarm=False)  # steady steps: no spares importing beside them


@contextmanager
def measured_world(per_city: int, scale: float, workdir: str = "", *, nat: Sequence[int] = (),
                   shared_nat: Sequence[Sequence[int]] = (),
                   coordinator_link: tuple[float, float | None] = (0.0, None),
                   coordinator_args: Sequence[str] = ()
                   ) -> Iterator[tuple[WanCluster, Path, dict[str, str]]]:
    """The emulated world-wide WAN with `per_city` agents per city, its links measured once by
    the agents (as a deployment does) and written to a links file; yields (cluster, links
    file, each agent id's city). Jobs then run on that matrix with `run_job`. `nat` and
    `shared_nat` put agents (by number) behind NAT routers, `coordinator_link` gives the
    coordinator's host (and the relay it hosts) a delay and rate to everyone
    (`measurement_wan`); `coordinator_args` start the coordinator that measures (e.g.
    `--hole-punch off`: pairs nobody can dial are priced relayed, not punch-probed)."""
    delay, bandwidth, cities = world_links(per_city, scale)
    n = len(delay)
    with tempfile.TemporaryDirectory(prefix="dtfm-bench-wan-") as scratch, \
            measurement_wan(delay, bandwidth, nat=nat, shared_nat=shared_nat,
                            coordinator_link=coordinator_link) as wan:
        root = Path(workdir or scratch)
        cluster = WanCluster(wan, root, agents=n, coordinator_args=coordinator_args)
        ids = cluster.start(prewarm=False)  # measuring only
        print(f"{n} agents joined; measuring {n * (n - 1)} links ...", file=sys.stderr)
        t0 = time.monotonic()
        links = cluster.measure()
        print(f"measured in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        cluster.stop()
        links_path = root / "links.json"
        links_path.write_text(json.dumps(links))
        yield cluster, links_path, {agent: cities[i] for i, agent in enumerate(ids)}


def table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]
    head = (f"{'placement':<12}{'cost':>8}{'pred s':>8}{'meas s':>8}{'err %':>7}{'tok/s':>8}"
            f"{'pred x':>8}{'meas x':>8}  split (compute / pipeline wait / dp)")
    lines = [head]
    for r in rows:
        err = 100 * (r["predicted_step_s"] - r["measured_step_s"]) / r["measured_step_s"]
        s = r["worker_split_median"]
        lines.append(
            f"{r['placement']:<12}{r['cost']:>8.2f}{r['predicted_step_s']:>8.2f}"
            f"{r['measured_step_s']:>8.2f}{err:>7.1f}{r['tokens_per_s']:>8.0f}"
            f"{r['predicted_step_s'] / base['predicted_step_s']:>8.2f}"
            f"{r['measured_step_s'] / base['measured_step_s']:>8.2f}  "
            f"{s.get('compute_s', 0):.2f} / {s.get('pp_wait_s', 0):.2f} / {s.get('dp_s', 0):.2f}")
    return "\n".join(lines)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Speed-ups of scheduled over rank-order and the median random placement."""
    by = {r["placement"]: r for r in rows}
    sched = by.get("scheduled")
    randoms = [r for r in rows if r["placement"].startswith("random")]
    out: dict[str, Any] = {}
    if sched is None:
        return out
    for name, other in (("rank_order", by.get("rank-order")),
                        ("median_random", _median_row(randoms))):
        if other is None:
            continue
        out[name] = {
            "measured_speedup": other["measured_step_s"] / sched["measured_step_s"],
            "predicted_speedup": other["predicted_step_s"] / sched["predicted_step_s"],
            "cost_ratio": other["cost"] / sched["cost"],
        }
        m = out[name]
        m["measured_over_predicted"] = m["measured_speedup"] / m["predicted_speedup"]
    return out


def _median_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not rows:
        return None
    ranked = sorted(rows, key=lambda r: r["measured_step_s"])
    return ranked[len(ranked) // 2]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if emulator_missing():
        return 2
    placements = ([p for p in args.placements.split(",") if p] if args.placements else
                  ["scheduled", "rank-order", *(f"random:{s}" for s in args.seeds.split(","))])
    rows = []
    with measured_world(args.per_city, args.scale, args.workdir) as (cluster, links_path,
                                                                     city_of):
        n = cluster.agents
        for placement in placements:
            row = run_job(cluster, args, placement, links_path)
            row["grid_cities"] = [[city_of[a] for a in r] for r in row["grid"] or []]
            # each job restarts the agents, whose logs then hold only this job's start-up
            row["startup"] = startup_summary(breakdown(cluster.workdir))
            rows.append(row)
    print(table(rows))
    for r in rows:
        print(f"{r['placement']}: assignment -> first step {r['assignment_to_first_step_s']} s "
              f"(coordinator's view); per worker:\n{startup_table(r['startup'])}")
    summary = summarize(rows)
    for name, m in summary.items():
        print(f"scheduled vs {name}: measured {m['measured_speedup']:.2f}x, predicted "
              f"{m['predicted_speedup']:.2f}x (measured / predicted "
              f"{m['measured_over_predicted']:.2f}), paper cost ratio {m['cost_ratio']:.2f}x")
    out = {"config": {k: v for k, v in vars(args).items() if k not in ("out", "workdir")},
           "agents": n, "rows": rows, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
