"""`coordinator plan` for uneven devices: the flags, the layer split, and its lines of output.

Owns reading per-device speed and memory for offline planning (`--speeds`, `--flops`,
`--memory`, `--devices FILE`), handing them with the searched grid to the scheduler's
`compute.plan_split`, checking memory (a plan that cannot fit raises `DoesNotFit`, which
`coordinator plan` reports as one line and exit code 2), and printing the split. The search
itself is `coordinator/commands/plan.py`'s; without these flags its output is unchanged.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from coordinator.scheduler import Network, plan_compress
from coordinator.scheduler.compute import Devices, Workload, plan_split
from coordinator.scheduler.memory import check_fit, gib, stages_bytes
from dtfm import flags
from dtfm.core.presets import get_preset

DEFAULT_FLOPS = 100e12  # what `--speeds` factors multiply: a V100-class device in fp16
SPLIT_SECONDS = 10.0  # the compute-aware grid search's limit without --search-seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("uneven devices (need --model)")
    g.add_argument("--speeds", default="", metavar="F,F,...",
                   help="relative speed of every device, in device order, e.g. 2,2,1,1: "
                   "faster devices get more layers")
    g.add_argument("--flops", type=flags.number(float, 0, above=True), default=None,
                   help=f"FLOP/s of a device of speed 1 ({DEFAULT_FLOPS:.0e}), or of every "
                   "device without --speeds")
    g.add_argument("--memory", type=flags.number(int, 0, above=True), default=None,
                   metavar="BYTES", help="memory of every device (default: unlimited)")
    g.add_argument("--devices", default="", metavar="FILE",
                   help='JSON {"flops": [...], "memory_bytes": [...]}, one entry per device')
    flags.add_train_arg(g, "schedule")  # the job's flags, so the plan describes a job
    flags.add_train_arg(g, "moments_dtype")


def wanted(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "speeds", "") or getattr(args, "devices", "")
                or getattr(args, "flops", None) or getattr(args, "memory", None))


def _floats(text: str, what: str, n: int) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if len(values) != n or min(values) <= 0:
        raise ValueError(f"{what} needs {n} numbers > 0 (one per device), got {len(values)}")
    return values


def _from_file(path: str, n: int) -> tuple[list[float] | None, list[int] | None]:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read --devices {path!r}: {e}") from None
    out: list[Any] = []
    for key in ("flops", "memory_bytes"):
        values = obj.get(key)
        if values is not None and (not isinstance(values, list) or len(values) != n
                                   or not all(isinstance(v, int | float) and v > 0
                                              for v in values)):
            raise ValueError(f"--devices {path!r}: {key!r} must list {n} numbers > 0")
        out.append(values)
    return out[0], None if out[1] is None else [int(v) for v in out[1]]


def devices(args: argparse.Namespace, n: int) -> Devices:
    """Speeds and memory of the `n` devices from the flags (memory 0: unlimited)."""
    flops, memory = _from_file(args.devices, n) if args.devices else (None, None)
    if flops is None:
        base = args.flops or DEFAULT_FLOPS
        speeds = _floats(args.speeds, "--speeds", n) if args.speeds else [1.0] * n
        flops = [base * s for s in speeds]
    if memory is None:
        memory = [args.memory or 0] * n
    return Devices.of(flops, memory)


def workload(args: argparse.Namespace, stages: int, replicas: int, batch: int) -> Workload:
    """One step of `--model` as the flags describe it (the split and the polish simulate it),
    compressed as `--pp-compress`/`--dp-compress` ask, as `coordinator start` prices it."""
    return Workload(get_preset(args.model), stages, replicas, batch, args.micro_batches,
                    args.schedule, "fp32" if args.dtype == "fp32" else "bf16", args.dtype,
                    moments_dtype=args.moments_dtype,
                    sync_every=getattr(args, "sync_every", 1) or 1,  # auto: priced per H later
                    outer_delay=getattr(args, "outer_delay", 0),
                    pipeline_delay=getattr(args, "pipeline_delay", 0),
                    lora_rank=getattr(args, "lora_rank", 0),
                    lora_targets=getattr(args, "lora_targets", ""),
                    compression=plan_compress.compression(args))


def split(args: argparse.Namespace, net: Network, grid: list[list[int]], stages: int,
          replicas: int, batch: int, dev: Devices | None = None) -> dict[str, Any]:
    """The layer split (and possibly refined grid) for the devices (`dev`: `devices(args)`
    when the caller already built it); raises `DoesNotFit`."""
    if args.model is None:
        raise ValueError("--speeds, --flops, --memory and --devices need --model (the layers "
                         "to split)")
    work = workload(args, stages, replicas, batch)
    dev = dev if dev is not None else devices(args, net.size)
    placed = plan_split(net, grid, work, dev, seconds=args.search_seconds or SPLIT_SECONDS)
    need = stages_bytes(work.memory(), placed.best.splits)
    check_fit(placed.best.grid, need, dev.memory.tolist(), moments_dtype=args.moments_dtype)
    step = placed.best.step
    return {"grid": placed.best.grid, "layer_splits": placed.best.splits,
            "split_reason": placed.reason, "stage_bytes": need,
            "flops": dev.flops.tolist(), "memory_bytes": dev.memory.tolist(),
            "predicted_step_s": step.step_s, "predicted_compute_s": step.compute_s,
            "split_evaluated": placed.evaluated}


def format_lines(out: dict[str, Any]) -> list[str]:
    """The split, each stage's slowest device and memory, and the predicted step."""
    if "layer_splits" not in out:
        return []
    lines = ["", f"layer split ({out['split_reason']}): "
             + " ".join(map(str, out["layer_splits"]))]
    for j, (row, layers) in enumerate(zip(out["grid"], out["layer_splits"], strict=True)):
        slowest = min(out["flops"][d] for d in row)
        lines.append(f"  stage {j}: {layers} layers, slowest device {slowest / 1e12:.3g} "
                     f"TFLOP/s, needs {gib(out['stage_bytes'][j])} per device")
    lines.append(f"predicted step {out['predicted_step_s']:.3f} s (compute on the busiest "
                 f"device {out['predicted_compute_s']:.3f} s)")
    return lines
