"""Benchmark: the honest spread of pipeline-link figures between replicas, which the
coordinator's check of activations (coordinator/integrity/linkwitness.py) sets its
thresholds from.

Trains the whole model in one process (AdamW, the product's warmup and cosine schedule, clip
1.0) on the bundled corpus; at each step, each of `--replicas` replicas takes its own
`--per-replica` sequences (same weights, other data, as data-parallel replicas do) in
`--micro-batches` micro-batches, and the root mean square of the activations at every layer
boundary and of their gradients is taken per replica over the step's micro-batches (what a
worker's `LinkTally` takes). Per step and window of `LINK_WINDOW` steps (the median over the
window, what workers report), it prints the largest ratio between a replica's figure and the
median of the replicas' (R >= 3) or between the two (R = 2), over training, and the same after
the first 20 steps. Writes bench/results/linkspread-<model>-<per-replica>.json.

`gain-K` rows: the ratio of the gradient a span of K layers sends back to the one it received
(window medians of each, as the coordinator sees them), a middle stage's gain. The loss's size
cancels out of it, which it does not out of the raw gradients. `--pretrain N` trains N steps
first and measures the rest at a tenth of the rate: a fitted model, whose batches' losses
spread wider than a fresh one's; with `--corpus-bytes N` only the corpus's first N bytes are
trained on, so that the model learns some of them by heart, as a fine-tune on a small
dataset does, and its batches' losses spread wider still.

Run: `python bench/linkspread.py --model gpt-tiny --steps 150 --per-replica 2 --micro-batches 1`
(minutes on one core).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

from agent.worker.data import stdlib_corpus
from agent.worker.stage import Stage, lm_loss
from dtfm.core.presets import get_preset
from dtfm.core.verify import LINK_WINDOW

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--per-replica", type=int, default=2, help="sequences per replica a step")
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pretrain", type=int, default=0,
                   help="steps trained before the measured ones (then at lr / 10)")
    p.add_argument("--corpus-bytes", type=int, default=0,
                   help="train on the corpus's first N bytes only (0: all of it)")
    return p.parse_args()


def train(args: argparse.Namespace) -> dict[str, np.ndarray]:
    """Per step, replica and boundary: the root mean square of activations and gradients."""
    torch.set_num_threads(1)
    spec = get_preset(args.model)
    torch.manual_seed(args.seed)
    model = Stage(spec, 0, spec.n_layers, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    toks = torch.from_numpy(stdlib_corpus().astype(np.int64))
    if args.corpus_bytes:
        toks = toks[:args.corpus_bytes]
    gen = np.random.default_rng(args.seed)
    bounds, per = spec.n_layers - 1, args.per_replica
    size = per // args.micro_batches
    figures = {k: np.zeros((args.steps, args.replicas, bounds)) for k in ("act", "actgrad")}
    for step in range(-args.pretrain, args.steps):
        if step < 0:  # pretraining: the schedule over its own steps
            at, of, lr = step + args.pretrain, args.pretrain, args.lr
        else:
            at, of, lr = step, args.steps, args.lr / (10 if args.pretrain else 1)
        warm = min(1.0, (at + 1) / 10)
        cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * at / of))
        for g in opt.param_groups:
            g["lr"] = lr * warm * cosine
        for r in range(args.replicas):
            starts = gen.integers(0, len(toks) - spec.seq_len - 1, per)
            seqs = torch.stack([toks[s:s + spec.seq_len + 1] for s in starts])
            ss = {k: np.zeros(bounds) for k in figures}
            n = np.zeros(bounds)
            for m in range(0, per, size):
                x = seqs[m:m + size]
                assert model.embed is not None and model.head is not None
                h, outs = model.embed(x[:, :-1]), []
                for i, layer in enumerate(model.layers.values()):
                    h = layer(h)
                    if i < bounds:
                        h.retain_grad()
                        outs.append(h)
                (lm_loss(model.head(h), x[:, 1:]) / (args.micro_batches * args.replicas)
                 ).backward()
                for b, o in enumerate(outs):
                    assert o.grad is not None
                    ss["act"][b] += float(o.detach().double().square().sum())
                    ss["actgrad"][b] += float(o.grad.double().square().sum())
                    n[b] += o.numel()
            if step >= 0:
                for k in figures:
                    figures[k][step, r] = np.sqrt(ss[k] / n)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if (step + 1) % 25 == 0:
            print(f"step {step + 1}/{args.steps}" + (" (pretraining)" if step < 0 else ""),
                  flush=True)
    return figures


def worst(h: np.ndarray, replicas: int, window: int, span: int = 0) -> list[float]:
    """Per judged step, the largest replica ratio over every boundary (`span` > 0: of the
    gains of every span of that many layers)."""
    h = h[:, :replicas, :]
    out = []
    for s in range(window - 1, len(h)):
        med = np.median(h[s - window + 1:s + 1], axis=0)
        if span:
            med = med[:, :-span] / med[:, span:]
        if replicas == 2:
            ratio = np.maximum(med[0], med[1]) / np.minimum(med[0], med[1])
        else:
            centre = np.median(med, axis=0)
            ratio = np.max(np.maximum(med / centre, centre / med), axis=0)
        out.append(float(ratio.max()))
    return out


def main() -> None:
    args = parse_args()
    figures = train(args)
    rows = []
    print(f"\n{'figure':<8} {'R':>2} {'window':>6} {'max':>6} {'p99':>6} {'max after 20':>13}")
    spans = range(1, figures["actgrad"].shape[2])
    kinds = [(k, h, 0) for k, h in figures.items()] + [
        (f"gain-{k}", figures["actgrad"], k) for k in spans]
    for kind, h, span in kinds:
        for reps in range(2, args.replicas + 1):
            for window in (1, LINK_WINDOW):
                w = worst(h, reps, window, span)
                row = {"figure": kind, "replicas": reps, "window": window, "max": max(w),
                       "p99": float(np.percentile(w, 99)), "max_after_20": max(w[20:])}
                rows.append(row)
                print(f"{kind:<8} {reps:>2} {window:>6} {row['max']:>6.3f} {row['p99']:>6.3f} "
                      f"{row['max_after_20']:>13.3f}")
    fitted = (f"-pretrain{args.pretrain}" if args.pretrain else "") + (
        f"-corpus{args.corpus_bytes}" if args.corpus_bytes else "")
    out = RESULTS / f"linkspread-{args.model}-{args.per_replica}{fitted}.json"
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
