"""Benchmark: `agent prepare` throughput against the `tokenizers` library's own batch encoder.

The input is made here, deterministically and with no download: every `.py` file of the
running interpreter's standard library is one document, repeated (in order) until the text
reaches `--mb` MB, written as one `.jsonl` file. The tokenizer is a byte-level BPE of
`--vocab` tokens trained with `tokenizers` on the first `--train-mb` MB of the same text.

Three ways to encode the same documents on this machine, each `--repeats` times, interleaved,
the median kept:

  encode_batch       `Tokenizer.encode_batch` over the documents already in memory, in
                     batches of the size `agent prepare` uses (its own Rust threads, all
                     cores, as `agent prepare` gets them); nothing read, converted or written
  encode_batch_fast  the same with `encode_batch_fast` (no offsets)
  agent prepare      the whole command: read the .jsonl from disk (page cache warm), encode,
                     convert the ids, split, write train.bin/val.bin/meta.json, rename

Throughput is MB of UTF-8 text per second (the documents' text, not the JSON escaping), of
wall time and of CPU time (all of the process's threads, the tokenizer's included: on a
machine other jobs load, what each way costs, where wall time says how much of the machine
it got). The target is `agent prepare` at >= 0.8x `encode_batch`. Also checks that
`agent prepare` wrote exactly the baseline's token count plus one end-of-text per document.

    python bench/prepare.py [--mb 40] [--vocab 16384] [--repeats 3]

Prints a table and writes bench/results/prepare.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python bench/prepare.py`
    sys.path.insert(0, str(REPO))

import tokenizers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from agent.commands import prepare as prep  # noqa: E402
from agent.commands.textinput import Piece, batches  # noqa: E402
from agent.worker.data import stdlib_files  # noqa: E402
from dtfm.core.tokenfiles import read_meta  # noqa: E402

RESULTS = REPO / "bench" / "results" / "prepare.json"


def make_documents(mb: float) -> list[str]:
    """The stdlib's sources, in order, repeated until their UTF-8 text reaches `mb` MB."""
    sources = [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files()]
    docs: list[str] = []
    size, want = 0, int(mb * 1e6)
    while size < want:
        for text in sources:
            if size >= want:
                break
            docs.append(text)
            size += len(text.encode("utf-8"))
    return docs


def train_tokenizer(docs: list[str], vocab: int, train_mb: float, into: Path) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    budget = int(train_mb * 1e6)
    sample: list[str] = []
    for d in docs:
        if budget <= 0:
            break
        sample.append(d)
        budget -= len(d)
    tok.train_from_iterator(sample, trainer=trainer)
    into.mkdir(parents=True, exist_ok=True)
    tok.save(str(into / "tokenizer.json"))
    return into


def in_batches(docs: list[str]) -> list[list[str]]:
    """The documents cut into batches as `agent prepare` cuts them."""
    return [[p.text for p in batch] for batch in batches(iter(Piece(d, True) for d in docs))]


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall s, CPU s of this process's threads, the tokenizer's included, result)."""
    w0, c0 = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - w0, time.process_time() - c0, result


def run_baseline(tok: Tokenizer, batches: list[list[str]], fast: bool) -> int:
    encode = tok.encode_batch_fast if fast else tok.encode_batch
    return sum(sum(len(e) for e in encode(batch, add_special_tokens=False))
               for batch in batches)


def run_prepare(data: Path, tok_dir: Path, out: Path) -> tuple[int, int]:
    opts = prep.Options(inputs=[str(data)], out=str(out), tokenizer=str(tok_dir), force=True)
    prep.prepare(opts, io.StringIO())
    meta = read_meta(out)
    assert meta is not None
    return sum(meta.tokens.values()), sum(meta.documents.values())


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=40.0, help="MB of text to encode")
    ap.add_argument("--vocab", type=int, default=16384, help="BPE vocabulary")
    ap.add_argument("--train-mb", type=float, default=4.0, help="MB the BPE is trained on")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    docs = make_documents(args.mb)
    text_mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    with tempfile.TemporaryDirectory(prefix="dtfm-bench-prepare-") as tmp_name:
        tmp = Path(tmp_name)
        tok_dir = train_tokenizer(docs, args.vocab, args.train_mb, tmp / "tok")
        tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
        data = tmp / "docs.jsonl"
        with data.open("w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
        data.read_bytes()  # warm the page cache: both sides start from text in memory
        batches = in_batches(docs)
        print(f"{len(docs):,} documents, {text_mb:.1f} MB of text ({data.stat().st_size / 1e6:.1f}"
              f" MB as .jsonl), BPE vocabulary {tok.get_vocab_size()}, {len(batches)} batches, "
              f"{os.cpu_count()} CPUs", flush=True)
        ways = ("encode_batch", "encode_batch_fast", "agent prepare")
        walls: dict[str, list[float]] = {w: [] for w in ways}
        cpus: dict[str, list[float]] = {w: [] for w in ways}
        counts: dict[str, int] = {}
        plan: list[tuple[str, Callable[[], Any]]] = [
            ("encode_batch", lambda: run_baseline(tok, batches, fast=False)),
            ("encode_batch_fast", lambda: run_baseline(tok, batches, fast=True)),
            ("agent prepare", lambda: run_prepare(data, tok_dir, tmp / "out")),
        ]
        for r in range(args.repeats):
            for name, fn in plan:
                wall, cpu, result = timed(fn)
                walls[name].append(wall)
                cpus[name].append(cpu)
                if name == "agent prepare":
                    counts[name], counts["documents"] = result
                else:
                    counts[name] = result
                print(f"  run {r + 1}: {name:<18} {wall:7.2f} s wall {cpu:7.2f} s CPU",
                      flush=True)
    base_tokens = counts["encode_batch"]
    if counts["agent prepare"] != base_tokens + counts["documents"]:
        raise SystemExit(f"agent prepare wrote {counts['agent prepare']} tokens, the baseline "
                         f"{base_tokens} + {counts['documents']} end-of-text")
    wall = {name: statistics.median(t) for name, t in walls.items()}
    cpu = {name: statistics.median(t) for name, t in cpus.items()}
    rows = []
    print(f"\n{'way':<20}{'wall s':>8}{'MB/s':>8}{'ratio':>7}{'CPU s':>8}{'MB/CPU-s':>10}"
          f"{'ratio':>7}   (medians; ratio: throughput vs encode_batch)")
    for name in ways:
        row = {"way": name, "wall_s": wall[name], "cpu_s": cpu[name],
               "all_wall_s": walls[name], "all_cpu_s": cpus[name],
               "mb_per_s": text_mb / wall[name], "mb_per_cpu_s": text_mb / cpu[name],
               "mtokens_per_s": base_tokens / wall[name] / 1e6,
               "ratio_wall": wall["encode_batch"] / wall[name],
               "ratio_cpu": cpu["encode_batch"] / cpu[name]}
        rows.append(row)
        print(f"{name:<20}{wall[name]:>8.2f}{row['mb_per_s']:>8.2f}{row['ratio_wall']:>6.2f}x"
              f"{cpu[name]:>8.2f}{row['mb_per_cpu_s']:>10.2f}{row['ratio_cpu']:>6.2f}x")
    ratio = wall["encode_batch"] / wall["agent prepare"]
    ratio_cpu = cpu["encode_batch"] / cpu["agent prepare"]
    load = os.getloadavg()[0]
    print(f"\nagent prepare at {ratio:.2f}x encode_batch's MB/s (wall), {ratio_cpu:.2f}x its MB "
          f"per CPU-second (target >= 0.8x); load average {load:.1f} on {os.cpu_count()} CPUs")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "when": datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "tokenizers": tokenizers.__version__,
                    "rayon_threads": os.environ.get("RAYON_NUM_THREADS", "default")},
        "input": {"documents": len(docs), "text_mb": text_mb, "vocab": tok.get_vocab_size(),
                  "tokens": base_tokens, "batches": len(batches)},
        "load_average_1min_at_end": load,
        "rows": rows, "prepare_vs_encode_batch": ratio, "prepare_vs_encode_batch_cpu": ratio_cpu,
    }, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
