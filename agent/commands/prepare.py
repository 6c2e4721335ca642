"""`agent prepare`: text files in, the token directory `--data` trains on out.

Owns turning `.txt`, `.jsonl` and `.parquet` files into `train.bin`, `val.bin` and
`meta.json` (`dtfm.core.tokenfiles`) with a Hugging Face tokenizer (`--tokenizer`) or a
byte-level BPE trained on the same input (`--train-tokenizer VOCAB`).

- Documents: a `.txt` file is one document; a `.jsonl` line or a `.parquet` row is one
  document, its text in `--text-field`. The tokenizer's end-of-text token follows every
  document. No BOS or other special token is added (`add_special_tokens=False`).
- Streaming: `agent.commands.textinput` reads the text in pieces (a long document, `.txt`, `.jsonl`
  line or `.parquet` row alike, is cut before a word's leading space, where the usual
  pre-tokenizers split anyway, so the ids are those of the whole document; no end-of-text
  between its pieces; a tokenizer that would encode the cut text differently is named on
  stderr) and batches them; each batch is
  encoded with the `tokenizers` library's batch encoder (its own threads), `IN_FLIGHT`
  batches at once on background threads while the next is read, so memory stays bounded
  whatever the input's size and reading overlaps encoding. Ids are written, in order, as
  each batch returns.
- Determinism: files are taken in sorted order, pieces are cut by position, batches do not
  change any id, and the split is by document index: the same input and flags give the same
  bytes. Document `d` goes to val when `floor((d+1)F) > floor(dF)` (`F`: `--val-fraction`):
  every 1/F-th document. Fewer than 1/F documents: the last F of the train tokens instead
  (`val_split: tail` in `meta.json`).
- Atomic: everything is written into a hidden sibling directory of `--out`, renamed onto it
  at the end; a failed or interrupted run (Ctrl-C, or SIGTERM, which `run` turns into the
  same unwinding) removes it, and a killed one (SIGKILL) leaves only that hidden
  `.NAME.partial-*` directory, never an `--out` that looks complete.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import secrets
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import IO, Any

import numpy as np

from agent.commands.textinput import (
    PIECE_CHARS,
    Piece,
    PrepareError,
    Reader,
    Source,
    batches,
    cut,
    find_sources,
)
from dtfm import flags
from dtfm.core.tokenfiles import (
    SPLITS,
    TOKENIZER_FILES,
    TOKENIZER_NAME,
    TokenMeta,
    dtype_for_vocab,
    tokenizer_hash,
    write_meta,
)
from dtfm.core.words import counted
from dtfm.procs import TERMINATED_STATUS, Terminated, sigterm_unwinds
from dtfm.progressline import ProgressLine

KNOWN_EOT = ("<|endoftext|>", "<|end_of_text|>", "</s>")  # tried before the configured eos
TRAINED_EOT = "<|endoftext|>"
IN_FLIGHT = 2  # batches being encoded at once
DEFAULT_VAL_FRACTION = 0.005
MIN_TRAINED_VOCAB = 257  # 256 byte symbols and the end-of-text token
MAX_TRAINED_VOCAB = 1 << 22
# encoded whole and cut as agent.textinput cuts (every cut before a word's leading space): a
# tokenizer whose ids differ changes a token at each cut of a long document
CUT_PROBE = ("It was the best of times, it was the worst of times;\n  the age of wisdom, "
             "(1859) and \"folly\"... 42 epochs\tof belief.")
CUT_PROBE_PIECE = 16


@dataclass
class Options:
    """What `agent prepare` was asked to do (its flags, typed)."""

    inputs: list[str]
    out: str
    tokenizer: str = ""  # a directory holding tokenizer.json, or the file
    train_vocab: int = 0  # > 0: train a byte-level BPE of this vocabulary instead
    text_field: str = "text"
    val_fraction: float = DEFAULT_VAL_FRACTION
    eot_token: str = ""
    force: bool = False

    def validate(self) -> None:
        if bool(self.tokenizer) == bool(self.train_vocab):
            raise PrepareError("give exactly one of --tokenizer DIR|tokenizer.json and "
                               "--train-tokenizer VOCAB")
        if self.train_vocab and not MIN_TRAINED_VOCAB <= self.train_vocab <= MAX_TRAINED_VOCAB:
            raise PrepareError(f"--train-tokenizer {self.train_vocab}: a byte-level BPE needs a "
                               f"vocabulary from {MIN_TRAINED_VOCAB} (256 bytes and the "
                               f"end-of-text token) to {MAX_TRAINED_VOCAB}")
        if not 0 < self.val_fraction <= 0.5:
            raise PrepareError(f"--val-fraction must be > 0 and <= 0.5, got {self.val_fraction}")
        if not self.text_field:
            raise PrepareError("--text-field must name a field")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", action="append", required=True, metavar="FILE|DIR",
                   help="a .txt, .jsonl or .parquet file, or a directory searched for them "
                   "(recursively, in sorted order); repeat for more")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="writes train.bin, val.bin, meta.json and the tokenizer files here")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--tokenizer", default="", metavar="DIR|tokenizer.json",
                       help="a Hugging Face tokenizer: a directory holding tokenizer.json "
                       "(e.g. the model's), or the file")
    which.add_argument("--train-tokenizer", dest="train_vocab", metavar="VOCAB", default=0,
                       type=flags.number(int, MIN_TRAINED_VOCAB, maximum=MAX_TRAINED_VOCAB),
                       help="train a byte-level BPE of VOCAB tokens on the input and save it "
                       "in --out")
    p.add_argument("--text-field", default="text", metavar="FIELD",
                   help="the field holding the text in .jsonl and .parquet (default: text)")
    p.add_argument("--val-fraction", default=DEFAULT_VAL_FRACTION, metavar="F",
                   type=flags.number(float, 0, above=True, maximum=0.5),
                   help="share of the documents that go to val.bin (default %(default)g)")
    p.add_argument("--eot-token", default="", metavar="TOKEN",
                   help="the token put between documents (default: <|endoftext|>, "
                   "<|end_of_text|> or </s>, whichever the tokenizer has, else the eos_token "
                   "of its tokenizer_config.json)")
    p.add_argument("--force", action="store_true",
                   help="replace --out even if it exists and is not empty")
    p.add_argument("--json", action="store_true", help="print meta.json when done")
    flags.add_common_args(p, config_file=False)


def run(args: argparse.Namespace) -> int:
    """`agent prepare`: 0 on success, 2 on bad input or a failed write, 130 interrupted
    (Ctrl-C), 143 terminated (SIGTERM: a service manager's or `kill`'s stop)."""
    opts = Options(inputs=args.input, out=args.out, tokenizer=args.tokenizer,
                   train_vocab=args.train_vocab, text_field=args.text_field,
                   val_fraction=args.val_fraction, eot_token=args.eot_token, force=args.force)
    try:
        with sigterm_unwinds():  # SIGTERM unwinds as Ctrl-C does: the partial directory goes
            meta = prepare(opts, sys.stderr)
    except PrepareError as exc:
        return flags.fail(f"agent prepare: {exc}")
    except KeyboardInterrupt:
        return flags.fail(f"agent prepare: interrupted; nothing was written to {opts.out}", 130)
    except Terminated:
        return flags.fail(f"agent prepare: terminated (SIGTERM); nothing was written to "
                          f"{opts.out}", TERMINATED_STATUS)
    if args.json:
        print(meta.to_json(), end="")
    else:
        print(prepared_line(opts.out, meta))
    return 0


def prepared_line(out: Path, meta: TokenMeta) -> str:
    """What `agent prepare` made, for people. Val cut from the tail of train (too few
    documents for one to go to val) holds no whole document: it says so, not "0 documents"."""
    val = (f"{meta.tokens['val']:,} tokens cut from the end of train (too few documents to "
           f"hold one out whole)" if meta.val_split == "tail"
           else f"{meta.tokens['val']:,} tokens ({counted(meta.documents['val'], 'document')})")
    return (f"prepared {out}: train {meta.tokens['train']:,} tokens "
            f"({counted(meta.documents['train'], 'document')}), val {val}, {meta.dtype}, "
            f"vocabulary {meta.vocab_size:,}, end-of-text {meta.eot_token!r} = {meta.eot_id}")


def prepare(opts: Options, log: IO[str]) -> TokenMeta:
    """Prepare `opts.out`; progress goes to `log`. Raises PrepareError."""
    opts.validate()
    sources = find_sources(opts.inputs)
    out = Path(opts.out)
    _check_out(out, opts.force, sources)
    tmp = _make_partial(out)
    try:
        meta = _prepare_into(tmp, sources, opts, log)
        _commit(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise PrepareError(_write_failure(exc, Path(exc.filename or tmp), out)) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


# ---- the tokenizer


@dataclass
class LoadedTokenizer:
    tokenizer: Any  # tokenizers.Tokenizer
    files: dict[str, Path]  # name in the out directory -> where it comes from
    config: dict[str, Any]  # tokenizer_config.json, {} if none
    origin: str

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can emit: its entries, or one past its largest id where ids
        have gaps."""
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        return max(len(vocab), max(vocab.values(), default=-1) + 1)


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise PrepareError("agent prepare needs the tokenizers library: "
                           "pip install tokenizers") from None
    return tokenizers


def load_tokenizer(given: str) -> LoadedTokenizer:
    """The Hugging Face tokenizer `--tokenizer` names, and its files to copy."""
    tokenizers = _tokenizers()
    p = Path(given)
    path = p / TOKENIZER_NAME if p.is_dir() else p
    if not path.is_file():
        raise PrepareError(
            f"--tokenizer {given}: no {TOKENIZER_NAME} there. dtfm reads Hugging Face fast "
            f"tokenizers; a model with only a slow one (vocab.json and merges.txt, or "
            f"tokenizer.model) gets its tokenizer.json from transformers: "
            f"AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)")
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises a bare Exception for a bad file
        raise PrepareError(f"--tokenizer {path}: not a tokenizer.json the tokenizers "
                           f"library reads ({exc})") from None
    files = {TOKENIZER_NAME: path}
    if path.name == TOKENIZER_NAME:
        for name in TOKENIZER_FILES[1:]:
            if (path.parent / name).is_file():
                files[name] = path.parent / name
    config: dict[str, Any] = {}
    if "tokenizer_config.json" in files:
        try:
            config = json.loads(files["tokenizer_config.json"].read_text(encoding="utf-8"))
        except (ValueError, OSError) as exc:
            raise PrepareError(f"{files['tokenizer_config.json']}: not valid JSON "
                               f"({exc})") from None
    return LoadedTokenizer(tok, files, config if isinstance(config, dict) else {}, str(path))


def train_tokenizer(reader: Reader, vocab: int, into: Path, log: IO[str]) -> LoadedTokenizer:
    """A byte-level BPE of `vocab` tokens (GPT-2's scheme, `<|endoftext|>` its one special
    token) trained on the input, saved as `into/tokenizer.json` beside a
    tokenizer_config.json that transformers' PreTrainedTokenizerFast loads."""
    tokenizers = _tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, show_progress=False, special_tokens=[TRAINED_EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    progress = Progress(reader, log, "training tokenizer")

    def texts() -> Iterator[str]:
        for piece in reader.pieces():
            yield piece.text
            progress.update()

    tok.train_from_iterator(texts(), trainer=trainer)
    progress.finish()
    path = into / TOKENIZER_NAME
    tok.save(str(path), pretty=True)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": TRAINED_EOT,
              "eos_token": TRAINED_EOT, "unk_token": TRAINED_EOT, "add_prefix_space": False,
              "clean_up_tokenization_spaces": False}
    (into / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return LoadedTokenizer(tok, {}, config, f"trained: byte-level BPE, vocabulary {vocab}")


def find_eot(loaded: LoadedTokenizer, given: str) -> tuple[str, int]:
    """The end-of-text token and its id: `--eot-token`, else a known document separator the
    vocabulary holds, else the eos_token of tokenizer_config.json."""
    tok = loaded.tokenizer
    if given:
        tid = tok.token_to_id(given)
        if tid is None:
            raise PrepareError(f"--eot-token {given!r} is not a token of {loaded.origin}")
        return given, int(tid)
    for name in KNOWN_EOT:
        tid = tok.token_to_id(name)
        if tid is not None:
            return name, int(tid)
    eos = loaded.config.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str) and eos and tok.token_to_id(eos) is not None:
        return eos, int(tok.token_to_id(eos))
    raise PrepareError(f"{loaded.origin} has no end-of-text token ({', '.join(KNOWN_EOT)}, or "
                       f"an eos_token in tokenizer_config.json) to put between documents: "
                       f"name one of its tokens with --eot-token")


# ---- encoding and writing


def _write_failure(exc: OSError, path: Path, out: Path) -> str:
    name = errno.errorcode.get(exc.errno or 0, "")
    what = f"{exc.strerror or exc}" + (f" ({name})" if name else "")
    advice = {
        errno.ENOSPC: f"the disk holding {out.parent} is full: free space there or choose "
                      f"--out on a larger disk",
        errno.EDQUOT: "this user's disk quota is used up: free space or raise the quota, or "
                      "choose --out elsewhere",
        errno.EFBIG: "the file system refuses a file this large: choose --out on another one",
    }.get(exc.errno or 0, f"check that {out.parent} is writable")
    return f"cannot write {path}: {what}; {advice}. Nothing was written to {out}"


class Sink:
    """One output token file being written; a failed write names the file."""

    def __init__(self, path: Path, dtype: str) -> None:
        self.path, self.dtype, self.tokens = path, np.dtype(dtype).newbyteorder("<"), 0
        self.f = path.open("wb")

    def write(self, segments: list[list[int]], count: int) -> int:
        """Append the ids of `segments` (`count` in all); returns the largest."""
        # fromiter over the chained lists: half the time of np.array(one concatenated list)
        arr = np.fromiter(chain.from_iterable(segments), dtype=self.dtype, count=count)
        try:
            self.f.write(memoryview(arr))
        except OSError as exc:
            exc.filename = str(self.path)
            raise
        self.tokens += arr.size
        return int(arr.max())

    def close(self) -> None:
        try:
            self.f.close()
        except OSError as exc:
            exc.filename = str(self.path)
            raise


@dataclass
class Counts:
    documents: dict[str, int] = field(default_factory=lambda: {"train": 0, "val": 0})
    max_id: int = 0
    tokens_seen: int = 0


class Splitter:
    """Routes each document's ids (and its end-of-text token) to train or val."""

    def __init__(self, sinks: dict[str, Sink], eot: int, val_fraction: float) -> None:
        self.sinks, self.eot, self.fraction = sinks, eot, val_fraction
        self.counts = Counts()
        self.doc, self.split = 0, self._split_of(0)

    def _split_of(self, doc: int) -> str:
        f = self.fraction
        return "val" if math.floor((doc + 1) * f) > math.floor(doc * f) else "train"

    def add(self, batch: list[Piece], encodings: list[Any]) -> None:
        out: dict[str, list[list[int]]] = {"train": [], "val": []}
        eot = [self.eot]
        for piece, enc in zip(batch, encodings, strict=True):
            segments = out[self.split]
            segments.append(enc.ids)
            if piece.ends:
                segments.append(eot)
                self.counts.documents[self.split] += 1
                self.doc += 1
                self.split = self._split_of(self.doc)
        for split, segments in out.items():
            count = sum(map(len, segments))
            if count:
                top = self.sinks[split].write(segments, count)
                self.counts.max_id = max(self.counts.max_id, top)
                self.counts.tokens_seen += count


def cuts_change_ids(tok: Any) -> bool:
    """Whether `tok` encodes CUT_PROBE cut into pieces (as agent.textinput cuts long
    documents) to other ids than the whole: it adds something to the start of every input
    (a normalizer that prepends "\u2581" whatever the text, as older Llama 2 tokenizer.json
    files have), or its pre-tokenizer keeps a word's leading space with what precedes it."""
    whole = tok.encode(CUT_PROBE, add_special_tokens=False).ids
    pieces = tok.encode_batch(list(cut(CUT_PROBE, CUT_PROBE_PIECE)), add_special_tokens=False)
    return [i for enc in pieces for i in enc.ids] != whole


def encode_all(reader: Reader, tok: Any, splitter: Splitter, progress: Progress) -> None:
    """Encode every piece: `IN_FLIGHT` batches on the tokenizer's threads at once (one
    batch's last, longest documents leave cores idle that the next batch fills) while the
    next is read and the oldest finished one is written, in order."""
    encode: Callable[..., list[Any]] = getattr(tok, "encode_batch_fast", tok.encode_batch)
    pending: deque[tuple[list[Piece], Future[list[Any]]]] = deque()
    with ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="encode") as pool:
        for batch in batches(reader.pieces()):
            texts = [p.text for p in batch]
            pending.append((batch, pool.submit(encode, texts, add_special_tokens=False)))
            if len(pending) > IN_FLIGHT:
                done, future = pending.popleft()
                splitter.add(done, future.result())
                progress.update(splitter.counts)
        while pending:
            done, future = pending.popleft()
            splitter.add(done, future.result())
    progress.update(splitter.counts)


def _prepare_into(tmp: Path, sources: list[Source], opts: Options, log: IO[str]) -> TokenMeta:
    reader = Reader(sources, opts.text_field)
    if opts.train_vocab:
        loaded = train_tokenizer(reader, opts.train_vocab, tmp, log)
        reader = Reader(sources, opts.text_field)
    else:
        loaded = load_tokenizer(opts.tokenizer)
        for name, src in loaded.files.items():
            shutil.copyfile(src, tmp / name)
    eot_token, eot = find_eot(loaded, opts.eot_token)
    vocab = loaded.vocab_size
    dtype = dtype_for_vocab(vocab)
    sinks = {split: Sink(tmp / name, dtype) for split, name in SPLITS.items()}
    splitter = Splitter(sinks, eot, opts.val_fraction)
    progress = Progress(reader, log, "tokenizing")
    try:
        encode_all(reader, loaded.tokenizer, splitter, progress)
    finally:
        for sink in sinks.values():
            sink.close()
    progress.finish()
    if reader.cuts and cuts_change_ids(loaded.tokenizer):
        log.write(f"note: {loaded.origin} encodes a text cut before a word's leading space to "
                  f"other ids than the whole text (it adds a token at the start of every "
                  f"input); the documents over {PIECE_CHARS:,} characters were encoded in "
                  f"pieces, so the ids at its {reader.cuts:,} cuts differ from those of "
                  f"each document encoded whole\n")
    counts = splitter.counts
    if counts.tokens_seen == 0:
        raise PrepareError(f"the input ({', '.join(opts.inputs)}) holds no text")
    val_split = "documents"
    if counts.documents["val"] == 0:
        _move_tail(sinks, opts.val_fraction)
        val_split = "tail"
    meta = TokenMeta(
        dtype=dtype, vocab_size=vocab, tokenizer_hash=tokenizer_hash(tmp / TOKENIZER_NAME),
        eot_id=eot, eot_token=eot_token, max_token_id=counts.max_id,
        documents=dict(counts.documents),
        tokens={split: sink.tokens for split, sink in sinks.items()},
        val_fraction=opts.val_fraction, val_split=val_split,
        sources=[{"path": str(s.path), "bytes": s.size} for s in sources],
        tokenizer_origin=loaded.origin)
    write_meta(tmp, meta)
    return meta


def _move_tail(sinks: dict[str, Sink], fraction: float) -> None:
    """Too few documents for one to go to val: the last `fraction` of the train tokens (at
    least one) become val.bin."""
    train, val = sinks["train"], sinks["val"]
    n = max(1, math.ceil(train.tokens * fraction))
    if n >= train.tokens:
        raise PrepareError(f"the input makes only {train.tokens} tokens: too few to split "
                           f"into train and val")
    width = train.dtype.itemsize
    keep = train.tokens - n
    with train.path.open("r+b") as f:
        f.seek(keep * width)
        tail = f.read(n * width)
        val.path.write_bytes(tail)
        f.truncate(keep * width)
    train.tokens, val.tokens = keep, n


# ---- progress


class Progress:
    """Bytes read of the total, documents, tokens/s and ETA on `log`: rewritten in place on a
    terminal every half second, a line every 10 s otherwise (`dtfm.progressline`)."""

    def __init__(self, reader: Reader, log: IO[str], what: str) -> None:
        self.reader, self.what = reader, what
        self.line = ProgressLine(log, every_s=10.0, tty_every_s=0.5)
        self.t0 = self.last = time.monotonic()
        self.counts: Counts | None = None

    def update(self, counts: Counts | None = None) -> None:
        if counts is not None:
            self.counts = counts
        now = time.monotonic()
        if now - self.last >= 0.5:  # building the line is not free: not on every chunk
            self.last = now
            self.line.show(self._line(now), now=now)

    def finish(self) -> None:
        self.line.show(self._line(time.monotonic()))
        self.line.finish()

    def _line(self, now: float) -> str:
        done, total = self.reader.bytes_done, self.reader.total_bytes
        elapsed = max(now - self.t0, 1e-9)
        rate = done / elapsed
        eta = (total - done) / rate if rate > 0 else float("nan")
        line = (f"{self.what}: {done / 1e6:,.1f}/{total / 1e6:,.1f} MB "
                f"({100 * done / max(total, 1):.0f}%)")
        if self.counts is not None:
            docs = sum(self.counts.documents.values())
            line += (f" | {docs:,} documents | {self.counts.tokens_seen / elapsed:,.0f} "
                     f"tokens/s")
        return line + f" | {rate / 1e6:.1f} MB/s | ETA {flags.hms(eta)}"


# ---- the output directory


def _check_out(out: Path, force: bool, sources: list[Source]) -> None:
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out} exists and is not a directory")
    inside = [s.path for s in sources if out.resolve() in s.path.resolve().parents]
    if inside:
        raise PrepareError(f"--out {out} holds the input {inside[0]}: choose an --out outside "
                           f"the input")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise PrepareError(f"--out {out} exists and is not empty: choose another directory, "
                           f"or pass --force to replace it")


def _make_partial(out: Path) -> Path:
    parent = out.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = parent / f".{out.name}.partial-{secrets.token_hex(4)}"
        tmp.mkdir()
    except OSError as exc:
        raise PrepareError(f"cannot create a directory in {parent}: {exc}") from None
    return tmp


def _commit(tmp: Path, out: Path) -> None:
    """Put the finished `tmp` where `out` is, replacing an existing `out` (empty, or --force)."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = tmp.with_name(f".{out.name}.old-{secrets.token_hex(4)}")
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)

