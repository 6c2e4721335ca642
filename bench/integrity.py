"""Benchmark: what the replica checks (`--verify`, issue 43) cost and how well they separate.

Three measurements, on loopback, no root:

1. `--scores` (in-process, one thread): gradients of R replicas of one model on different
   batches of the bundled corpus, cut into the worker's buckets and shards
   (`data_parallel.plan_buckets`), scored at every owner by `gradscore.ShardScorer`, honest
   and with replica 0 attacked (`badpeer.attack`: scale, flip, noise); the model takes an
   AdamW step on the mean each step, so the scores follow training. Prints min / 5th / 95th
   percentile / max of each score for honest copies (beside an honest or an attacked copy)
   and for the attacked copy, and each attack's per-step detection rate with the thresholds
   in `gradscore`: the numbers behind the thresholds (docs/architecture.md). `--score-stages
   N` cuts the model into N pipeline stages as a job does (the first holds the embedding,
   the last the head), each scored apart; with `--replicas 2` the `pair` and `window` rows
   are what `pairscore.PairJudge` judges (one step's pair, and the medians of its window).
2. the digest and the scorer's cost at the model's size (seconds per call, one thread).
3. side by side: the same `agent local` job with `--verify off` and the default (`auto`:
   `full` under `--dp-mode sharded`), interleaved `--repeats` times, each at 4 and at
   4 + `--steps` steps. The cost is read from CPU seconds (the launcher's and its workers',
   `getrusage`): the difference between the two lengths is `--steps` steps' CPU, free of
   start-up, and CPU time barely moves when other work shares the machine, where wall-clock
   tokens/s (also shown, the median over each run's steps after the first two) swung by
   +-50 % on a shared 2-core machine. Data-parallel bytes per step: the workers' own count
   plus the digest's exchange (R float64 every `DIGEST_EVERY` steps, added by hand).

Writes bench/results/integrity.json. Run: `python bench/integrity.py` (a few minutes on 2
cores; `--skip-scores` / `--skip-overhead` to run one part).
Not done here (issue 43's full bench/integrity.py): the 16-agent emulated world, exclusion
and steps-to-exclusion, which need the coordinator's ledger.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "integrity.json"
ATTACKS = ("scale", "flip", "noise")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-mini")
    p.add_argument("--score-model", default="gpt-tiny", help="model of the --scores part")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--per-replica", type=int, default=2, help="sequences per replica (scores)")
    p.add_argument("--score-steps", type=int, default=20)
    p.add_argument("--score-stages", type=int, default=1,
                   help="pipeline stages the --scores model is cut into (each scored apart)")
    p.add_argument("--steps", type=int, default=20, help="steps of each side-by-side run")
    p.add_argument("--batch", type=int, default=12, help="global batch of the side-by-side")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-scores", action="store_true")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def quantiles(values: list[float]) -> list[float]:
    v = sorted(values)
    return [v[0], v[len(v) // 20], v[-1 - len(v) // 20], v[-1]]


class Trainer:
    """One model on the bundled corpus, its parameters cut into `stages` pipeline stages
    (layers split evenly; the first holds the embedding, the last the head) and each stage's
    into the worker's buckets (`data_parallel.plan_buckets`): gradients of any batch, and an
    AdamW step."""

    def __init__(self, model: str, stages: int = 1) -> None:
        import torch

        from agent.worker.data import Sampler, load_splits
        from agent.worker.data_parallel import bucket_bytes_for, plan_buckets
        from agent.worker.stage import Stage
        from dtfm.core.presets import get_preset

        torch.set_num_threads(1)
        spec = get_preset(model)
        self.stage = Stage(spec, 0, spec.n_layers, 0)
        self.opt = torch.optim.AdamW(self.stage.parameters(), 1e-3)
        self.sampler = Sampler(load_splits("", spec.vocab_size, "")[0], spec.seq_len, 0)
        st, n = self.stage, spec.n_layers
        bounds = [round(i * n / stages) for i in range(stages + 1)]
        self.plan: list[list[Any]] = []  # every stage's buckets, stage after stage
        self.stage_of: list[int] = []  # each bucket's stage
        for s, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
            parts = ([st.embed] if lo == 0 else []) + [st.layers[str(i)] for i in range(lo, hi)]
            parts += [st.head] if hi == n else []
            params = [p for part in parts for p in part.parameters()][::-1]
            buckets = plan_buckets(params, bucket_bytes_for(params))
            self.plan += buckets
            self.stage_of += [s] * len(buckets)

    def _backward(self, ids: Any) -> None:
        from agent.worker.stage import lm_loss

        x, y = self.sampler.windows(ids)
        lm_loss(self.stage(x), y).backward()

    def grads(self, ids: Any) -> list[Any]:
        """Each bucket's gradient of the batch `ids`, flat."""
        import torch

        self.stage.zero_grad()
        self._backward(ids)
        return [torch.cat([p.grad.reshape(-1) for p in b]) for b in self.plan]  # type: ignore

    def step(self, ids: Any) -> None:
        """An AdamW step on the batch `ids`."""
        self.opt.zero_grad()
        self._backward(ids)
        self.opt.step()


def scores(model: str, replicas: int, per: int, steps: int, stages: int = 1
           ) -> dict[str, Any]:
    """Every owner's scores of every stage, honest and attacked, over `steps` steps. With
    R = 2 the rows `<mode>/pair` hold one step's pair scores: the two copies' norm ratio
    (larger over smaller), their cosine and the larger shape; `<mode>/window` the medians over
    `pairscore.PAIR_WINDOW` steps that `PairJudge` judges."""
    import torch

    from agent.worker.badpeer import attack
    from agent.worker.gradscore import ShardScorer, judge
    from agent.worker.pairscore import PairJudge
    from agent.worker.scorewindow import WINDOW, WINDOW_COSINE_MIN, ScoreWindow

    t = Trainer(model, stages)
    sampler, plan, grads = t.sampler, t.plan, t.grads
    modes = ("honest", *ATTACKS)
    scorers = {(m, s, o): ShardScorer(replicas)
               for m in modes for s in range(stages) for o in range(replicas)}
    pairs = {key: PairJudge() for key in scorers}
    directions = {key: ScoreWindow() for key in scorers}  # as the worker judges (R >= 3)
    seen: dict[str, dict[str, list[float]]] = {}
    caught = {m: 0 for m in modes}
    judged = {m: 0 for m in modes}
    flagged: dict[str, list[str]] = {}  # honest findings: "step stage owner: detail"
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        ids = sampler.next_global(replicas * per)
        gs = [grads(ids[k * per:(k + 1) * per]) for k in range(replicas)]
        for mode in modes:
            for i in range(len(plan)):
                n = -(-gs[0][i].numel() // replicas)  # the worker's padded equal shards
                for owner in range(replicas):
                    copies = [g[i][owner * n:(owner + 1) * n] for g in gs]
                    if mode != "honest":
                        copies[0] = attack(mode, copies[0], gen=gen)
                    scorers[(mode, t.stage_of[i], owner)].add(i, copies)
            for (m, stage, owner), sc in scorers.items():
                if m != mode:
                    continue
                found = sc.scores()
                smoothed = directions[(m, stage, owner)].smooth(found)
                findings = judge(smoothed, WINDOW_COSINE_MIN) \
                    + pairs[(m, stage, owner)].judge(found)
                judged[mode] += 1
                caught[mode] += any(f.replica in (0, -1) for f in findings) \
                    if mode != "honest" else bool(findings)
                if mode == "honest":
                    flagged.setdefault(mode, []).extend(
                        f"step {step} stage {stage} owner {owner}: {f.kind} {f.detail}"
                        for f in findings)
                for s in found:
                    who = "attacked" if mode != "honest" and s.replica == 0 else "honest"
                    row = seen.setdefault(f"{mode}/{who}", {})
                    for k in ("norm_ratio", "cosine", "shape", "quiet"):
                        row.setdefault(k, []).append(getattr(s, k))
                for s in smoothed if replicas >= 3 and step >= WINDOW - 1 else []:
                    who = "attacked" if mode != "honest" and s.replica == 0 else "honest"
                    seen.setdefault(f"{mode}/{who}", {}).setdefault(
                        "quiet_window", []).append(s.quiet)
                if len(found) == 2:
                    a, b = found
                    row = seen.setdefault(f"{mode}/pair", {})
                    row.setdefault("norm_ratio", []).append(
                        max(a.norm_ratio, b.norm_ratio)
                        / max(min(a.norm_ratio, b.norm_ratio), 1e-30))
                    row.setdefault("cosine", []).append(a.cosine)
                    row.setdefault("shape", []).append(max(a.shape, b.shape))
                    w = pairs[(m, stage, owner)].last
                    if w is not None:  # the window's medians, as `PairJudge` judges them
                        row = seen.setdefault(f"{mode}/window", {})
                        row.setdefault("norm_ratio", []).append(
                            max(w.norm_ratio, 1 / max(w.norm_ratio, 1e-30)))
                        row.setdefault("cosine", []).append(w.cosine)
                        row.setdefault("shape", []).append(max(w.shape_a, w.shape_b))
        t.step(ids)
    return {"model": model, "replicas": replicas, "per_replica": per, "steps": steps,
            "stages": stages,
            "quantiles": {key: {k: quantiles(v) for k, v in row.items()}
                          for key, row in seen.items()},
            "flagged_rate": {m: caught[m] / judged[m] for m in modes},
            "honest_findings": flagged.get("honest", [])[:20]}


def costs(model: str, replicas: int) -> dict[str, float]:
    import torch

    from agent.worker.digest import weights_digest
    from agent.worker.gradscore import ShardScorer, judge
    from agent.worker.stage import Stage
    from dtfm.core.presets import get_preset

    torch.set_num_threads(1)
    spec = get_preset(model)
    stage = Stage(spec, 0, spec.n_layers, 0)
    n = sum(p.numel() for p in stage.parameters())

    def best(fn: Any) -> float:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    shard = [torch.randn(n // replicas) for _ in range(replicas)]
    scorer = ShardScorer(replicas)
    return {"params": n,
            "digest_s": best(lambda: weights_digest(stage.parameters())),
            "score_s": best(lambda: (scorer.add(0, shard), judge(scorer.scores())))}


def local_run(model: str, replicas: int, batch: int, steps: int, verify: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "agent.commands.local", "--json", "--threads", "1",
           "--model", model, "--stages", "1", "--replicas", str(replicas), "--batch",
           str(batch), "--micro-batches", "1", "--steps", str(steps), "--eval-batches", "0",
           "--checkpoint-every", "0", "--verify", verify]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DTFM_LOG_LEVEL": "WARNING"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
                         check=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    rows = [json.loads(line) for line in out.splitlines()]
    tps = [r["tokens_per_s"] for r in rows if "step" in r][2:]
    done = next(r for r in rows if r.get("done"))
    return {"tokens_per_s": statistics.median(tps), "cpu_s": cpu,
            "dp_bytes_per_step": done.get("dp_bytes_per_step", 0)}


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    from dtfm.core.verify import DIGEST_EVERY

    runs: dict[str, list[dict[str, Any]]] = {"off": [], "auto": []}
    for _ in range(args.repeats):
        for verify in runs:
            short = local_run(args.model, args.replicas, args.batch, 4, verify)
            long = local_run(args.model, args.replicas, args.batch, 4 + args.steps, verify)
            long["cpu_s_per_step"] = (long["cpu_s"] - short["cpu_s"]) / args.steps
            runs[verify].append(long)
    out: dict[str, Any] = {}
    for verify, rs in runs.items():
        out[verify] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                       "cpu_s_per_step": statistics.median(r["cpu_s_per_step"] for r in rs),
                       "dp_bytes_per_step": rs[0]["dp_bytes_per_step"]}
    digest_bytes = 8 * args.replicas * 2 * (args.replicas - 1) / args.replicas / DIGEST_EVERY
    out["auto"]["dp_bytes_per_step"] += digest_bytes  # the digest's ring all-reduce
    out["tokens_per_s_cost_pct"] = 100 * (1 - out["auto"]["tokens_per_s"]
                                          / out["off"]["tokens_per_s"])
    out["cpu_cost_pct"] = 100 * (out["auto"]["cpu_s_per_step"] / out["off"]["cpu_s_per_step"]
                                 - 1)
    out["bytes_cost_pct"] = 100 * digest_bytes / max(out["off"]["dp_bytes_per_step"], 1)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {"args": vars(args)}
    if not args.skip_scores:
        result["scores"] = scores(args.score_model, args.replicas, args.per_replica,
                                  args.score_steps, args.score_stages)
        s = result["scores"]
        print(f"scores: {s['model']} in {s['stages']} stages, R = {s['replicas']}, "
              f"{s['per_replica']} sequences per replica, {s['steps']} steps (min / p5 / p95 "
              f"/ max)")
        cols = ("norm_ratio", "cosine", "shape", "quiet", "quiet_window")
        print(f"{'copies':<22}" + "".join(f"{k:>30}" for k in cols))
        for key, row in sorted(s["quantiles"].items()):
            print(f"{key:<22}" + "".join(
                f"{' / '.join(f'{v:.3g}' for v in row[k]) if k in row else '-':>30}"
                for k in cols))
        print("flagged per owner-step: " + ", ".join(
            f"{m} {r:.0%}" for m, r in s["flagged_rate"].items()))
        for line in s["honest_findings"]:
            print(f"  honest flagged: {line}")
    result["costs"] = c = costs(args.model, args.replicas)
    print(f"costs at {args.model} ({c['params']} parameters, one thread): digest "
          f"{c['digest_s'] * 1e3:.1f} ms per check; scoring one owner's shard "
          f"{c['score_s'] * 1e3:.1f} ms per step")
    if not args.skip_overhead:
        result["overhead"] = o = overhead(args)
        print(f"{'--verify':<10}{'CPU s/step':>12}{'tokens/s (wall)':>18}{'dp bytes/step':>16}")
        for verify in ("off", "auto"):
            print(f"{verify:<10}{o[verify]['cpu_s_per_step']:>12.3f}"
                  f"{o[verify]['tokens_per_s']:>18.0f}{o[verify]['dp_bytes_per_step']:>16.0f}")
        print(f"auto costs {o['cpu_cost_pct']:.1f} % CPU per step (wall-clock tokens/s: "
              f"{o['tokens_per_s_cost_pct']:.1f} %) and {o['bytes_cost_pct']:.4f} % bytes "
              f"against off (targets: <= 5 % tokens/s, <= 1 % bytes)")
    Path(args.out).write_text(json.dumps(result, indent=1, default=lambda x: None) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(math.isfinite(float(v)) for v in result["costs"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
