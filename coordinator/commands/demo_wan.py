"""`coordinator demo --wan world`: the demo across an emulated world-wide WAN.

One network namespace per agent, `--per-city` agents in each of the paper's 8 cities, links
with the paper's one-way delays and scaled bandwidths. The agents measure their links once;
then the same job trains twice on that matrix, first with the scheduler's placement, then
with the network-blind rank order a launcher would use, and the demo prints the plan as a
stage x replica table of cities and the measured speed-up. Needs root (namespaces).

`--nat N` puts N agents behind emulated NAT routers (`nat_agents` says which): they accept no
inbound connection, so their peers reach them through the data plane's dial-out and relay
paths, and the table marks them "(nat)".
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from coordinator.job.prediction import prediction_gap
from dtfm import flags
from dtfm.progressline import ProgressLine


def city_table(grid: list[list[str]], city_of: dict[str, str]) -> str:
    """The plan as people read it: one row per stage, one column per pipeline."""
    cells = [[city_of.get(a, a) for a in row] for row in grid]
    width = max(len(c) for row in cells for c in row)
    head = "         " + " ".join(f"{'pipeline ' + str(k):<{width}}" for k in range(len(grid[0])))
    return "\n".join([head] + [f"stage {j:<2} " + " ".join(f"{c:<{width}}" for c in row)
                               for j, row in enumerate(cells)])


def run_wan(args: argparse.Namespace) -> int:
    from dtfm.wan import WanEmulator

    ok, why = WanEmulator.available()
    if not ok:
        return flags.fail(f"--wan needs network namespaces, which this machine refuses: "
                            f"{why} (run as root, or drop --wan for the loopback demo)")
    if args.agents % args.stages:
        return flags.fail(f"--stages {args.stages} does not divide the {args.agents} agents "
                            f"(8 cities x {args.per_city})")
    if not 0 <= args.nat <= args.agents:
        return flags.fail(f"--nat {args.nat}: the demo has {args.agents} agents "
                          f"(8 cities x {args.per_city}); give 0 to {args.agents}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dtfm-demo-wan-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        code = _run(args, workdir)
    except (RuntimeError, TimeoutError) as exc:
        return flags.fail(f"{exc}; logs in {workdir}", 1)
    if code == 0 and not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return code


def _say(args: argparse.Namespace, text: str, **data: Any) -> None:
    print(json.dumps({"event": text, **data}) if args.json else text, flush=True)


def _run(args: argparse.Namespace, workdir: Path) -> int:
    from coordinator.scheduler.scenarios import nat_agents, world_links
    from dtfm.wan.cluster import WanCluster, measurement_wan

    delay, bandwidth, cities = world_links(args.per_city, args.scale)
    n = len(delay)
    alone, shared = nat_agents(cities, args.nat)
    behind = set(alone).union(*shared)
    with measurement_wan(delay, bandwidth, nat=alone, shared_nat=shared) as wan:
        cluster = WanCluster(wan, workdir, agents=n)
        ids = cluster.start(prewarm=False)  # measuring only
        city_of = {agent: cities[i] + ("(nat)" if i in behind else "")
                   for i, agent in enumerate(ids)}
        nat_line = (f", {len(behind)} behind NAT routers "
                    f"({', '.join(city_of[ids[i]] for i in sorted(behind))})" if behind else "")
        _say(args, f"demo: {n} agents in {len(set(cities))} emulated cities{nat_line}; "
                   f"measuring {n * (n - 1)} links ...")
        t0 = time.monotonic()
        links = cluster.measure()
        cluster.stop()
        links_path = workdir / "links.json"
        links_path.write_text(json.dumps(links))
        _say(args, f"demo: links measured in {time.monotonic() - t0:.0f} s")
        job_args = ["--model", args.model, "--agents", str(n), "--stages", str(args.stages),
                    "--replicas", str(n // args.stages), "--steps", str(args.steps),
                    "--batch", str(args.batch), "--micro-batches", str(args.micro_batches),
                    "--search-seconds", "5", "--layer-split", "even"]
        results: dict[str, dict[str, Any]] = {}
        failed: dict[str, str] = {}
        for placement in PLACEMENTS:  # one run failing does not hide the other's result
            try:
                results[placement] = _train(cluster, args, job_args, placement, links_path,
                                            city_of)
            except (RuntimeError, TimeoutError) as exc:
                failed[placement] = str(exc).removeprefix(f"{placement}: ")
    lines, data = outcome(results, failed)
    for i, line in enumerate(lines):  # the last line carries the data, as one JSON event
        _say(args, line, **(data if i == len(lines) - 1 else {}))
    if failed:
        return flags.fail(failure_text(results, failed), 1)
    return 0


PLACEMENTS = ("scheduled", "rank-order")


def run_line(placement: str, r: dict[str, Any]) -> str:
    """One run's result: its measured step against the plan's prediction, and why they differ
    where they are far apart (`prediction_gap`)."""
    line = (f"demo: {placement} run: {r['measured_step_s']:.2f} s/step "
            f"({r['tokens_per_s']:.0f} tok/s), loss {r['loss']:.4f}; the plan predicted "
            f"{r['predicted_step_s']:.2f} s a step")
    # the prediction beyond communication is compute; the workers measured theirs if they
    # reported a split of their steps
    compute = max(0.0, r["predicted_step_s"] - (r.get("predicted_comm_s") or 0.0))
    measured = bool((r.get("worker_split_median") or {}).get("compute_s"))
    gap = prediction_gap(r["predicted_step_s"], r["measured_step_s"], compute, measured)
    line = f"{line}; {gap}" if gap else line
    if recovered := r.get("recoveries"):
        line += (f"; it recovered from {len(recovered)} fault(s) on the way, which its time "
                 "includes (" + "; ".join(x["reason"] for x in recovered) + ")")
    return line


def failure_text(results: dict[str, Any], failed: dict[str, str]) -> str:
    """The demo's last word when a run failed: which, why (its logs named there), and that
    the result of the one that finished stands above."""
    return ("; ".join(f"the {p} run failed: {why}" for p, why in failed.items())
            + (f" (the {', '.join(results)} run's result is printed above)" if results else ""))


def outcome(results: dict[str, dict[str, Any]],
            failed: dict[str, str]) -> tuple[list[str], dict[str, Any]]:
    """The lines the demo ends with (each finished run's result, then the comparison when
    both finished) and the data its JSON carries; `failed`: placement -> why it failed."""
    lines = [run_line(p, results[p]) for p in PLACEMENTS if p in results]
    data: dict[str, Any] = {"runs": results, "failed": failed}
    if failed or len(results) < len(PLACEMENTS):
        return lines, data
    fast, blind = results["scheduled"], results["rank-order"]
    speedup = blind["measured_step_s"] / fast["measured_step_s"]
    predicted = blind["predicted_step_s"] / fast["predicted_step_s"]
    lines.append(f"demo: scheduled {fast['measured_step_s']:.2f} s/step "
                 f"({fast['tokens_per_s']:.0f} tok/s), network-blind rank order "
                 f"{blind['measured_step_s']:.2f} s/step ({blind['tokens_per_s']:.0f} tok/s): "
                 f"the scheduler's placement trains {speedup:.2f}x faster "
                 f"(the cost model predicted {predicted:.2f}x)")
    return lines, {**data, "speedup": speedup, "predicted_speedup": predicted}


def _train(cluster: Any, args: argparse.Namespace, job_args: list[str], placement: str,
           links: Path, city_of: dict[str, str]) -> dict[str, Any]:
    shown = {"plan": False}
    progress = ProgressLine(sys.stdout)  # in place on a terminal, sparse into a file

    def watch(status: dict[str, Any], now: float) -> None:
        job, plan = status["job"], status["plan"]
        if plan and not shown["plan"]:
            shown["plan"] = True
            progress.finish()
            _say(args, f"\n{placement} placement: cost {plan['cost']:.2f} s; "
                       + plan_prediction(plan) + "\n" + city_table(plan["grid"], city_of),
                 grid=plan["grid"])
        eta = ""
        if job["step"] >= 1 and job["measured_step_s"]:
            eta = f"  ETA {(job['total_steps'] - job['step']) * job['measured_step_s']:.0f}s"
        line = (f"[{placement}] {job['state']:<9} step {job['step']}/{job['total_steps']}  "
                f"loss {job['loss']:.4f}  {job['tokens_per_s']:.0f} tok/s  "
                f"{job['measured_step_s']:.2f} s/step"
                + (f" (plan {job['predicted_step_s']:.2f})" if job["predicted_step_s"] else "")
                + eta)
        if not args.json:
            progress.show(line, key=job["state"])

    try:
        return cluster.train(job_args, placement, links, args.timeout, watch,
                             prewarm=False,  # steady steps: no spares importing beside them
                             max_restarts=DEMO_RESTARTS)
    finally:
        progress.finish()


# a fault in a run (a host that stalls, a link that drops) is recovered as a user's job
# would: the demo's point is the comparison, and one recovery costs it seconds, where a
# failed run costs the whole comparison
DEMO_RESTARTS = 2


def plan_prediction(plan: dict[str, Any]) -> str:
    """The plan's predicted step as it is first shown, with what its compute figure is."""
    if plan["predicted_compute_s"] <= 0:
        return (f"the plan predicts {plan['predicted_step_s']:.2f} s a step, communication "
                f"alone (the agents reported no device speed)")
    return (f"the plan predicts {plan['predicted_step_s']:.2f} s a step, its compute a guess "
            f"from the devices' FLOP/s until the workers report their own")
