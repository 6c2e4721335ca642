"""Benchmark: the compute each pipeline codec costs, seconds per MB of fp32 activations.

Owns the second half of `bench/compress.py`'s int4h comparison (the first is the loss): what
compressing plus decompressing one message costs on this machine's device, for a message as
large as a pipeline's (a micro-batch's activations), in the direction each codec is used:
forward (rounded to nearest) and backward (int4h: stochastic rounding, seeded per message).
The scheduler quotes a codec's time per GB (`coordinator.scheduler.compression`); this is
where its relative figures come from.

Run: `python bench/codec_cost.py [--device cuda] [--mb 16] [--threads 1]` (seconds on a CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from agent.worker.compress import make_codec

CODECS = ("int8", "int4", "int4h")


def measure(name: str, x: torch.Tensor, key: int | None, repeats: int) -> float:
    """Median seconds of one encode + decode of `x` (after a warm-up)."""
    codec = make_codec(name, seed=1)
    assert codec is not None
    times = []
    for r in range(repeats + 1):
        if x.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        codec.decode(codec.encode(x, None if key is None else key + r), x.numel())
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def costs(device: str = "cpu", mb: float = 16.0, repeats: int = 5,
          threads: int = 1) -> dict[str, dict[str, float]]:
    """Seconds per MB of fp32 input, forward and backward, per codec, on `threads` CPU
    threads (a worker runs one)."""
    torch.set_num_threads(threads)
    n = int(mb * 1e6 / 4)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    out = {}
    for name in CODECS:
        fwd = measure(name, x, None, repeats) / mb
        bwd = measure(name, x, 0, repeats) / mb
        out[name] = {"forward_s_per_mb": fwd, "backward_s_per_mb": bwd,
                     "mean_s_per_mb": (fwd + bwd) / 2}
    return out


def table(rows: dict[str, dict[str, float]]) -> str:
    base = rows["int4"]["mean_s_per_mb"]
    lines = [f"{'codec':<8}{'fwd ms/MB':>11}{'bwd ms/MB':>11}{'mean':>8}{'x int4':>8}"]
    for name, r in rows.items():
        lines.append(f"{name:<8}{r['forward_s_per_mb'] * 1e3:>11.3f}"
                     f"{r['backward_s_per_mb'] * 1e3:>11.3f}{r['mean_s_per_mb'] * 1e3:>8.3f}"
                     f"{r['mean_s_per_mb'] / base:>8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--mb", type=float, default=16.0, help="message size, MB of fp32")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (a worker uses 1)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"
                                        / "codec_cost.json"))
    args = p.parse_args(argv)
    rows = costs(args.device, args.mb, args.repeats, args.threads)
    print(table(rows))
    Path(args.out).write_text(json.dumps({"args": vars(args), "s_per_mb": rows}, indent=1)
                              + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
