"""Benchmark: LoRA adapters against full fine-tuning, same model, same tokens (issue 34).

Per variant (full fine-tuning, `--lora-rank` in `--ranks`, default 8 and 64) the same job
(same seed, steps and global batch, so the same tokens) runs once, and the table shows:
data-parallel bytes per step (priced, not measured: a ring all-reduce of each stage's fp32
trained parameters, summed over ranks; `agent local --json` does not carry the workers'
`dp_bytes`), tokens/s (the workers' own), the peak RSS of the
largest worker process (`getrusage` of a wrapper around the run: the largest descendant), the
optimizer + gradient bytes per stage the planner prices (trainable parameters x (4 gradient +
8 AdamW) bytes: `dtfm.core.lora.trained_params`), and the validation loss after the same
tokens; each against full fine-tuning.

This script runs the loopback form: `agent local` on this machine (gloo, `--stages` x
`--replicas` workers), where the network is free, so tokens/s shows compute and the data-parallel
bytes are exact but cost nothing. The issue's targets are for the 16-agent emulated WAN world
(`bench/wan.py`), which this script does not run yet: that run, and the step model's
prediction per variant (the coordinator's, for the planned grid), are still to do.

Writes bench/results/adapters.json.
Run (small, about 3 minutes on a shared 2-core machine):
`python bench/adapters.py --model gpt-mini --steps 6 --batch 8`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from dtfm.core import lora
from dtfm.core.layout import layer_splits
from dtfm.core.presets import get_preset

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "adapters.json"
TARGETS = {"dp_bytes_x": 100.0, "opt_grad_memory_x": 10.0, "tokens_per_s_x": 2.0}
# a wrapper that runs the command and reports the largest descendant's peak RSS (KiB)
_WRAP = ("import resource, subprocess, sys\n"
         "rc = subprocess.run(sys.argv[1:]).returncode\n"
         "print('maxrss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
         "file=sys.stderr)\n"
         "sys.exit(rc)\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-mini")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--ranks", default="8,64", help="LoRA ranks to compare, comma-separated")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def run_variant(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """One `agent local` run; its figures."""
    cmd = [sys.executable, "-c", _WRAP, sys.executable, "-m", "agent.local", "--json",
           "--model", args.model, "--stages", str(args.stages), "--replicas",
           str(args.replicas), "--steps", str(args.steps), "--batch", str(args.batch),
           "--micro-batches", str(args.micro_batches), "--lr", str(args.lr),
           "--eval-batches", "2", "--threads", "1",
           *(["--lora-rank", str(rank), "--lora-alpha", str(2 * rank)] if rank else [])]
    with tempfile.TemporaryDirectory(prefix="dtfm-bench-adapters-") as wd:
        print(f"  [{'full' if not rank else f'r{rank}'}] {' '.join(cmd[4:])}",
              file=sys.stderr, flush=True)
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                              env={"DTFM_LOG_LEVEL": "WARNING", "TMPDIR": wd,
                                   **{k: v for k, v in __import__("os").environ.items()
                                      if not k.startswith("DTFM_")}})
    if done.returncode != 0:
        raise RuntimeError(f"the run failed: {done.stderr[-2000:]}")
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    steps = [e for e in events if "step" in e]
    final = next(e for e in events if e.get("done"))
    rss = [int(line.split()[1]) for line in done.stderr.splitlines()
           if line.startswith("maxrss_kib")]
    spec = get_preset(args.model)
    split = layer_splits(spec.n_layers, args.stages, None)
    begin, trained = 0, []
    for n in split:
        trained.append(lora.trained_params(spec, begin, begin + n, rank))
        begin += n
    return {"variant": "full" if not rank else f"lora-r{rank}", "rank": rank,
            # a ring all-reduce of each stage's fp32 trained parameters: 2 (R-1)/R x bytes per
            # rank, summed over every rank (agent local's --json does not report the workers'
            # own dp_bytes; the planner's figure, pinned equal to the stage's trainable
            # parameters by tests/coordinator/scheduler/test_lora_pricing.py)
            "dp_bytes_per_step": sum(4 * t * 2 * (args.replicas - 1) for t in trained),
            "dp_bytes_source": "priced",
            "tokens_per_s": statistics.median(e["tokens_per_s"] for e in steps[1:] or steps),
            "peak_rss_mib": rss[-1] / 1024 if rss else None,
            "trained_params_max_stage": max(trained),
            "opt_grad_bytes_max_stage": max(trained) * (4 + 8),
            "val_loss": final.get("val_loss"), "steps_seen": len(steps)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ranks = [0, *(int(r) for r in args.ranks.split(",") if r.strip())]
    rows = [run_variant(args, r) for r in ranks]
    full = rows[0]
    for r in rows:
        r["dp_bytes_x"] = full["dp_bytes_per_step"] / r["dp_bytes_per_step"] \
            if r["dp_bytes_per_step"] else None
        r["opt_grad_memory_x"] = full["opt_grad_bytes_max_stage"] / r["opt_grad_bytes_max_stage"]
        r["tokens_per_s_x"] = r["tokens_per_s"] / full["tokens_per_s"]
    print(f"\nadapters, loopback: {args.model}, {args.stages} stages x {args.replicas} replicas, "
          f"{args.steps} steps of {args.batch} sequences")
    print(f"{'variant':<10}{'dp B/step':>12}{'x':>8}{'opt+grad B':>12}{'x':>7}{'tok/s':>9}"
          f"{'x':>6}{'peak MiB':>10}{'val loss':>10}")
    for r in rows:
        dx = f"{r['dp_bytes_x']:.0f}" if r["dp_bytes_x"] else "-"
        print(f"{r['variant']:<10}{r['dp_bytes_per_step']:>12.0f}{dx:>8}"
              f"{r['opt_grad_bytes_max_stage']:>12}{r['opt_grad_memory_x']:>7.1f}"
              f"{r['tokens_per_s']:>9.0f}{r['tokens_per_s_x']:>6.2f}"
              f"{r['peak_rss_mib'] or 0:>10.0f}{r['val_loss'] or float('nan'):>10.4f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"mode": "loopback", "args": vars(args), "targets": TARGETS,
                               "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
