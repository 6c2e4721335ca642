"""Benchmark: the time to assemble a Hugging Face directory from a 1.3B-parameter job's stage
checkpoints (`dtfm.core.hfexport.write_export`, what `coordinator export` and `--export-dir`
run once the stages' files are on one disk).

Writes `--stages` stage files of `--model` (default gpt-1.3b) as a job's checkpoints hold
them: fp32 safetensors under Hugging Face names (values are zeros: the assembler copies
bytes and reads only headers), then exports them `--repeat` times into a fresh directory and
reports seconds and GB/s. Prints a table and writes bench/results/export.json. Not a test.

    .venv/bin/python bench/export.py [--model gpt-1.3b] [--stages 4] [--dir DIR]
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python bench/export.py`
    sys.path.insert(0, str(REPO))

from bench.import_memory import RESULTS, bench_args, hf_shapes  # noqa: E402


def stage_files(model: str, stages: int, root: Path) -> list:
    import torch
    from safetensors.torch import save_file

    from dtfm.core.hfconfig import EMBEDDING_INDEX, HEAD_INDEX
    from dtfm.core.hfexport import StageFile
    from dtfm.core.layout import layer_ranges
    from dtfm.core.presets import get_preset

    spec = get_preset(model)
    files = []
    for stage, (begin, end) in enumerate(layer_ranges(spec.n_layers, stages)):
        path = root / f"stage-{stage}.safetensors"
        files.append(StageFile(stage, path))
        if path.is_file():
            continue
        parts = [*([EMBEDDING_INDEX] if begin == 0 else []), *range(begin, end),
                 *([HEAD_INDEX] if end == spec.n_layers else [])]
        tensors = {name: torch.zeros(shape, dtype=torch.float32)
                   for name, shape in hf_shapes(spec, parts)}
        save_file(tensors, path, metadata={"format": "pt"})
        print(f"  wrote {path} ({path.stat().st_size / 2**30:.2f} GiB)", file=sys.stderr)
    return [spec, files]


def main() -> int:
    args = bench_args(__doc__, model="gpt-1.3b", directory="/tmp/dtfm-bench-export",
                      extra=[("--repeat", 2)])
    from dtfm.core.hfexport import write_export

    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    spec, files = stage_files(args.model, args.stages, root)
    size = sum(f.path.stat().st_size for f in files)
    runs = []
    for _ in range(args.repeat):
        out = root / "export"
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        write_export(out, spec, files)
        runs.append(time.perf_counter() - t0)
    shutil.rmtree(root / "export", ignore_errors=True)
    best = min(runs)
    print(f"{'model':>10} {'params':>8} {'stages':>6} {'GiB':>6} {'seconds':>8} {'GB/s':>6}")
    for s in runs:
        print(f"{args.model:>10} {spec.param_count() / 1e9:>7.2f}B {args.stages:>6} "
              f"{size / 2**30:>6.2f} {s:>8.1f} {size / 1e9 / s:>6.2f}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "export.json"
    path.write_text(json.dumps({"model": args.model, "params": spec.param_count(),
                                "stages": args.stages, "bytes": size, "seconds": runs,
                                "best_gb_per_s": size / 1e9 / best}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
