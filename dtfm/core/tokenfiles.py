"""What a prepared token directory says about itself, and whether it fits a model.

`agent prepare` writes `train.bin`, `val.bin` (raw little-endian token ids, uint16 or uint32)
and `meta.json` (`TokenMeta`); `--data` reads them. This module owns the metadata: its
format, reading and writing it, the tokenizer's fingerprint (`tokenizer_hash`), and the one
check that a token directory fits a model (`check_matches`, `check_data_path`), which the
coordinator and `agent local` run before any worker starts and each worker runs again when
it loads the files. A bare `.bin` without `meta.json` is nanoGPT's format: uint16, nothing
known about its tokenizer. Pure data: no torch, no numpy.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
META_NAME = "meta.json"
TRAIN_NAME, VAL_NAME = "train.bin", "val.bin"
SPLITS = {"train": TRAIN_NAME, "val": VAL_NAME}
TOKENIZER_NAME = "tokenizer.json"
# What a Hugging Face tokenizer directory may hold (tokenizer.json first): whichever exist
# travel with prepared data (`agent prepare`) and are copied into an export (`hfexport`).
TOKENIZER_FILES = (TOKENIZER_NAME, "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")
BARE_DTYPE = "uint16"  # a .bin without meta.json: nanoGPT's format
DTYPE_BYTES = {"uint16": 2, "uint32": 4}
UINT16_VOCAB = 1 << 16


def dtype_for_vocab(vocab_size: int) -> str:
    """The smallest token dtype that holds every id of a vocabulary of `vocab_size`."""
    if vocab_size < 1:
        raise ValueError(f"vocabulary size must be >= 1, got {vocab_size}")
    if vocab_size > 1 << 32:
        raise ValueError(f"vocabulary of {vocab_size} does not fit in uint32 token ids")
    return "uint16" if vocab_size <= UINT16_VOCAB else "uint32"


@dataclass(frozen=True)
class TokenMeta:
    """`meta.json` of a prepared token directory.

    `vocab_size` is the tokenizer's, added tokens included; `max_token_id` the largest id in
    either split (what must fit the model's embedding); `documents` and `tokens` are per
    split (`train`, `val`), the end-of-text tokens between documents included in `tokens`.
    `val_split` says how the validation split was chosen: `documents` (every 1/F-th document)
    or `tail` (the last tokens, when there were too few documents for one to go to val).
    """

    dtype: str
    vocab_size: int
    tokenizer_hash: str
    eot_id: int
    eot_token: str
    max_token_id: int
    documents: dict[str, int]
    tokens: dict[str, int]
    val_fraction: float
    val_split: str = "documents"
    sources: list[dict[str, Any]] = field(default_factory=list)
    tokenizer_origin: str = ""
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        """Deterministic text: the same preparation gives the same bytes."""
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = META_NAME) -> TokenMeta:
        version = d.get("version")
        if version != FORMAT_VERSION:
            raise ValueError(f"{where}: format version {version!r} is not the {FORMAT_VERSION} "
                             f"this dtfm reads; prepare the data again with `agent prepare`")
        try:
            meta = cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
        except TypeError as exc:
            raise ValueError(f"{where}: missing fields ({exc}); prepare the data again "
                             f"with `agent prepare`") from None
        if meta.dtype not in DTYPE_BYTES:
            raise ValueError(f"{where}: token dtype {meta.dtype!r} is not one of "
                             f"{', '.join(DTYPE_BYTES)}")
        return meta

    def file_bytes(self, split: str) -> int:
        return self.tokens[split] * DTYPE_BYTES[self.dtype]


def read_meta(directory: str | Path) -> TokenMeta | None:
    """The `meta.json` of `directory`, None if it has none; ValueError if it is malformed."""
    path = Path(directory) / META_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); prepare the data again with "
                         f"`agent prepare`") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds no JSON object; prepare the data again")
    return TokenMeta.from_dict(data, str(path))


def write_meta(directory: str | Path, meta: TokenMeta) -> Path:
    path = Path(directory) / META_NAME
    path.write_text(meta.to_json(), encoding="utf-8")
    return path


def tokenizer_hash(path: str | Path) -> str:
    """sha256 (hex) of the bytes of `tokenizer.json`: `path` is the file or a directory
    holding it. Two tokenizers with the same file encode alike; the fingerprint a prepared
    directory records and a model directory is compared by."""
    p = Path(path)
    if p.is_dir():
        p = p / TOKENIZER_NAME
    digest = hashlib.sha256()
    with p.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_matches(meta: TokenMeta, vocab_size: int, tokenizer_hash: str | None = None,
                  where: str = "the token data") -> None:
    """Raise ValueError, naming what disagrees, unless data described by `meta` fits a model.

    `vocab_size`: the model's vocabulary (its embedding rows). It may exceed the tokenizer's
    (a padded embedding, e.g. GPT-2's 50257 in 50304) but not fall short of it or of the
    largest id in the files. `tokenizer_hash`: `tokenizer_hash()` of the model's tokenizer, or
    None where the model comes with none (a preset); when given it must equal the one the
    data was prepared with. `where` names the data in the message (its directory).
    """
    if meta.max_token_id >= vocab_size:
        raise ValueError(
            f"{where} holds token id {meta.max_token_id} but the model's vocabulary is "
            f"{vocab_size} (ids 0..{vocab_size - 1}): prepare the data with the model's "
            f"tokenizer, or train a model whose vocabulary is at least {meta.max_token_id + 1}")
    if meta.vocab_size > vocab_size:
        raise ValueError(
            f"{where} was tokenized with a vocabulary of {meta.vocab_size} but the model's "
            f"vocabulary is {vocab_size}: the tokenizer can emit ids the model cannot embed; "
            f"prepare the data with the model's tokenizer, or choose a model whose vocabulary "
            f"is at least {meta.vocab_size}")
    if tokenizer_hash is not None and tokenizer_hash != meta.tokenizer_hash:
        raise ValueError(
            f"{where} was tokenized with another tokenizer than the model's: tokenizer.json "
            f"sha256 {meta.tokenizer_hash[:16]}... in its {META_NAME}, {tokenizer_hash[:16]}... "
            f"the model's; prepare it again with `agent prepare --tokenizer MODEL_DIR`")


def meta_for(data_path: str | Path) -> tuple[TokenMeta | None, Path]:
    """The metadata describing `--data PATH` and the directory it came from.

    A directory: its own `meta.json`. A file named `train.bin` or `val.bin`: the
    `meta.json` beside it. Anything else: (None, its directory)."""
    p = Path(data_path)
    if p.is_dir():
        return read_meta(p), p
    if p.name in SPLITS.values():
        return read_meta(p.parent), p.parent
    return None, p.parent


def check_data_path(data_path: str, vocab_size: int,
                    tokenizer_hash: str | None = None) -> TokenMeta | None:
    """Check `--data PATH` against a model from its `meta.json` alone, where this machine
    holds it: the coordinator's and `agent local`'s look before any worker starts (each worker
    checks the token files themselves when it loads them). Returns the metadata, or None for
    no data path, a path not on this disk, or bare `.bin` files (nothing to check cheaply)."""
    if not data_path or not Path(data_path).exists():
        return None
    meta, directory = meta_for(data_path)
    if meta is not None:
        check_matches(meta, vocab_size, tokenizer_hash, where=f"--data {directory}")
    return meta
