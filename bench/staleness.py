"""Benchmark: what one step of staleness costs `--pipeline-delay 1`, rule by rule (issue 44).

`--pipeline-delay 1` trains step t on the weights after step t - 2 moved by step t - 1's
update as AdamW's moments predict it (agent/worker/delayed.py). Its validation loss trails
flushed training by 3-7 % on gpt-mini (docs/benchmarks.md, "Steps that do not flush"). This
replays the rule and its variants in one process, from the worker's own model, data,
optimizer and learning-rate schedule used as a library, so that a variant costs a minute
instead of a pipeline run and the cause of the gap can be read off:

- `flushed`: every update applied before the next step (what `--pipeline-delay 0` trains);
- `plain`: PipeDream-2BW as published, step t on the weights after t - 2 as they are;
- `predicted` (the product's rule), `predicted:G`: the prediction scaled by G (0.5 predicts
  half of the step, 2 twice it): where the gap is insensitive to G, what is missing is not
  the momentum's part of the step in flight but its new gradient's;
- `dc:L`: the product's rule plus delay compensation (DC-ASGD, Zheng et al. 2017): the
  gradient g computed at the copy w' is corrected to g + L * g * g * (w - w') before the
  update of the newest weights w;
- `every:K`: the product's rule, flushed every K steps as well (what `--sync-every K` does
  with replicas);
- any of them `@B1`: with AdamW's beta1 at B1 instead of 0.9.

The same replay is the one-process reference `tests/agent/worker/test_delayed.py` pins the
pipelined workers to (`replay`, rule `predicted`), so the two cannot drift apart.
Prints a table and writes bench/results/staleness.json.

    .venv/bin/python bench/staleness.py [--model gpt-mini] [--steps 48] [--batch 64]
        [--warmup-steps 10] [--seeds 0] [--variants flushed,plain,predicted,...]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from agent.worker.data import Sampler, load_splits, replica_slice, val_batches  # noqa: E402
from agent.worker.optim import lr_at, make_optimizer, set_lr  # noqa: E402
from agent.worker.stage import Stage, lm_loss  # noqa: E402
from dtfm.core.presets import get_preset  # noqa: E402
from dtfm.core.spec import TrainConfig  # noqa: E402

RESULTS = REPO / "bench" / "results" / "staleness.json"
DEFAULT_VARIANTS = "flushed,plain,predicted,predicted:0.5,predicted:2,dc:1e4,dc:1e5"


@dataclass(frozen=True)
class Rule:
    """How a step's weights are chosen and its gradient applied."""

    delayed: bool = True  # False: every update in before the next step (flushed)
    predict: float = 1.0  # the share of the in-flight AdamW step the copy is moved by
    compensate: float = 0.0  # DC-ASGD's lambda; 0: none
    beta1: float | None = None  # AdamW's first-moment decay; None: the product's
    flush_every: int = 0  # also flush every this many steps; 0: only where the worker does

    @classmethod
    def parse(cls, name: str) -> Rule:
        """`flushed`, `plain`, `predicted[:G]`, `dc:L` or `every:K` (the rule, flushed every
        K steps as well), each optionally `@B1` (AdamW's beta1 for that run: asynchrony acts
        as momentum, Mitliagkas et al. 2016)."""
        head, _, b1 = name.partition("@")
        kind, _, arg = head.partition(":")
        try:
            value = float(arg) if arg else None
            beta1 = float(b1) if b1 else None
        except ValueError:
            raise SystemExit(f"variant {name!r}: {arg or b1!r} is not a number") from None
        if beta1 is not None and not 0 <= beta1 < 1:
            raise SystemExit(f"variant {name!r}: beta1 must be in [0, 1)")
        if kind == "flushed" and value is None:
            return cls(delayed=False, beta1=beta1)
        if kind == "plain" and value is None:
            return cls(predict=0.0, beta1=beta1)
        if kind == "predicted":
            return cls(predict=1.0 if value is None else value, beta1=beta1)
        if kind == "dc" and value is not None:
            return cls(compensate=value, beta1=beta1)
        if kind == "every" and value is not None and value >= 1 and value == int(value):
            return cls(flush_every=int(value), beta1=beta1)
        raise SystemExit(f"unknown variant {name!r}: one of flushed, plain, predicted, "
                         f"predicted:G, dc:L, every:K, each with an optional @BETA1")


@dataclass(frozen=True)
class Replay:
    losses: list[float]  # each step's training loss
    val_loss: float  # after the last step; NaN without `eval_batches`


def replay(model_name: str, rule: Rule, steps: int, batch: int, warmup: int, seed: int,
           micro: int = 1, eval_batches: int = 0) -> Replay:
    """`model_name` trained by `rule` in one process, as the workers would train it on one
    replica (a flush at every warm-up step and at the last)."""
    cfg = TrainConfig(warmup_steps=warmup)
    spec = get_preset(model_name)
    torch.manual_seed(seed)
    model = Stage(spec, 0, spec.n_layers, seed)
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay, cfg.moments_dtype)
    if rule.beta1 is not None:
        for group in opt.param_groups:
            group["betas"] = (rule.beta1, group["betas"][1])
    train, val = load_splits(cfg.data_path, spec.vocab_size, "")
    sampler = Sampler(train, spec.seq_len, seed)
    live = list(model.parameters())
    pending: list[tuple[int, list[torch.Tensor], list[torch.Tensor]]] = []
    losses = []

    def apply(step: int, grads: list[torch.Tensor], used: list[torch.Tensor]) -> None:
        if rule.compensate:
            grads = [g + rule.compensate * g * g * (p.detach() - u)
                     for g, p, u in zip(grads, live, used, strict=True)]
        norm = math.sqrt(sum(float(g.float().pow(2).sum()) for g in grads))
        coef = min(1.0, cfg.grad_clip / (norm + 1e-6))
        for p, g in zip(live, grads, strict=True):
            p.grad = g * coef if coef < 1.0 else g
        set_lr(opt, lr_at(step - 1, cfg.lr, cfg.warmup_steps, steps))
        opt.step()
        opt.zero_grad(set_to_none=True)

    def copy(ahead: int | None) -> dict[str, torch.Tensor]:
        """The live weights, moved by AdamW's step `ahead` with the moments as they stand."""
        out = {}
        lr = 0.0 if ahead is None else \
            rule.predict * lr_at(ahead - 1, cfg.lr, cfg.warmup_steps, steps)
        for group in opt.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                w = p.detach().clone()
                if lr and (st := opt.state.get(p)) and "exp_avg" in st:
                    n = float(st["step"])
                    m, v = st["exp_avg"] / (1 - b1 ** n), st["exp_avg_sq"] / (1 - b2 ** n)
                    w = w * (1 - lr * group["weight_decay"]) - lr * m / (v.sqrt() + group["eps"])
                out[id(p)] = w
        return {n: out[id(p)].requires_grad_(True) for n, p in model.named_parameters()}

    for step in range(1, steps + 1):
        while pending and pending[0][0] <= step - 2:
            apply(*pending.pop(0))
        weights = copy(pending[0][0] if pending else None)  # the step before is in flight
        x, y = sampler.windows(replica_slice(sampler.next_global(batch), 0, 1))
        total = 0.0
        for xi, yi in zip(x.chunk(micro), y.chunk(micro), strict=True):
            loss = lm_loss(torch.func.functional_call(model, weights, (xi,)), yi)
            (loss / micro).backward()
            total += float(loss.detach())
        losses.append(total / micro)
        grads = [w.grad if w.grad is not None else torch.zeros_like(w)  # no loss reached it
                 for w in weights.values()]
        pending.append((step, grads, [w.detach() for w in weights.values()]))
        if not rule.delayed or step <= warmup or step == steps or (
                rule.flush_every and step % rule.flush_every == 0):  # a flush: all in
            for done in pending:
                apply(*done)
            pending.clear()
    val_loss = float("nan")
    if eval_batches:
        model.eval()
        windows = Sampler(val, spec.seq_len, seed)
        with torch.no_grad():
            val_loss = sum(float(lm_loss(model(x), y)) for x, y in (
                windows.windows(ids)
                for ids in val_batches(val, spec.seq_len, batch, eval_batches))) / eval_batches
    return Replay(losses, val_loss)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-mini")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--seeds", default="0", help="comma-separated")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.steps < 2 or args.batch < 1 or args.eval_batches < 1:
        raise SystemExit("--steps must be >= 2, --batch and --eval-batches >= 1")
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    names = [v for v in args.variants.split(",") if v]
    rules = {n: Rule.parse(n) for n in names}
    rows = []
    for seed in seeds:
        base = None
        for name, rule in rules.items():
            start = time.monotonic()
            got = replay(args.model, rule, args.steps, args.batch, args.warmup_steps, seed,
                         eval_batches=args.eval_batches)
            base = got.val_loss if base is None else base
            rows.append({"seed": seed, "variant": name, "val_loss": got.val_loss,
                         "vs_first_pct": 100 * (got.val_loss - base) / base,
                         "seconds": time.monotonic() - start})
            print(f"seed {seed}  {name:<16} val loss {got.val_loss:.4f}  "
                  f"{rows[-1]['vs_first_pct']:+6.2f} % against {names[0]}  "
                  f"({rows[-1]['seconds']:.0f} s)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "steps": args.steps,
                                    "batch": args.batch, "warmup_steps": args.warmup_steps,
                                    "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
