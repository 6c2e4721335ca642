"""Benchmark: how well the receivers' check of an averaged shard separates (issue 43, item 2).

In-process, one thread, no network: R replicas of one model compute gradients on different
batches of the bundled corpus (2 sequences each: the noisiest a job trains with), cut into
the worker's buckets and equal shards (`data_parallel.plan_buckets`); each owner averages its
shard as `sharded` mode does, and every receiver scores every other owner's average with
`avgcheck.AverageChecker`, against its own copy, as a worker does. Owner 0 alters its average
from step `--onset` on (`badpeer.attack`: scale, flip, noise, zero, stale); the model takes an
AdamW step on the (honest) mean each step, so the scores follow training.

Prints, per model and R: min / max of each score over honest averages (every step of the
honest run), and per attack the share of attacked receiver-steps each check flags, and any
honest average flagged. The numbers behind `avgcheck`'s thresholds (docs/architecture.md,
"The averaged shard"). Run: `python bench/avgcheck.py` (about a minute on one core).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = ("honest", "scale", "flip", "noise", "zero", "stale")


def run(model: str, replicas: int, per: int, steps: int, onset: int) -> dict[str, Any]:
    import torch

    from agent.worker.avgcheck import AverageChecker, judge
    from agent.worker.badpeer import attack
    from bench.integrity import Trainer

    torch.manual_seed(0)
    t = Trainer(model)
    sampler, plan, grads = t.sampler, t.plan, t.grads

    r = replicas
    checkers = {(m, j): AverageChecker(r, j) for m in MODES for j in range(r)}
    held: dict[tuple[str, int], Any] = {}
    ranges: dict[str, list[float]] = {}
    flagged = {m: 0 for m in MODES}
    judged = {m: 0 for m in MODES}
    gen = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        ids = sampler.next_global(r * per)
        gs = [grads(ids[k * per:(k + 1) * per]) for k in range(r)]
        for mode in MODES:
            for i, _ in enumerate(plan):
                n = -(-gs[0][i].numel() // r)
                for k in range(r):
                    copies = [g[i][k * n:(k + 1) * n] for g in gs]
                    avg = sum(copies) / r
                    if k == 0 and mode != "honest":
                        if step < onset:
                            held[(mode, i)] = avg.clone()
                        else:
                            avg = attack(mode, avg, held.get((mode, i)), gen)
                    for j in range(r):
                        checkers[(mode, j)].add(k, avg, None if j == k else copies[j])
            for j in range(r):
                found = checkers[(mode, j)].scores()
                findings = judge(found)
                if mode == "honest":
                    flagged[mode] += bool(findings)
                    judged[mode] += 1
                    for s in found:
                        for key in ("cosine", "norm", "shape"):
                            v = getattr(s, key)
                            if not math.isnan(v):
                                ranges.setdefault(key, []).append(v)
                elif step >= onset and j != 0:
                    judged[mode] += 1
                    flagged[mode] += any(f.replica == 0 for f in findings)
        t.step(sampler.next_global(r * per))
    return {"honest": {k: (min(v), max(v)) for k, v in ranges.items()},
            "flagged": {m: flagged[m] / max(judged[m], 1) for m in MODES}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt-tiny,gpt-mini")
    p.add_argument("--replicas", default="2,3,4")
    p.add_argument("--per-replica", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--onset", type=int, default=10)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"
                                        / "avgcheck.json"))
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rows = []
    for model in args.models.split(","):
        for r in (int(v) for v in args.replicas.split(",")):
            out = run(model, r, args.per_replica, args.steps, args.onset)
            rows.append({"model": model, "replicas": r, **out})
            ranges = "  ".join(f"{k} {lo:.3g}..{hi:.3g}" for k, (lo, hi) in
                               sorted(out["honest"].items()))
            rates = ", ".join(f"{m} {v:.0%}" for m, v in out["flagged"].items())
            print(f"{model} R={r}: honest {ranges}\n    flagged per receiver-step: {rates}")
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
