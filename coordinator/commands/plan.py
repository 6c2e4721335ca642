"""`coordinator plan`: the offline planner on a paper scenario or a measured link matrix.

Owns turning command-line flags into one `search_plan` call plus its baselines, and printing
the answer (a table, or one JSON object with `--json`). Wired into `coordinator/cli.py` as the
`plan` subcommand through `add_arguments` and `run`; `python -m coordinator.commands.plan` runs it
standalone. Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from coordinator.scheduler import (
    Network,
    comm_gb,
    plan_compress,
    plan_cost,
    plan_sync,
    plan_uneven,
    scenarios,
    search_plan,
)
from coordinator.scheduler.baselines import random_best, rank_order
from coordinator.scheduler.costmodel import CostModel
from coordinator.scheduler.placement import polished_grid
from dtfm import flags
from dtfm.core.presets import PRESETS, get_preset
from dtfm.core.shape import pick_shape
from dtfm.core.spec import SYNC_AUTO, check_batch
from dtfm.core.words import stages_x_replicas

EXIT_USAGE = 2
TSP_EXACT = "exact (Held-Karp)"
TSP_HEURISTIC = "heuristic (nearest neighbour + 2-opt + or-opt)"
DEFAULT_RANDOM = 1000
POLISH_SECONDS = 5.0  # --polish without --search-seconds
SEQUENCES_PER_REPLICA = 64  # default global batch = 64 x replicas (the paper used ~61)


class PlanInputError(ValueError):
    """Bad input: reported as one line on stderr with exit code 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--scenario", choices=scenarios.SCENARIOS, help="a paper network scenario")
    src.add_argument(
        "--links",
        metavar="FILE",
        help='JSON {"delay_ms": [[...]], "bandwidth_gbps": [[...]], "agents": [...]} '
        "(N x N, row = from, column = to)",
    )
    parser.add_argument(
        "--per-city", type=int, default=None, help="devices per city for --scenario world (8)"
    )
    parser.add_argument("--model", choices=sorted(PRESETS), help="model preset: sizes c_DP, c_PP")
    parser.add_argument("--stages", type=int, help="pipeline stages (D_PP)")
    parser.add_argument("--replicas", type=int, help="data-parallel replicas (D_DP)")
    parser.add_argument("--dp-gb", type=float, help="c_DP in GB: one stage's gradient message")
    parser.add_argument("--pp-gb", type=float, help="c_PP in GB: one replica's activations")
    parser.add_argument(
        "--batch", type=int, help=f"global batch in sequences ({SEQUENCES_PER_REPLICA} x replicas)"
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="micro-batches per replica (must divide its batch; the bytes sent do not change)",
    )
    flags.add_train_arg(parser, "dtype")  # what a job sends: its default and choices
    flags.add_train_arg(parser, "lora_rank")  # LoRA: price the adapters' exchange and memory
    flags.add_train_arg(parser, "lora_targets")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--budget", type=int,
        help="candidates the search may build (default: 10,000 up to 128 devices, fewer "
        "above; an "
        "instance with no more placements than that is enumerated for its exact optimum)")
    flags.add_search_seconds(parser, None, "none: the --budget of candidates, so a seed gives "
                             "the same plan on every machine")
    parser.add_argument(
        "--gain", choices=("paper", "kl"), default="paper", help="local search gain"
    )
    parser.add_argument(
        "--random",
        type=int,
        default=None,
        help=f"random allocations for the baseline ({DEFAULT_RANDOM}; 20 above 128 devices)",
    )
    parser.add_argument(
        "--polish", action="store_true",
        help="then polish the grid against the step model, as `coordinator start` does for "
        "--placement scheduled (needs --model; speeds from --speeds/--flops/--devices count)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", default="",
                        help="also draw both matrices as heat maps with the chosen stage x "
                        "pipeline grid over them (needs matplotlib: pip install 'dtfm[plot]')")
    plan_uneven.add_arguments(parser)
    plan_compress.add_arguments(parser)
    plan_sync.add_arguments(parser)


def _note(msg: str) -> None:
    print(f"coordinator plan: {msg}", file=sys.stderr)


def _load_links(path: str) -> tuple[Network, list[Any] | None]:
    from coordinator.links.store import load_links_file

    try:
        obj = load_links_file(path, need_agents=False)
    except ValueError as e:
        raise PlanInputError(str(e)) from None
    return Network.from_json(obj), obj.get("agents")


def _shape(args: argparse.Namespace, n: int, layers: int | None) -> tuple[int, int, bool]:
    s, r = args.stages, args.replicas
    for name, v in (("--stages", s), ("--replicas", r)):
        if v is not None and v < 1:
            raise PlanInputError(f"{name} must be >= 1, got {v}")
    if s is not None and r is not None:
        if s * r != n:
            raise PlanInputError(
                f"{stages_x_replicas(s, r)} = {s * r} tasklets but the network has {n} "
                f"devices: pick --stages x --replicas = {n}"
            )
        return s, r, False
    if s is not None or r is not None:
        given = s if s is not None else r
        assert given is not None
        if n % given:
            flag = "--stages" if s is not None else "--replicas"
            raise PlanInputError(f"{flag} {given} does not divide the {n} devices")
        other = n // given
        return (given, other, False) if s is not None else (other, given, False)
    s, r = pick_shape(n, layers)
    return s, r, True


def _sizes(args: argparse.Namespace, s: int, r: int) -> tuple[float, float, str]:
    if (args.dp_gb is None) != (args.pp_gb is None):
        raise PlanInputError("give both --dp-gb and --pp-gb, or neither")
    if args.dp_gb is not None:
        if not (args.dp_gb >= 0 and args.pp_gb >= 0):
            raise PlanInputError("--dp-gb and --pp-gb must be >= 0")
        return float(args.dp_gb), float(args.pp_gb), "given"
    if args.model is not None:
        spec = get_preset(args.model)
        batch = args.batch if args.batch is not None else SEQUENCES_PER_REPLICA * r
        try:
            check_batch(batch, args.micro_batches, r)  # the worker's rule, from its one home
            dp, pp = comm_gb(spec, s, r, batch, args.dtype, args.lora_rank, args.lora_targets)
        except ValueError as e:
            raise PlanInputError(str(e)) from None
        lora = f", LoRA rank {args.lora_rank}" if args.lora_rank else ""
        return dp, pp, f"{args.model}, batch {batch}, {args.dtype}{lora}"
    return scenarios.PAPER_DP_GB, scenarios.PAPER_PP_GB, "paper (GPT-3 XL)"


def _progress(candidates: int, elapsed: float, best: float) -> None:
    if elapsed >= 2.0:
        _note(f"searching: {candidates} candidates, {elapsed:.0f}s, best {best:.3f}")


def load_network(args: argparse.Namespace) -> tuple[Network, list[Any] | None, str]:
    """The matrices to plan on, their agent ids (from a links file) and where they came from."""
    if args.scenario is not None:
        try:
            return scenarios.get_scenario(args.scenario, args.per_city), None, \
                f"scenario {args.scenario}"
        except ValueError as e:
            raise PlanInputError(str(e)) from None
    if args.per_city is not None:
        raise PlanInputError("--per-city only applies to --scenario world")
    net, agents = _load_links(args.links)
    return net, agents, f"links {args.links}"


def compute(args: argparse.Namespace,
            loaded: tuple[Network, list[Any] | None, str] | None = None) -> dict[str, Any]:
    """The plan and its baselines as the JSON-ready dict `--json` prints."""
    net, agents, source = loaded or load_network(args)
    layers = get_preset(args.model).n_layers if args.model else None
    s, r, picked = _shape(args, net.size, layers)
    if layers is not None and s > layers:
        raise PlanInputError(
            f"{args.model} has {layers} layers, so it cannot be split into {s} stages: "
            f"use --stages {layers} or fewer"
        )
    if picked and args.links is not None:
        _note(f"{net.size} devices: planning {stages_x_replicas(s, r)} (set --stages/--replicas)")
    dp_gb, pp_gb, sizes_from = _sizes(args, s, r)
    if args.budget is not None and args.budget < 1:
        raise PlanInputError(f"--budget must be >= 1, got {args.budget}")
    if args.polish and args.model is None:
        raise PlanInputError("--polish needs --model: the step model simulates its messages")
    samples = args.random
    if samples is None:
        samples = DEFAULT_RANDOM if net.size <= 128 else 20
    if samples < 1:
        raise PlanInputError(f"--random must be >= 1, got {samples}")
    comp = plan_compress.compression(args)  # None: nothing compressed, the paper's model
    t0 = time.perf_counter()
    res = search_plan(
        net, s, r, dp_gb, pp_gb, seed=args.seed, budget=args.budget, seconds=args.search_seconds,
        gain=args.gain, progress=_progress, compression=comp,
    )
    model = CostModel(net, s, r, dp_gb, pp_gb, compression=comp)
    rnd = random_best(model, samples, np.random.default_rng(args.seed + 1))
    ro = rank_order(model)
    out: dict[str, Any] = {
        "cost": res.cost,
        "dp_cost": res.dp_cost,
        "pp_cost": res.pp_cost,
        "stages": s,
        "replicas": r,
        "grid": res.grid,
        "seconds": res.seconds,
        "baselines": {"random": rnd.cost, "rank_order": ro.cost},
        "baseline_parts": {
            "random": {"dp_cost": rnd.dp_cost, "pp_cost": rnd.pp_cost, "samples": samples},
            "rank_order": {"dp_cost": ro.dp_cost, "pp_cost": ro.pp_cost},
        },
        "dp_gb": dp_gb,
        "pp_gb": pp_gb,
        "sizes_from": sizes_from,
        "source": source,
        "devices": net.size,
        "seed": args.seed,
        "evaluated": res.evaluated,
        "candidates": res.candidates,
        "exhaustive": res.exhaustive,
        "tsp": TSP_EXACT if res.tsp_exact else TSP_HEURISTIC,
        "tsp_exact": res.tsp_exact,
        "gain": res.gain,
        "total_seconds": time.perf_counter() - t0,
    }
    if agents is not None:
        out["agents"] = agents
    batch = args.batch if args.batch is not None else SEQUENCES_PER_REPLICA * r
    uneven = plan_uneven.wanted(args)  # speeds or memory given: split layers, maybe move
    dev = plan_uneven.devices(args, net.size) if uneven and args.polish else None
    if args.polish:
        out["grid"], before, after = polished_grid(
            net, res.grid, plan_uneven.workload(args, s, r, batch),
            dev.flops.tolist() if dev is not None else [], args.seed,
            args.search_seconds or POLISH_SECONDS)
        out["polish"] = {"searched_step_s": before, "polished_step_s": after}
    if uneven:
        out.update(plan_uneven.split(args, net, out["grid"], s, r, batch, dev))
    if args.polish or uneven:  # the grid moved: its cost
        out["cost"], out["dp_cost"], out["pp_cost"] = plan_cost(net, out["grid"], dp_gb, pp_gb,
                                                                comp)
    if comp is not None:  # which codec each link got, and the uncompressed cost
        out.update(plan_compress.describe(comp, net, out["grid"], dp_gb, pp_gb))
    if plan_sync.every(args) != 1:  # the predicted step with the exchange every H steps
        if args.model is None:
            raise PlanInputError("--sync-every needs --model: the step model prices its "
                                 "messages")
        flops = (dev or plan_uneven.devices(args, net.size)).flops.tolist()
        out.update(plan_sync.describe(net, out["grid"], plan_uneven.workload(args, s, r, batch),
                                      flops, out.get("layer_splits"),
                                      auto=plan_sync.every(args) == SYNC_AUTO,
                                      overhead=args.sync_overhead))
    return out


def format_table(out: dict[str, Any]) -> str:
    s, r, grid = out["stages"], out["replicas"], out["grid"]
    lines = [
        f"plan for {out['source']}: {out['devices']} devices, {stages_x_replicas(s, r)}",
        f"sizes: c_DP = {out['dp_gb']:.4g} GB, c_PP = {out['pp_gb']:.4g} GB ({out['sizes_from']})",
        "",
        "allocation (device of stage j in pipeline k; a pipeline runs down its column):",
    ]
    width = max(len(str(d)) for row in grid for d in row)
    width = max(width, len(f"p{r - 1}"))
    lines.append("stage  " + " ".join(f"{'p' + str(k):>{width}}" for k in range(r)))
    for j, row in enumerate(grid):
        lines.append(f"{j:>5}  " + " ".join(f"{d:>{width}}" for d in row))
    if "agents" in out:
        lines.append("")
        lines.append("devices: " + ", ".join(f"{i}={a}" for i, a in enumerate(out["agents"])))
    bp = out["baseline_parts"]
    lines += [
        "",
        f"{'cost (model seconds)':<22}{'ours':>10}{'random':>10}{'rank-order':>12}",
        f"{'DP-COST':<22}{out['dp_cost']:>10.3f}{bp['random']['dp_cost']:>10.3f}"
        f"{bp['rank_order']['dp_cost']:>12.3f}",
        f"{'2 x PP-COST':<22}{2 * out['pp_cost']:>10.3f}{2 * bp['random']['pp_cost']:>10.3f}"
        f"{2 * bp['rank_order']['pp_cost']:>12.3f}",
        f"{'total':<22}{out['cost']:>10.3f}{out['baselines']['random']:>10.3f}"
        f"{out['baselines']['rank_order']:>12.3f}",
        "",
        f"search: {_searched(out)} in {out['seconds']:.2f}s, seed {out['seed']}, "
        f"gain {out['gain']}, TSP {out['tsp']}; random = best of {bp['random']['samples']}",
    ]
    if "polish" in out:  # the grid above is the polished one
        p = out["polish"]
        lines.append(f"polished against the step model: predicted step "
                     f"{p['searched_step_s']:.3f} s (search) -> {p['polished_step_s']:.3f} s")
    return "\n".join(lines + plan_uneven.format_lines(out) + plan_compress.format_lines(out)
                     + plan_sync.format_lines(out))


def _searched(out: dict[str, Any]) -> str:
    if out.get("exhaustive"):
        return f"all {out['evaluated']} placements (the exact optimum)"
    return f"{out['candidates']} candidates ({out['evaluated']} evaluated)"


def write_plot(net: Network, out: dict[str, Any], path: str) -> str:
    """Draw the plan over its matrices into `path`; returns an error message, or ""."""
    try:
        from coordinator.commands.plots import plot_plan
    except ImportError as e:
        return f"--plot needs matplotlib ({e}): pip install 'dtfm[plot]'"
    title = (f"{out['source']}: {out['stages']} stages x {out['replicas']} pipelines, "
             f"cost {out['cost']:.3f} s (rank order {out['baselines']['rank_order']:.3f} s)")
    try:
        plot_plan(net.delay_ms, net.bandwidth_gbps, out["grid"], path, title)
    except OSError as e:
        return f"cannot write {path}: {e.strerror}"
    return ""


def run(args: argparse.Namespace) -> int:
    try:
        loaded = load_network(args)
        out = compute(args, loaded)
    except ValueError as e:  # PlanInputError and validation errors from the library
        print(f"coordinator plan: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(out))
    else:
        print(format_table(out))
    if getattr(args, "plot", ""):
        problem = write_plot(loaded[0], out, args.plot)
        if problem:
            print(f"coordinator plan: error: {problem}", file=sys.stderr)
            return 1
        _note(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return flags.standalone("coordinator plan", "Plan a placement offline (no agents needed).",
                              add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
