"""`coordinator plan` with compressed messages: the flags, the cost model's setting, and the
lines that show which codec every link got.

Owns turning `--pp-compress`, `--dp-compress` and `--codec-device` into the scheduler's
`compression.Compression` (the search then counts compressed bytes), and reporting its
per-link choice for the planned grid (`auto` picks per pipeline link and per data-parallel
group), beside what the same grid would cost uncompressed. Without these flags the plan and
its output are unchanged.
"""

from __future__ import annotations

import argparse
from typing import Any

from coordinator.scheduler import Network, plan_cost
from coordinator.scheduler.compression import CODEC_S_PER_GB, Compression
from dtfm import flags
from dtfm.core.spec import DTYPE_BYTES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("compression")
    g.add_argument("--pp-compress", default="none", metavar="CODEC",
                   type=flags.codec_setting("--pp-compress", topk=False),
                   help="pipeline activations and gradients: none, int8, int4, int4h (int4's "
                   "bytes after a Hadamard rotation of each block) or auto (per link, where "
                   "the saving beats the time to compress)")
    g.add_argument("--dp-compress", default="none", metavar="CODEC",
                   type=flags.codec_setting("--dp-compress", topk=True),
                   help="data-parallel gradients: none, int8, int4, int3 (3 bits, 9.1x), "
                   "topk:RATIO or auto (per data-parallel group; never top-k)")
    g.add_argument("--codec-device", choices=tuple(CODEC_S_PER_GB), default="cuda",
                   help="whose speed of compressing to count: "
                   + ", ".join(f"{k} {v:g} s per GB" for k, v in CODEC_S_PER_GB.items())
                   + " (default: %(default)s)")


def compression(args: argparse.Namespace) -> Compression | None:
    """The setting the flags ask for (None: nothing compressed, the paper's model).

    Uncompressed sizes: with `--model`, activations and gradients in `--dtype`; otherwise
    the paper's (fp16 activations, fp32 gradients) or what `--dp-gb`/`--pp-gb` give, read
    the same way."""
    pp, dp = getattr(args, "pp_compress", "none"), getattr(args, "dp_compress", "none")
    if pp == "none" and dp == "none":
        return None
    model_bytes = DTYPE_BYTES[args.dtype] if args.model is not None else None
    return Compression(pp, dp, codec_s_per_gb=CODEC_S_PER_GB[args.codec_device],
                       act_raw_bytes=model_bytes or 2, grad_raw_bytes=model_bytes or 4)


def describe(comp: Compression, net: Network, grid: list[list[int]], dp_gb: float,
             pp_gb: float) -> dict[str, Any]:
    """The `--json` fields: the setting, every link's codec, and the uncompressed cost."""
    chosen = comp.choose(net, grid)
    cost, dp, pp = plan_cost(net, grid, dp_gb, pp_gb)
    return {"compression": {"pp": comp.pp, "dp": comp.dp,
                            "codec_s_per_gb": comp.codec_s_per_gb,
                            "pp_links": chosen.pp, "dp_groups": chosen.dp,
                            "summary": chosen.summary(),
                            # null: always (a free codec); JSON has no infinity
                            "pp_thresholds_gbps": {
                                c: g if g < float("inf") else None
                                for c, g in comp.pp_thresholds_gbps()}
                            if comp.pp == "auto" else {}},
            "uncompressed": {"cost": cost, "dp_cost": dp, "pp_cost": pp}}


def format_lines(out: dict[str, Any]) -> list[str]:
    comp = out.get("compression")
    if not comp:
        return []
    plain = out["uncompressed"]
    lines = ["", f"compression: pipeline {comp['pp']}, data-parallel {comp['dp']} (codec "
             f"{comp['codec_s_per_gb']:g} s per GB); uncompressed this grid costs "
             f"{plain['cost']:.3f} (DP {plain['dp_cost']:.3f} + 2 x PP {plain['pp_cost']:.3f})"]
    if comp["pp_links"]:
        width = max(len(c) for row in comp["pp_links"] for c in row)
        lines.append("pipeline links (stage j -> j+1, one column per pipeline):")
        lines += [f"  {j:>2} -> {j + 1:<2} " + " ".join(f"{c:>{width}}" for c in row)
                  for j, row in enumerate(comp["pp_links"])]
    if comp.get("pp_thresholds_gbps"):
        why = ", ".join(f"{c} below {g:.3g} Gbit/s" if g else
                        f"{c} {'never' if g == 0 else 'always'}"
                        for c, g in comp["pp_thresholds_gbps"].items())
        lines.append(f"why: auto takes each pipeline link's codec by its bandwidth: {why} "
                     f"(each must cut the link's seconds per GB by a quarter over the one "
                     f"before, its codec time counted)")
    lines.append("data-parallel groups: "
                 + ", ".join(f"stage {j} {c}" for j, c in enumerate(comp["dp_groups"])))
    return lines
