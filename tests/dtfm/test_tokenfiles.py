"""A prepared token directory's `meta.json`, and the one check that data fits a model."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest

from dtfm.core.tokenfiles import (
    TokenMeta,
    check_data_path,
    check_matches,
    dtype_for_vocab,
    meta_for,
    read_meta,
    tokenizer_hash,
    write_meta,
)

META = TokenMeta(dtype="uint16", vocab_size=300, tokenizer_hash="ab" * 32, eot_id=0,
                 eot_token="<|endoftext|>", max_token_id=299, documents={"train": 9, "val": 1},
                 tokens={"train": 900, "val": 100}, val_fraction=0.1)


def test_the_dtype_is_the_smallest_that_holds_every_id() -> None:
    assert dtype_for_vocab(256) == dtype_for_vocab(65536) == "uint16"
    assert dtype_for_vocab(65537) == dtype_for_vocab(128256) == "uint32"
    with pytest.raises(ValueError):
        dtype_for_vocab(0)


def test_meta_round_trips_and_malformed_meta_is_named(tmp_path: Path) -> None:
    assert read_meta(tmp_path) is None
    write_meta(tmp_path, META)
    assert read_meta(tmp_path) == META
    assert META.file_bytes("train") == 1800
    assert meta_for(tmp_path) == (META, tmp_path)
    (tmp_path / "train.bin").write_bytes(b"")
    assert meta_for(tmp_path / "train.bin") == (META, tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps({**json.loads(META.to_json()),
                                                    "version": 7}))
    with pytest.raises(ValueError, match="format version 7"):
        read_meta(tmp_path)
    (tmp_path / "meta.json").write_text("{")
    with pytest.raises(ValueError, match="meta.json is not valid JSON"):
        read_meta(tmp_path)


def test_the_tokenizer_hash_is_the_sha256_of_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes(b'{"model": {}}')
    digest = hashlib.sha256(b'{"model": {}}').hexdigest()
    assert tokenizer_hash(tmp_path) == tokenizer_hash(tmp_path / "tokenizer.json") == digest


def test_data_must_fit_the_models_vocabulary_and_tokenizer() -> None:
    check_matches(META, 300)
    check_matches(META, 320, "ab" * 32)  # a padded embedding is fine
    with pytest.raises(ValueError, match="holds token id 299 but the model's vocabulary is 256"):
        check_matches(META, 256)
    with pytest.raises(ValueError, match="vocabulary of 300 but the model's vocabulary is 299"):
        check_matches(replace(META, max_token_id=200), 299)
    with pytest.raises(ValueError, match=r"another tokenizer.*abababababababab\.\.\. in its "
                                         r"meta.json, cdcdcdcdcdcdcdcd\.\.\. the model's"):
        check_matches(META, 300, "cd" * 32, where="--data /d")


def test_data_is_checked_from_meta_json_where_this_machine_holds_it(tmp_path: Path) -> None:
    write_meta(tmp_path, META)
    assert check_data_path(str(tmp_path), 300) == META
    (tmp_path / "train.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=f"--data {tmp_path} holds token id 299"):
        check_data_path(str(tmp_path / "train.bin"), 256)
    assert check_data_path(str(tmp_path / "elsewhere"), 10) is None  # not on this disk
    assert check_data_path("", 10) is None
