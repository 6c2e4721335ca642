"""Text files in: the documents `agent prepare` reads, as pieces, in batches.

Owns which files an `--input` names (`.txt`, `.jsonl`, `.parquet`; directories searched
recursively in sorted order), what a document is in each (a `.txt` file; a `.jsonl` line's or
a `.parquet` row's `--text-field`), cutting a long document into pieces (`cut`) and grouping
pieces into the batches handed to the tokenizer. Reads as it goes, and hands the tokenizer no
piece over PIECE_CHARS characters whatever the document's size: the tokenizer's working memory
is 130-170 bytes per character of one input, so a 20 MB document encoded whole took 3.5 GB
(bench/prepare_memory.py). A `.jsonl` line or a `.parquet` row is still read and parsed
whole (about 5 bytes per character at the peak).
Counts the bytes read for progress. Bad input is a `PrepareError` naming the file, the line or
row, and the fix.

Where a document is cut (`cut`), and why the tokens stay those of the whole document: before
a space (U+0020) that a non-whitespace character follows, the space a word's leading space.
The pre-tokenizers of the byte-level BPEs (GPT-2's regex, Llama 3's, Qwen's), Metaspace
(SentencePiece-style) and whitespace splitting all start a pre-token there (the space is the
optional prefix of the next word, number or punctuation run, and a run of whitespace before
it leaves its last space to that), and none of them looks behind, so the pre-tokens, and the
BPE merges inside them, are those of the whole text (tests/agent/test_prepare.py checks
GPT-2's, Llama 3's and Metaspace's on source code and prose). Only a stretch of PIECE_CHARS
characters without such a space (text written without spaces, such as Chinese, or base64)
is cut elsewhere: at a newline between two letters or digits (a
split for the byte-level BPEs; a Metaspace tokenizer puts a "▁" before the piece), else after
PIECE_CHARS characters; only such a cut can change a token. A tokenizer that adds something
to the start of every input (a normalizer that prepends "▁" unconditionally, as older Llama 2
tokenizer.json files do) changes a token at every cut: `agent.commands.prepare` tries the tokenizer
on a cut text first and says so.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUFFIXES = (".txt", ".jsonl", ".parquet")
PIECE_CHARS = 1 << 17  # no piece handed to the tokenizer is longer (characters)
BATCH_CHARS = 1 << 21  # characters handed to the tokenizer at once
BATCH_PIECES = 4096
READ_BYTES = 1 << 20
PARQUET_ROWS = 1024
# where `cut` cuts (see above), as found in the reversed window (the first match there is the
# last in the window): a space before a non-whitespace character, else a newline between two
# letters or digits
_SURROGATE = re.compile("[\ud800-\udfff]")  # JSON's "\\ud800" escapes: no character
_CUTS_REVERSED = (re.compile(r"(?<=\S) "), re.compile(r"(?<=[^\W_])\n(?=[^\W_])"))


class PrepareError(Exception):
    """Bad input or a failed write: the message says what and what to do."""


@dataclass(frozen=True)
class Source:
    path: Path
    size: int

    @property
    def kind(self) -> str:
        return self.path.suffix.lower()


def find_sources(inputs: list[str]) -> list[Source]:
    """The input files, each once: directories searched recursively, in sorted order."""
    found: list[Path] = []
    for given in inputs:
        p = Path(given)
        if p.is_dir():
            files = sorted((f for f in p.rglob("*") if f.is_file()
                            and f.suffix.lower() in SUFFIXES
                            and not any(part.startswith(".") for part in f.relative_to(p).parts)),
                           key=lambda f: f.relative_to(p).as_posix())
            if not files:
                raise PrepareError(f"--input {given}: no {', '.join(SUFFIXES)} files in it")
            found.extend(files)
        elif p.is_file():
            if p.suffix.lower() not in SUFFIXES:
                raise PrepareError(f"--input {given}: not a {', '.join(SUFFIXES)} file")
            found.append(p)
        else:
            raise PrepareError(f"--input {given}: no such file or directory")
    seen: set[Path] = set()
    sources = []
    for f in found:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            sources.append(Source(f, f.stat().st_size))
    return sources


@dataclass
class Piece:
    """Text of one document, or part of one (`ends` False: more of it follows)."""

    text: str
    ends: bool


class Reader:
    """The sources' documents as pieces, in order, counting the bytes read for progress."""

    def __init__(self, sources: list[Source], text_field: str) -> None:
        self.sources, self.text_field = sources, text_field
        self.total_bytes = sum(s.size for s in sources)
        self.bytes_done = 0
        self.cuts = 0  # places a document was cut (see `cut`)

    def pieces(self) -> Iterator[Piece]:
        for src in self.sources:
            start = self.bytes_done
            try:
                if src.kind == ".txt":
                    yield from self._txt(src)
                elif src.kind == ".jsonl":
                    yield from self._jsonl(src)
                else:
                    yield from self._parquet(src)
            except (OSError, UnicodeDecodeError) as exc:
                raise PrepareError(f"cannot read {src.path}: {exc}") from exc
            self.bytes_done = start + src.size

    def _txt(self, src: Source) -> Iterator[Piece]:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        carry = ""
        with src.path.open("rb") as f:
            while block := f.read(READ_BYTES):
                self.bytes_done += len(block)
                carry += decoder.decode(block)
                if len(carry) > PIECE_CHARS:
                    *pieces, carry = cut(carry, PIECE_CHARS)
                    self.cuts += len(pieces)
                    for text in pieces:
                        yield Piece(text, False)
        yield Piece(carry + decoder.decode(b"", final=True), True)

    def _jsonl(self, src: Source) -> Iterator[Piece]:
        with src.path.open("rb") as f:
            for number, line in enumerate(f, 1):
                self.bytes_done += len(line)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except UnicodeDecodeError as exc:
                    raise PrepareError(
                        f"{src.path} line {number}: not UTF-8 ({exc.reason} at byte "
                        f"{exc.start + 1} of the line); a .jsonl must be UTF-8: convert the "
                        f"file (e.g. iconv -f LATIN1 -t UTF-8 -o NEW.jsonl "
                        f"{src.path}) or mend that line") from None
                except json.JSONDecodeError as exc:
                    raise PrepareError(f"{src.path} line {number}: not JSON ({exc})") from None
                text = self._field(record, src, f"line {number}")
                if not text.isascii() and (bad := _SURROGATE.search(text)):
                    raise PrepareError(
                        f"{src.path} line {number}: field {self.text_field!r} holds a lone "
                        f"surrogate (\\u{ord(bad.group()):04x} at character {bad.start() + 1}), "
                        f"half of a UTF-16 pair and no character, which no tokenizer encodes: "
                        f"mend or drop that line")
                del line, record  # a long document's line is not held while it is encoded
                yield from self._document(text)

    def _document(self, text: str) -> Iterator[Piece]:
        """One document as pieces of at most PIECE_CHARS characters, the last one ending it."""
        pieces = cut(text, PIECE_CHARS)
        piece = next(pieces)
        for following in pieces:
            self.cuts += 1
            yield Piece(piece, False)
            piece = following
        yield Piece(piece, True)

    def _field(self, record: Any, src: Source, where: str) -> str:
        if not isinstance(record, dict) or self.text_field not in record:
            keys = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
            raise PrepareError(f"{src.path} {where}: no field {self.text_field!r} (it has: "
                               f"{keys}); choose the text's field with --text-field")
        text = record[self.text_field]
        if not isinstance(text, str):
            raise PrepareError(f"{src.path} {where}: field {self.text_field!r} holds a "
                               f"{type(text).__name__}, not text")
        return text

    def _parquet(self, src: Source) -> Iterator[Piece]:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise PrepareError(f"{src.path}: reading .parquet needs pyarrow: "
                               f"pip install pyarrow") from None
        try:
            pf = pq.ParquetFile(src.path)
        except Exception as exc:  # pyarrow's own errors (ArrowInvalid) are no OSError
            raise PrepareError(f"{src.path}: not a parquet file pyarrow reads ({exc})") from None
        names = pf.schema_arrow.names
        if self.text_field not in names:
            raise PrepareError(f"{src.path}: no column {self.text_field!r} (it has: "
                               f"{', '.join(names)}); choose the text's column with "
                               f"--text-field")
        rows, done, start = max(1, pf.metadata.num_rows), 0, self.bytes_done
        for batch in pf.iter_batches(batch_size=PARQUET_ROWS, columns=[self.text_field]):
            for i, text in enumerate(batch.column(0).to_pylist()):
                if text is None:
                    continue
                if not isinstance(text, str):
                    raise PrepareError(f"{src.path} row {done + i}: column "
                                       f"{self.text_field!r} holds a {type(text).__name__}, "
                                       f"not text")
                yield from self._document(text)
            done += batch.num_rows
            self.bytes_done = start + src.size * done // rows


def cut(text: str, limit: int) -> Iterator[str]:
    """`text` in pieces of at most `limit` characters, the last one the rest (at most `limit`,
    never empty unless `text` is): each cut before the last space in the piece's reach that a
    non-whitespace character follows, else before the last newline between two letters or
    digits, else at `limit` (the module's docstring says why the tokens stay those of the
    whole text). Linear in `len(text)`: only the window of each cut is copied."""
    start = 0
    while len(text) - start > limit:
        window = text[start:start + limit + 1]
        end = start + _cut_at(window)
        yield text[start:end]
        start = end
    yield text[start:]


def _cut_at(window: str) -> int:
    backwards = window[:0:-1]  # a cut at 0 would make an empty piece
    for where in _CUTS_REVERSED:
        found = where.search(backwards)
        if found:
            return len(window) - 1 - found.start()
    return len(window) - 1


def batches(pieces: Iterator[Piece]) -> Iterator[list[Piece]]:
    """Pieces grouped into batches of about BATCH_CHARS characters; empty documents (and
    empty pieces inside one) left out."""
    batch: list[Piece] = []
    chars, starts = 0, True
    for piece in pieces:
        empty = not piece.text and (starts or not piece.ends)
        starts = piece.ends
        if empty:
            continue
        batch.append(piece)
        chars += len(piece.text)
        if chars >= BATCH_CHARS or len(batch) >= BATCH_PIECES:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch
