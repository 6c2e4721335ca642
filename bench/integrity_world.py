"""Benchmark: one bad agent per attack on the 16-agent emulated world (issue 43's
bench/integrity.py part that needs the coordinator's ledger; the scores and the overhead on
loopback stay in bench/integrity.py).

The paper's world, 8 cities x `--per-city` agents (16: 4 stages x 4 replicas), its links
measured once by the agents. Then, on that matrix, with the same seed and tokens:

- an **honest** run at `--verify` (default `full`: every check on), and the same job at
  `--verify off`: tokens/s and bytes per step of each, their ratio the checks' cost;
- one run per attack (`--attacks`, `DTFM_FAULT` modes: agent/worker/fault.py), in which one
  agent, from step `--onset` on, sends wrong values. The agent is bad for the whole job (its
  own environment carries `DTFM_FAULT="*:ONSET:MODE"`, whatever rank it gets). Placement is
  `--placement` (default rank order: the bad agent, `--bad-index` in address order, then
  holds a middle stage, which sends both activations and their gradients, and the honest run
  holds the same placement). Under `--placement scheduled` the search (bounded by seconds,
  not candidates) places the bad agent anew each run, and its uneven data-parallel shares
  leave most agents no gradient to own: every row records where its bad agent began and
  what it owned, says when that left its attack nothing to act on (`?`), and `--tries N`
  runs such an attack again.

Per attack it reports who was excluded (the target: the bad agent, and nobody else), the
step the job stood at when it stopped for the exclusion (the recovery's `last_step`) less the
onset, the final validation loss against the honest run's (the target: within 2 %), and the
job's end. Issue 43's targets: detection within 10 steps of the onset, the right agent alone
excluded, the job finishing, its loss within 2 %; the default level at most 5 % slower and
1 % more bytes than `--verify off`.

Needs root (network namespaces). Run: `python bench/integrity_world.py` (all attacks: about
45 minutes on 2 cores); `--attacks scale,act_scale --steps 30` for a quick look;
`--attacks none --cost-repeats 3` for the checks' cost alone (honest and off interleaved,
the ratio of the medians: one pair's tokens/s moved by 15 % on a shared machine). Writes
bench/results/integrity_world.json (`--out`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from compress import files_under, progress_events  # noqa: E402
from stepsplit import checks_share  # noqa: E402
from wan import emulator_missing, measured_world  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "integrity_world.json"
# the attacks of issue 43, as the fault seam names them: data-parallel contributions, an
# owner's averaged shard, pipeline activations and their gradients, drifting weights
ATTACKS = ("scale", "flip", "noise", "zero", "stale", "avg_scale", "avg_noise", "avg_zero",
           "avg_one", "norm_lie", "norm_forge", "act_scale", "act_noise", "act_zero",
           "actgrad_scale", "act_lie", "drift")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-city", type=int, default=2, help="agents per city (8 cities)")
    p.add_argument("--scale", type=float, default=25.0, help="bandwidth divisor of the world")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--onset", type=int, default=12, help="the first step the bad agent attacks")
    p.add_argument("--attacks", default=",".join(ATTACKS),
                   help="comma-separated; 'none': only the honest and --verify off runs")
    p.add_argument("--cost-repeats", type=int, default=1, metavar="N",
                   help="honest and --verify off runs, interleaved, N times each: their "
                   "tokens/s move by 15 %% between runs on a shared machine, so the cost is the "
                   "ratio of the medians")
    p.add_argument("--verify", default="full")
    p.add_argument("--placement", default="rank-order")
    p.add_argument("--bad-index", default="5",
                   help="the bad agent, by its place in address order; `middle`: the agent "
                        "the honest run's first plan put at stage 1 of its first pipeline (for "
                        "--placement scheduled, whose plan does not follow address order); "
                        "`owner`: the agent that plan gave the largest share of a stage's "
                        "gradient (sharded mode's uneven shares leave most agents none, and an "
                        "average attack needs an owner)")
    p.add_argument("--tries", type=int, default=1, metavar="N",
                   help="run an attack up to N times while its bad agent began where the attack "
                        "cannot act (scheduled placement may put it at the last stage, which "
                        "sends no activations, or give it no gradient to own)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    p.add_argument("--workdir", default="")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    args.attacks = "" if args.attacks == "none" else args.attacks
    if args.bad_index not in ("middle", "owner") and not args.bad_index.isdigit():
        p.error(f"--bad-index: {args.bad_index!r} is neither a place in address order nor "
                f"`middle` or `owner`")
    unknown = set(filter(None, args.attacks.split(","))) - set(ATTACKS)
    if unknown:
        p.error(f"--attacks: unknown {sorted(unknown)}; choose from {', '.join(ATTACKS)}")
    return args


def job_flags(args: argparse.Namespace, verify: str) -> list[str]:
    agents = 8 * args.per_city
    return ["--model", args.model, "--agents", str(agents), "--min-agents", "4",
            "--stages", str(args.stages), "--replicas", str(agents // args.stages),
            "--steps", str(args.steps), "--batch", str(args.batch),
            "--micro-batches", str(args.micro_batches), "--seed", str(args.seed),
            "--search-seconds", "10", "--layer-split", "even", "--checkpoint-every", "4",
            "--dp-mode", "sharded", "--verify", verify, "--eval-every", str(args.steps),
            "--eval-batches", "4"]


def run(cluster: Any, links: Path, args: argparse.Namespace, label: str, verify: str,
        bad: int = -1, attack: str = "") -> dict[str, Any]:
    """One job on the measured world; `bad` >= 0: that agent attacks with `attack`."""
    cluster.agent_env = {bad: {"DTFM_FAULT": f"*:{args.onset}:{attack}"}} if bad >= 0 else {}

    first_grid: list[list[str]] = []
    first_shares: list[list[float]] = []

    def watch(status: dict[str, Any], now: float) -> None:
        # where everyone began, and what each owned, before any exclusion re-planned the job
        if not first_grid and (grid := (status.get("plan") or {}).get("grid")):
            first_grid.extend(grid)
            first_shares.extend(status["plan"].get("dp_shares") or [])
        job = status["job"]
        print(f"  [{label}] {now:6.0f}s {job['state']:<10} step {job['step']:>3}/"
              f"{job['total_steps']} loss {job['loss']:.3f}", file=sys.stderr, flush=True)

    started = time.monotonic()
    before = files_under(cluster.workdir, ".progress.jsonl")
    try:
        out = cluster.train(job_flags(args, verify), args.placement, links, args.timeout,
                            watch, prewarm=False, max_restarts=4)
    except RuntimeError as e:  # the job failed: a result, not a crash of the bench
        out = {"failed": str(e)}
    # the checks' own seconds in the step, from the workers' timers: the cost within this run
    checks = checks_share(progress_events(files_under(cluster.workdir, ".progress.jsonl")
                                          - before))
    return {"label": label, "wall_s": time.monotonic() - started, "checks": checks,
            "first_grid": first_grid, "first_shares": first_shares, **out}


def place_of(grid: list[list[str]], agent_id: str) -> str:
    """`stage S of pipeline P` where `grid` (a row per stage) put `agent_id`, "" if nowhere."""
    return next((f"stage {s} of pipeline {p}" for s, row in enumerate(grid)
                 for p, a in enumerate(row) if a == agent_id), "")


def judged(row: dict[str, Any], bad_id: str, onset: int, honest: dict[str, Any]
           ) -> dict[str, Any]:
    """What an attack's run shows against the targets."""
    excluded = row.get("excluded", {})
    stopped = [r["last_step"] for r in row.get("recoveries", [])
               if "exclu" in (r.get("reason") or "")]
    loss, base = row.get("val_loss") or 0.0, honest.get("val_loss") or 0.0
    evidence = row.get("evidence", {})
    return {"bad_excluded": bad_id in excluded,
            "others_excluded": sorted(a for a in excluded if a != bad_id),
            "reason": excluded.get(bad_id, {}).get("reason", "") or (
                "evidence only: " + ", ".join(f"{k} x{n}" for k, n in sorted(
                    evidence.get(bad_id, {}).items())) if evidence.get(bad_id) else ""),
            "bad_evidence": evidence.get(bad_id, {}),
            "others_evidence": {a: e for a, e in evidence.items() if a != bad_id},
            "steps_to_exclusion": (stopped[0] - onset + 1) if stopped else None,
            "val_loss_vs_honest_pct": 100 * (loss / base - 1) if loss and base else None,
            "finished": "failed" not in row,
            "bad_placed_at": place_of(row.get("first_grid") or [], bad_id),
            "bad_share": share_of(row.get("first_grid") or [], row.get("first_shares") or [],
                                  bad_id)}


def share_of(grid: list[list[str]], shares: list[list[float]], agent_id: str) -> float | None:
    """The share of its stage's gradient `agent_id` owned in the first plan (sharded mode's
    uneven shares: an agent that owns none cannot alter an average, so an average attack
    from it cannot act); None where the plan gave no shares (even ones)."""
    for s, row in enumerate(grid):
        if agent_id in row and s < len(shares) and shares[s]:
            return float(shares[s][row.index(agent_id)])
    return None


def price(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """The checks' cost from the (honest, off) pairs that finished: the median tokens/s of
    each side, their ratio, each pair's ratio, and the bytes per step (which do not move)."""
    done = [(h, o) for h, o in pairs if "failed" not in h and "failed" not in o]
    if not done:
        return {}

    def sent(r: dict[str, Any]) -> float:
        return float(r["dp_bytes_per_step"] + r["pp_bytes_per_step"])

    on = statistics.median(h["tokens_per_s"] for h, _ in done)
    off = statistics.median(o["tokens_per_s"] for _, o in done)
    return {"tokens_per_s": on / max(off, 1e-9), "on_tokens_per_s": on,
            "off_tokens_per_s": off,
            "pairs": [h["tokens_per_s"] / max(o["tokens_per_s"], 1e-9) for h, o in done],
            "bytes_per_step": statistics.median(sent(h) / max(sent(o), 1) for h, o in done)}


def short(place: str) -> str:
    """`stage 1 of pipeline 0` as `s1p0`, for the table."""
    words = place.split()
    return f"s{words[1]}p{words[-1]}" if len(words) == 5 else "-"


def could_act(attack: str, place: str, share: float | None, stages: int) -> bool:
    """Whether the bad agent's first place let `attack` act: an average attack needs a share
    of its stage's gradient to own, an attack on activations a stage after its own, one on
    their gradients a stage before it. Other attacks act anywhere."""
    words = place.split()
    stage = int(words[1]) if len(words) == 5 else -1
    if attack.startswith("avg_"):
        return share is None or share > 0
    if attack.startswith("actgrad_"):
        return stage > 0
    if attack.startswith("act_"):
        return 0 <= stage < stages - 1
    return True


def owned(share: float | None) -> str:
    return "-" if share is None else f"{share:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'run':<14} {'bad excl.':>9} {'others':>6} {'steps':>5} {'val loss':>9} "
            f"{'vs honest':>9} {'tok/s':>7} {'checks':>6} {'bad at':>5} {'owns':>4}  reason")
    lines = [head, "-" * len(head)]
    for r in rows:
        j = r.get("judged", {})
        steps = j.get("steps_to_exclusion")
        pct = j.get("val_loss_vs_honest_pct")
        checks = r.get("checks")
        checked = f"{100 * checks['share']:.1f}%" if checks else "-"
        label = r["label"] + ("?" if j and not j.get("acted", True) else "")
        lines.append(
            f"{label:<14} {str(j.get('bad_excluded', '-')):>9} "
            f"{len(j.get('others_excluded', [])) if j else '-':>6} "
            f"{steps if steps is not None else '-':>5} {r.get('val_loss') or 0:>9.4f} "
            f"{f'{pct:+.2f} %' if pct is not None else '-':>9} "
            f"{r.get('tokens_per_s') or 0:>7.0f} "
            f"{checked:>6} {short(j.get('bad_placed_at', '')):>5} "
            f"{owned(j.get('bad_share')):>4}  "
            f"{(j.get('reason') or r.get('failed') or '')[:60]}")
    if any(not r.get("judged", {}).get("acted", True) for r in rows):
        lines.append("?: its bad agent began where the attack cannot act (bad at / owns)")
    return "\n".join(lines)


def middle(honest: dict[str, Any], ids: list[str]) -> int:
    """The place in address order of the agent at stage 1 of the honest run's first
    pipeline: a middle stage, which sends activations on and their gradients back."""
    grid = honest.get("first_grid") or []
    if len(grid) < 3 or not grid[1] or grid[1][0] not in ids:
        raise SystemExit(f"--bad-index middle: the honest run's first plan {grid} has no "
                         f"middle stage (use --stages 3 or more, or a number)")
    return ids.index(grid[1][0])


def owner(honest: dict[str, Any], ids: list[str]) -> int:
    """The place in address order of the agent that the honest run's first plan gave the
    largest share of a stage's gradient to own."""
    grid, shares = honest.get("first_grid") or [], honest.get("first_shares") or []
    owned = [(x, a) for row, got in zip(grid, shares, strict=False)
             for a, x in zip(row, got, strict=False) if a in ids]
    if not owned:
        raise SystemExit("--bad-index owner: the honest run's first plan gave no shares "
                         "(--dp-mode sharded, and replicas > 1)")
    return ids.index(max(owned)[1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if emulator_missing():
        return 2
    rows: list[dict[str, Any]] = []
    with measured_world(args.per_city, args.scale, args.workdir) as (cluster, links, city_of):
        ids = [str(cluster.agent_id(i)) for i in range(cluster.agents)]
        pairs = []
        for i in range(max(args.cost_repeats, 1)):
            suffix = f" #{i + 1}" if args.cost_repeats > 1 else ""
            pairs.append((run(cluster, links, args, "honest" + suffix, args.verify),
                          run(cluster, links, args, "verify off" + suffix, "off")))
            rows += pairs[-1]
        honest = pairs[0][0]
        bad = (middle(honest, ids) if args.bad_index == "middle" else owner(honest, ids)
               if args.bad_index == "owner" else int(args.bad_index))
        bad_id = ids[bad]
        print(f"the bad agent: {bad_id} ({city_of.get(bad_id, '?')}), placed by the honest "
              f"run at {place_of(honest.get('first_grid') or [], bad_id) or '?'}",
              file=sys.stderr)
        for attack in filter(None, args.attacks.split(",")):
            for _ in range(max(args.tries, 1)):
                row = run(cluster, links, args, attack, args.verify, bad, attack)
                row["judged"] = j = judged(row, bad_id, args.onset, honest)
                j["acted"] = could_act(attack, j["bad_placed_at"], j["bad_share"], args.stages)
                rows.append(row)
                print(table(rows), file=sys.stderr)
                if j["acted"]:
                    break
    cost = price(pairs)
    print(table(rows))
    if cost:
        print(f"--verify {args.verify} against off: {cost['tokens_per_s']:.3f}x the tokens/s "
              f"(medians of {len(cost['pairs'])} pair(s); each pair: "
              f"{', '.join(f'{x:.3f}' for x in cost['pairs'])}), "
              f"{cost['bytes_per_step']:.3f}x the bytes per step")
    for r in rows:
        if r.get("checks") and r["label"].startswith("honest"):
            c = r["checks"]
            print(f"{r['label']}: the checks' own time, {100 * c['share']:.2f} % of the job's "
                  f"step time ({c['verify_s_per_step'] * 1e3:.1f} ms a rank-step; the rank that "
                  f"spends the most: {100 * c['worst_rank_share']:.2f} %)")
    Path(args.out).write_text(json.dumps({"args": vars(args), "bad_agent": bad_id,
                                          "cost": cost, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
