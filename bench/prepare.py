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

Throughput is MB of UTF-8 text per second (the documents' text, not the JSON escaping). The
target is `agent prepare` at >= 0.8x `encode_batch`. Also checks that `agent prepare` wrote
exactly the baseline's token count plus one end-of-text per document.

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

from agent import prepare as prep  # noqa: E402
from agent.textinput import Piece, batches  # noqa: E402
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


def run_baseline(tok: Tokenizer, batches: list[list[str]], fast: bool) -> tuple[float, int]:
    encode = tok.encode_batch_fast if fast else tok.encode_batch
    t0 = time.perf_counter()
    tokens = 0
    for batch in batches:
        tokens += sum(len(e) for e in encode(batch, add_special_tokens=False))
    return time.perf_counter() - t0, tokens


def run_prepare(data: Path, tok_dir: Path, out: Path) -> tuple[float, int, int]:
    opts = prep.Options(inputs=[str(data)], out=str(out), tokenizer=str(tok_dir), force=True)
    t0 = time.perf_counter()
    prep.prepare(opts, io.StringIO())
    seconds = time.perf_counter() - t0
    meta = read_meta(out)
    assert meta is not None
    return seconds, sum(meta.tokens.values()), sum(meta.documents.values())


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
        runs: dict[str, list[float]] = {"encode_batch": [], "encode_batch_fast": [],
                                        "agent prepare": []}
        counts: dict[str, int] = {}
        plan: list[tuple[str, Callable[[], Any]]] = [
            ("encode_batch", lambda: run_baseline(tok, batches, fast=False)),
            ("encode_batch_fast", lambda: run_baseline(tok, batches, fast=True)),
            ("agent prepare", lambda: run_prepare(data, tok_dir, tmp / "out")),
        ]
        for r in range(args.repeats):
            for name, fn in plan:
                result = fn()
                runs[name].append(result[0])
                counts[name] = result[1]
                if name == "agent prepare":
                    counts["documents"] = result[2]
                print(f"  run {r + 1}: {name:<18} {result[0]:7.2f} s", flush=True)
    base_tokens = counts["encode_batch"]
    if counts["agent prepare"] != base_tokens + counts["documents"]:
        raise SystemExit(f"agent prepare wrote {counts['agent prepare']} tokens, the baseline "
                         f"{base_tokens} + {counts['documents']} end-of-text")
    median = {name: statistics.median(t) for name, t in runs.items()}
    rows = []
    print(f"\n{'way':<20}{'median s':>10}{'MB/s':>9}{'Mtok/s':>9}{'vs encode_batch':>17}")
    for name, seconds in median.items():
        row = {"way": name, "seconds": seconds, "all_seconds": runs[name],
               "mb_per_s": text_mb / seconds, "mtokens_per_s": base_tokens / seconds / 1e6,
               "ratio": median["encode_batch"] / seconds}
        rows.append(row)
        print(f"{name:<20}{seconds:>10.2f}{row['mb_per_s']:>9.2f}{row['mtokens_per_s']:>9.2f}"
              f"{row['ratio']:>16.2f}x")
    ratio = median["encode_batch"] / median["agent prepare"]
    print(f"\nagent prepare at {ratio:.2f}x encode_batch (target >= 0.8x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "when": datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "tokenizers": tokenizers.__version__,
                    "rayon_threads": os.environ.get("RAYON_NUM_THREADS", "default")},
        "input": {"documents": len(docs), "text_mb": text_mb, "vocab": tok.get_vocab_size(),
                  "tokens": base_tokens, "batches": len(batches)},
        "rows": rows, "prepare_vs_encode_batch": ratio,
    }, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
