"""Benchmark: a worker's peak memory when it imports its stage of a multi-GB Hugging Face
checkpoint (`--init-from`), against its stage's share of the model and the whole model.

Writes a random checkpoint of `--model` (default llama-1b, Llama-3.2-1B's shapes) in bf16 as
Hugging Face shards of about `--shard-gb` GB plus their index and config.json, with
`safetensors` directly (once; reused from `--dir`). Then, for each stage of an even
`--stages` split, a fresh process builds that stage (fp32, as a worker does), notes its RSS,
resets its peak (`/proc/self/clear_refs`), loads the stage's tensors with
`agent.worker.hfload.load_parts_from_hf` (memory-mapped, only the shards it needs) and
reads its peak RSS during the load (`VmHWM`; `ru_maxrss` would report the parent's peak
across exec). The load's cost is peak minus the RSS before it; the stage's own fp32
parameters are what any worker must hold anyway. (A worker that trains also builds its
optimizer; not counted here.)

Prints a table and writes bench/results/import_memory.json. Not a test: never run by CI.

    .venv/bin/python bench/import_memory.py [--model llama-1b] [--stages 4] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

CHILD = r"""
import json, sys, time
import torch
from agent.worker.hfload import load_parts_from_hf
from agent.worker.stage import Stage
from dtfm.core.hfdir import spec_from_dir

def status(key):  # kB; VmHWM is this process's own peak (ru_maxrss keeps the parent's)
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])

model_dir, begin, end = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
spec = spec_from_dir(model_dir, seq_len=2048)
base = status("VmRSS")
stage = Stage(spec, begin, end, 0)
built = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # the peak from here on: the load's
t0 = time.perf_counter()
load_parts_from_hf(stage.parts(), spec, model_dir)
took = time.perf_counter() - t0
params = sum(p.numel() for p in stage.parameters())
print(json.dumps({"base_kib": base, "built_kib": built, "loaded_kib": status("VmHWM"),
                  "stage_params": params, "load_s": took}))
"""

def bench_args(doc: str | None, *, model: str, directory: str,
               extra: Sequence[tuple[str, float]]) -> argparse.Namespace:
    """The flags both model benchmarks take (--model, --stages, --dir) and their own."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=model)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--dir", default=directory)
    for flag, default in extra:
        parser.add_argument(flag, type=type(default), default=default)
    return parser.parse_args()


def hf_shapes(spec: Any, indices: Iterable[int]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(Hugging Face name, shape in the checkpoint) of every parameter of parts `indices`,
    from parts built on the meta device (no memory)."""
    import torch

    from agent.worker.model import make_part
    from dtfm.core.hfconfig import part_tensors

    for index in indices:
        with torch.device("meta"):
            part = make_part(spec, index)
        names = part_tensors(spec, index)
        for name, p in part.named_parameters():
            t = names[name]
            yield t.name, tuple(reversed(p.shape)) if t.transpose else tuple(p.shape)


def write_checkpoint(model: str, out: Path, shard_gb: float) -> dict:
    """A random bf16 checkpoint of preset `model` in Hugging Face's sharded layout."""
    import torch
    from safetensors.torch import save_file

    from dtfm.core.hfconfig import EMBEDDING_INDEX, HEAD_INDEX, hf_config_from_spec
    from dtfm.core.presets import get_preset

    spec = get_preset(model)
    if (out / "model.safetensors.index.json").is_file():
        return {"spec": spec, "bytes": json.loads(
            (out / "model.safetensors.index.json").read_text())["metadata"]["total_size"]}
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config_from_spec(spec)
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, limit = 0, int(shard_gb * 2**30)
    for name, shape in hf_shapes(spec, (EMBEDDING_INDEX, *range(spec.n_layers), HEAD_INDEX)):
        value = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if size + value.nbytes > limit and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    total, weight_map = 0, {}
    for k, tensors in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, out / name, metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
        print(f"  wrote {name}", file=sys.stderr, flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return {"spec": spec, "bytes": total}


def main() -> int:
    args = bench_args(__doc__, model="llama-1b", directory="/tmp/dtfm-bench-import",
                      extra=[("--shard-gb", 1.0)])
    from dtfm.core.layout import layer_ranges

    t0 = time.perf_counter()
    made = write_checkpoint(args.model, Path(args.dir), args.shard_gb)
    spec = made["spec"]
    print(f"checkpoint: {args.dir} ({made['bytes'] / 2**30:.2f} GiB bf16, "
          f"{time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    whole_fp32 = spec.param_count() * 4
    rows = []
    for stage, (begin, end) in enumerate(layer_ranges(spec.n_layers, args.stages)):
        out = subprocess.run([sys.executable, "-c", CHILD, args.dir, str(begin), str(end)],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        stage_bytes = r["stage_params"] * 4
        rows.append({"stage": stage, "layers": [begin, end], "stage_params": r["stage_params"],
                     "stage_fp32_mib": stage_bytes / 2**20,
                     "rss_built_mib": r["built_kib"] / 1024,
                     "rss_peak_mib": r["loaded_kib"] / 1024,
                     "load_extra_mib": (r["loaded_kib"] - r["built_kib"]) / 1024,
                     "peak_over_stage": r["loaded_kib"] * 1024 / stage_bytes,
                     "peak_over_whole_fp32": r["loaded_kib"] * 1024 / whole_fp32,
                     "load_s": r["load_s"]})
    print(f"{args.model}: {spec.param_count() / 1e9:.2f} B params, whole model "
          f"{whole_fp32 / 2**30:.2f} GiB fp32, checkpoint {made['bytes'] / 2**30:.2f} GiB bf16")
    print(f"{'stage':>5} {'layers':>8} {'stage fp32':>11} {'RSS built':>10} {'RSS peak':>9} "
          f"{'load +':>8} {'peak/stage':>10} {'peak/whole':>10} {'load s':>7}")
    for r in rows:
        print(f"{r['stage']:>5} {r['layers'][0]:>3}-{r['layers'][1] - 1:<4} "
              f"{r['stage_fp32_mib']:>8.0f} MiB {r['rss_built_mib']:>6.0f} MiB "
              f"{r['rss_peak_mib']:>5.0f} MiB {r['load_extra_mib']:>4.0f} MiB "
              f"{r['peak_over_stage']:>10.2f} {r['peak_over_whole_fp32']:>10.2f} "
              f"{r['load_s']:>7.1f}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "import_memory.json"
    path.write_text(json.dumps({"model": args.model, "stages": args.stages,
                                "checkpoint_bytes": made["bytes"], "whole_fp32_bytes": whole_fp32,
                                "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
