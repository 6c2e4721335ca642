"""Benchmark: peak memory of `agent prepare` on one long document, `.jsonl` against `.txt`.

A long document once reached the tokenizer whole when it was a `.jsonl` line (or a
`.parquet` row), and the tokenizer's working memory is some 170 bytes per character: a 20 MB
line peaked at 3.5 GB. `agent.commands.textinput` now cuts every document into pieces as it cut a
`.txt`; this measures what that buys.

For each `--mb` size the text is made here, deterministically and with no download: the
running interpreter's standard-library `.py` files, in sorted order, concatenated until the
text reaches the size, written once as a one-line `.jsonl` (`{"text": ...}`) and once as a
`.txt`. The tokenizer is a byte-level BPE of `--vocab` tokens (GPT-2's scheme, what
`--train-tokenizer` makes) trained on the first MB of the same text. Each file is prepared by
`python -m agent prepare` in a child process; its peak resident memory (`ru_maxrss` from
`wait4`, the child alone) and wall time are recorded, and the two outputs' ids are compared
(they must be equal: the `.jsonl` document is the `.txt` document). The child is started by
a small launcher process, not by this one: a child's `ru_maxrss` counts the memory of the
process it was forked from until it execs, and this one holds the texts.

`--repo DIR` runs the `agent` package of another checkout (e.g. `git archive` of an older
commit unpacked in /tmp) to measure before and after on the same machine and text.

    python bench/prepare_memory.py [--mb 4 16] [--vocab 4096] [--repo DIR] [--out FILE]

Prints a table and writes bench/results/prepare_memory.json (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python bench/prepare_memory.py`
    sys.path.insert(0, str(REPO))

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from agent.worker.data import stdlib_files  # noqa: E402

RESULTS = REPO / "bench" / "results" / "prepare_memory.json"
KINDS = (".jsonl", ".txt")
# runs argv[1:] and prints its exit status and peak RSS (KiB); small, so that what it forks
# starts small (see the module's docstring)
LAUNCHER = ("import os, subprocess, sys\n"
            "child = subprocess.Popen(sys.argv[1:])\n"
            "_, status, usage = os.wait4(child.pid, 0)\n"
            "print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)\n")


def make_text(mb: float) -> str:
    """At least `mb` MB (10^6 bytes of UTF-8) of standard-library source, cut to that size."""
    want = int(mb * 1e6)
    parts: list[str] = []
    size = 0
    files = stdlib_files()
    while size < want:
        for p in files:
            text = p.read_text(encoding="utf-8", errors="replace")
            parts.append(text)
            size += len(text.encode("utf-8"))
            if size >= want:
                break
    return "".join(parts).encode("utf-8")[:want].decode("utf-8", errors="ignore")


def save_tokenizer(text: str, vocab: int, into: Path) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                  special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text[:1_000_000].splitlines(keepends=True), trainer=trainer)
    into.mkdir(parents=True, exist_ok=True)
    tok.save(str(into / "tokenizer.json"))
    return into


def prepare_in_child(repo: Path, source: Path, tok: Path, out: Path) -> dict[str, Any]:
    """`python -m agent prepare` on `source`: its peak RSS (MiB), wall time, exit status."""
    env = {**os.environ, "PYTHONPATH": str(repo)}
    cmd = [sys.executable, "-m", "agent", "prepare", "--input", str(source), "--out",
           str(out), "--tokenizer", str(tok)]
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", LAUNCHER, *cmd], cwd=repo, env=env,
                          capture_output=True, text=True)
    wall = time.monotonic() - t0
    code, kib = (int(x) for x in done.stdout.split()[-2:])  # prepare's own stdout is first
    if done.returncode != 0 or code != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({code}):\n{done.stderr[-2000:]}")
    meta = json.loads((out / "meta.json").read_text())
    return {"peak_rss_mib": round(kib / 1024, 1), "wall_s": round(wall, 2),
            "tokens": sum(meta["tokens"].values())}


def ids(out: Path) -> bytes:
    return (out / "train.bin").read_bytes() + (out / "val.bin").read_bytes()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, nargs="+", default=[4.0, 16.0],
                   help="document sizes in MB (default: 4 16)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--repo", type=Path, default=REPO,
                   help="the checkout whose `agent` runs (default: this one)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--label", default="",
                   help="what --repo is, for the JSON (default: its git commit)")
    args = p.parse_args(argv)

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dtfm-prepare-memory-") as tmp_name:
        tmp = Path(tmp_name)
        texts = {mb: make_text(mb) for mb in args.mb}
        tok = save_tokenizer(texts[min(args.mb)], args.vocab, tmp / "tok")
        for mb, text in texts.items():
            (tmp / "one.jsonl").write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
            (tmp / "one.txt").write_text(text, encoding="utf-8")
            outs = {}
            for kind in KINDS:
                outs[kind] = tmp / f"out-{mb:g}{kind}"
                row = {"mb": mb, "input": kind, "chars": len(text),
                       **prepare_in_child(args.repo, tmp / f"one{kind}", tok, outs[kind])}
                rows.append(row)
            same = ids(outs[".jsonl"]) == ids(outs[".txt"])
            for row in rows[-len(KINDS):]:
                row["same_ids_as_txt"] = same

    print(f"agent prepare on one document ({args.repo}), peak RSS of the child process")
    print(f"{'MB':>6} {'input':>7} {'peak RSS MiB':>13} {'wall s':>7} {'tokens':>11} "
          f"{'same ids':>9}")
    for r in rows:
        print(f"{r['mb']:>6g} {r['input']:>7} {r['peak_rss_mib']:>13,.0f} {r['wall_s']:>7.1f} "
              f"{r['tokens']:>11,} {'yes' if r['same_ids_as_txt'] else 'NO':>9}")
    commit = subprocess.run(["git", "-C", str(args.repo), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    result = {"benchmark": "prepare_memory", "date": datetime.now().isoformat(timespec="seconds"),
              "repo": str(args.repo), "label": args.label or commit or None,
              "vocab": args.vocab,
              "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                          "load_avg": os.getloadavg()},
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r["same_ids_as_txt"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
