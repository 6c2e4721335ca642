"""Tokens in, (input, target) batches out: tokenizer, corpora, and the resumable sampler.

Owns what every replica must agree on for the global batch to be the same in every layout:
the token stream (the byte-level default corpus, the Python standard library's source of the
running interpreter, present on every machine with no download; a directory `agent prepare`
wrote, uint16 or uint32 as its `meta.json` says; or a nanoGPT-style uint16 `.bin` file), its
deterministic train/validation split, and the order sequences are drawn in. The sampler's
position is plain data so checkpoints can store it and resume exactly.
"""

from __future__ import annotations

import functools
import logging
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dtfm.core.tokenfiles import (
    BARE_DTYPE,
    DTYPE_BYTES,
    META_NAME,
    SPLITS,
    TokenMeta,
    check_data_path,
)

log = logging.getLogger(__name__)

BYTE_VOCAB = 256
VAL_FRACTION = 0.05


def encode(text: str) -> list[int]:
    """Byte-level tokenizer: UTF-8 bytes are the tokens (vocabulary 256)."""
    return list(text.encode("utf-8"))


def decode(tokens: list[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")


def stdlib_files() -> list[Path]:
    """The interpreter's standard-library `.py` files, sorted (no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()
    )


@functools.cache
def stdlib_corpus() -> np.ndarray:
    """The default corpus as uint8 tokens: every stdlib source file, concatenated in order.

    Read once per process (a read-only array): an agent's spare worker reads it before its
    assignment arrives (about 1.6 s of walking and reading ~1,800 files), see `__main__`."""
    chunks = [p.read_bytes() for p in stdlib_files()]
    if not chunks:
        raise RuntimeError("found no standard-library sources to build the default corpus from")
    return np.frombuffer(b"\n".join(chunks), dtype=np.uint8)


def load_bin(path: str | Path, vocab_size: int, dtype: str = BARE_DTYPE,
             max_token_id: int | None = None, n_tokens: int | None = None) -> np.ndarray:
    """A token file (raw little-endian `dtype` ids), memory-mapped.

    `max_token_id`/`n_tokens` come from the `meta.json` of a prepared directory: the file's
    size must hold exactly `n_tokens`, and the largest id is taken from there. Without them
    (a bare nanoGPT `.bin`) the whole file is scanned, in blocks, for its largest id. Either
    way an id the model cannot embed is refused, naming the file and both numbers."""
    path = Path(path)
    if n_tokens is not None:
        size, want = path.stat().st_size, n_tokens * DTYPE_BYTES[dtype]
        if size != want:
            raise ValueError(
                f"token file {path} has {size} bytes but its {META_NAME} says {n_tokens} "
                f"{dtype} tokens ({want} bytes): the file was truncated or replaced; "
                f"prepare the data again with `agent prepare`")
    if path.stat().st_size == 0:
        raise ValueError(f"token file {path} is empty")
    tokens = np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
    top = max_token_id if max_token_id is not None else _largest_id(tokens)
    if top >= vocab_size:
        raise ValueError(
            f"token file {path} holds token id {top} but the model's vocabulary is "
            f"{vocab_size} (ids 0..{vocab_size - 1}): tokenize it with the model's tokenizer "
            f"(`agent prepare --tokenizer`) or choose a model with a larger vocabulary"
        )
    return tokens


def _largest_id(tokens: np.ndarray, block: int = 1 << 24) -> int:
    return max(int(tokens[i : i + block].max()) for i in range(0, tokens.size, block))


def load_splits(data_path: str, vocab_size: int,
                tokenizer_hash: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) token arrays.

    `data_path` empty: the stdlib corpus, last 5% is validation. A directory: its `train.bin`
    and `val.bin`, described by its `meta.json` when it has one (`agent prepare`: uint16 or
    uint32, checked against the model's vocabulary and, when `tokenizer_hash` is given, its
    tokenizer), else nanoGPT's bare uint16 files. A file: that file, last 5% is validation
    (`train.bin` or `val.bin` of a prepared directory: in its dtype).
    """
    if not data_path:
        tokens: np.ndarray = stdlib_corpus()
    else:
        p = Path(data_path)
        if not p.exists():
            raise FileNotFoundError(f"--data {data_path} is neither a token file nor a "
                                    f"directory on this machine")
        meta = check_data_path(data_path, vocab_size, tokenizer_hash)
        if p.is_dir():
            train, val = (_load_split(p / name, vocab_size, meta, split)
                          for split, name in SPLITS.items())
            return train, val
        split = next((s for s, name in SPLITS.items() if name == p.name), "")
        tokens = _load_split(p, vocab_size, meta, split)
    cut = int(tokens.size * (1 - VAL_FRACTION))
    return tokens[:cut], tokens[cut:]


def _load_split(path: Path, vocab_size: int, meta: TokenMeta | None, split: str) -> np.ndarray:
    if meta is None:
        return load_bin(path, vocab_size)
    return load_bin(path, vocab_size, meta.dtype, meta.max_token_id, meta.tokens[split])


@dataclass
class Position:
    """Where the sampler is: epoch and the index of the next sequence in that epoch's order."""

    epoch: int = 0
    index: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> Position:
        return cls(int(d["epoch"]), int(d["index"]))


class Sampler:
    """Global batches of non-overlapping windows, shuffled per epoch by (seed, epoch).

    The stream is cut into windows of `seq_len + 1` tokens (input and shifted target). Every
    rank runs the same sampler, so every layout sees the same global batch; replica `r` of
    `R` keeps rows [r*B/R, (r+1)*B/R) of it.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int) -> None:
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.n_windows = (tokens.size - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"corpus of {tokens.size} tokens is shorter than one sequence")
        self.position = Position()
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    def _order_for(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order, self._order_epoch = rng.permutation(self.n_windows), epoch
        return self._order

    def next_global(self, batch: int) -> list[int]:
        """Window ids of the next global batch; advances the position."""
        ids: list[int] = []
        while len(ids) < batch:
            order = self._order_for(self.position.epoch)
            take = min(batch - len(ids), self.n_windows - self.position.index)
            ids.extend(int(i) for i in order[self.position.index : self.position.index + take])
            self.position.index += take
            if self.position.index == self.n_windows:
                self.position = Position(self.position.epoch + 1, 0)
        return ids

    def windows(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack(
            [np.asarray(self.tokens[i * self.seq_len : i * self.seq_len + self.seq_len + 1])
             for i in ids]
        ).astype(np.int64)
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def replica_slice(ids: list[int], replica: int, replicas: int) -> list[int]:
    """Replica `replica`'s contiguous share of the global batch's rows."""
    per = len(ids) // replicas
    return ids[replica * per : (replica + 1) * per]


def val_batches(tokens: np.ndarray, seq_len: int, batch: int, n_batches: int) -> list[list[int]]:
    """Fixed validation batches: evenly spaced windows over the validation split."""
    n_windows = (tokens.size - 1) // seq_len
    if n_windows < 1:
        raise ValueError("validation split is shorter than one sequence")
    want = batch * n_batches
    ids = [int(i) for i in np.linspace(0, n_windows - 1, num=want).astype(np.int64)]
    return [ids[k * batch : (k + 1) * batch] for k in range(n_batches)]
