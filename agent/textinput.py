"""Text files in: the documents `agent prepare` reads, as pieces, in batches.

Owns which files an `--input` names (`.txt`, `.jsonl`, `.parquet`; directories searched
recursively in sorted order), what a document is in each (a `.txt` file; a `.jsonl` line's or
a `.parquet` row's `--text-field`), cutting a long document into pieces that encode as the
whole does (`piece_end`), and grouping pieces into the batches handed to the tokenizer. Reads
as it goes, so memory stays bounded whatever the input's size; counts the bytes read for
progress. Bad input is a `PrepareError` naming the file, the line or row, and the fix.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUFFIXES = (".txt", ".jsonl", ".parquet")
PIECE_CHARS = 1 << 17  # a .txt is encoded in pieces of about this many characters
BATCH_CHARS = 1 << 21  # characters handed to the tokenizer at once
BATCH_PIECES = 4096
READ_BYTES = 1 << 20
PARQUET_ROWS = 1024


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
                while len(carry) > PIECE_CHARS:
                    cut = piece_end(carry, PIECE_CHARS)
                    yield Piece(carry[:cut], False)
                    carry = carry[cut:]
        yield Piece(carry + decoder.decode(b"", final=True), True)

    def _jsonl(self, src: Source) -> Iterator[Piece]:
        with src.path.open("rb") as f:
            for number, line in enumerate(f, 1):
                self.bytes_done += len(line)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise PrepareError(f"{src.path} line {number}: not JSON ({exc})") from None
                yield Piece(self._field(record, src, f"line {number}"), True)

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
                yield Piece(text, True)
            done += batch.num_rows
            self.bytes_done = start + src.size * done // rows


def piece_end(text: str, limit: int, tries: int = 64) -> int:
    """Where to cut `text` (longer than `limit`) into a piece of at most `limit` characters:
    before the last whitespace character a non-space follows, so that a word and the space
    before it stay together, as the usual pre-tokenizers (GPT-2's, Llama's) split them; the
    pieces then encode as the whole text does. No such place: at `limit`."""
    end = limit
    for _ in range(tries):
        i = max(text.rfind(" ", 0, end), text.rfind("\n", 0, end), text.rfind("\t", 0, end))
        if i <= 0:
            break
        if not text[i + 1].isspace():
            return i
        end = i
    return limit


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
