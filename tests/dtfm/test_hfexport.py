"""The torch-free export assembler (`dtfm.core.hfexport`) and the `--init-from` directory checks
(`dtfm.core.hfdir`): index from the stage files' headers, atomic writes, refusals."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from dtfm.core import hfdir, hfexport
from dtfm.core.hfconfig import EMBEDDING_INDEX, HEAD_INDEX, part_tensors
from dtfm.core.hfexport import ExportError, StageFile
from dtfm.core.spec import ModelSpec
from tests.smalldisk import small_disk as mounted_small_disk

SPEC = ModelSpec("t", vocab_size=32, n_layers=3, d_model=8, n_heads=2, seq_len=16, arch="llama",
                 n_kv_heads=1)


def stage_files(tmp: Path, splits: list[tuple[int, int]],
                spec: ModelSpec = SPEC) -> list[StageFile]:
    """One safetensors file per stage holding the HF tensors of its layers (random values)."""
    rng = np.random.default_rng(0)
    files = []
    for stage, (begin, end) in enumerate(splits):
        parts = list(range(begin, end))
        if begin == 0:
            parts.insert(0, EMBEDDING_INDEX)
        if end == spec.n_layers:
            parts.append(HEAD_INDEX)
        tensors = {t.name: rng.standard_normal((4, 2)).astype(np.float32)
                   for p in parts for t in part_tensors(spec, p).values()}
        path = tmp / f"stage{stage}.safetensors"
        save_file(tensors, path, metadata={"format": "pt"})
        files.append(StageFile(stage, path))
    return files


def test_two_stages_give_two_shards_and_an_index_from_their_headers(tmp_path: Path) -> None:
    files = stage_files(tmp_path, [(0, 2), (2, 3)])
    out = hfexport.write_export(tmp_path / "out", SPEC, files)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                     "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.embed_tokens.weight"] == "model-00001-of-00002.safetensors"
    assert index["weight_map"]["lm_head.weight"] == "model-00002-of-00002.safetensors"
    assert index["weight_map"]["model.layers.2.mlp.up_proj.weight"].startswith("model-00002")
    assert index["metadata"]["total_size"] == len(index["weight_map"]) * 4 * 2 * 4
    assert (out / "model-00002-of-00002.safetensors").read_bytes() == files[1].path.read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and not config["tie_word_embeddings"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temp left


def test_one_stage_gives_model_safetensors_and_the_tokenizer(tmp_path: Path) -> None:
    files = stage_files(tmp_path, [(0, 3)])
    tok = tmp_path / "data"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": {}}')
    (tok / "train.bin").write_bytes(b"\0\0")
    assert hfexport.find_tokenizer(str(tok / "train.bin"), "") == tok
    out = hfexport.write_export(tmp_path / "out", SPEC, files,
                                source=hfexport.ExportSource(tokenizer=str(tok)))
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]


def test_a_missing_or_doubled_tensor_is_named_and_nothing_is_written(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"holds tensor lm_head\.weight \(11 missing\)"):
        hfexport.write_export(tmp_path / "out", SPEC, stage_files(tmp_path, [(0, 2)]))
    both = stage_files(tmp_path, [(0, 2), (1, 3)])
    with pytest.raises(ExportError, match=r"tensor model\.layers\.1\..* stage 1's weights and"):
        hfexport.write_export(tmp_path / "out", SPEC, both)
    assert not (tmp_path / "out").exists()


def test_a_non_empty_destination_is_refused_unless_forced(tmp_path: Path) -> None:
    files = stage_files(tmp_path, [(0, 3)])
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"--out .*out exists and is not empty.*--force"):
        hfexport.write_export(out, SPEC, files)
    assert (out / "keep.txt").read_text() == "mine"
    hfexport.write_export(out, SPEC, files, force=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    hfexport.write_export(tmp_path / "empty", SPEC, files)  # an empty directory is fine too


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: a real disk that fills up (root only)."""
    with mounted_small_disk(tmp_path / "disk") as d:
        yield d


def test_a_full_disk_is_a_clear_error_and_leaves_nothing(tmp_path: Path, small_disk: Path) -> None:
    big = ModelSpec("big", vocab_size=32, n_layers=1, d_model=8, n_heads=2, seq_len=16,
                    arch="llama")
    path = tmp_path / "w.safetensors"
    names = [t.name for p in (EMBEDDING_INDEX, 0, HEAD_INDEX)
             for t in part_tensors(big, p).values()]
    save_file({n: np.zeros((64, 128), np.float32) for n in names}, path)  # 32 KiB each
    with pytest.raises(ExportError, match=r"filled up while exporting.*nothing was left"):
        hfexport.write_export(small_disk / "out", big, [StageFile(0, path)])
    assert list(small_disk.iterdir()) == []


def test_init_from_checks_name_the_directory_and_what_is_wrong(tmp_path: Path) -> None:
    d = tmp_path / "model"
    with pytest.raises(ValueError, match=r"--init-from .*model: no such directory"):
        hfdir.check_dir(d)
    d.mkdir()
    with pytest.raises(ValueError, match=r"it has no config\.json"):
        hfdir.check_dir(d)
    (d / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    with pytest.raises(ValueError, match=r"neither model\.safetensors nor"):
        hfdir.check_dir(d)
    with pytest.raises(ValueError, match=r"BertModel.*GPT2LMHeadModel"):
        hfdir.resolve_spec("", str(d))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match=r"names shard model-00001-of-00002\.safetensors, which"):
        hfdir.check_dir(d)
    save_file({"a": np.zeros(2, np.float32)}, d / "model-00001-of-00002.safetensors")
    first = hfdir.dir_hash(d)
    hfdir.check_dir(d, first)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match=r"not the checkpoint the job was planned with"):
        hfdir.check_dir(d, first)


def test_a_model_that_disagrees_with_init_from_is_refused_naming_both(tmp_path: Path) -> None:
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 256,
        "n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 64,
        "activation_function": "gelu_new"}))
    spec = hfdir.resolve_spec("", str(d), seq_len=32)
    assert (spec.n_layers, spec.d_model, spec.seq_len, spec.name) == (4, 64, 32, "hf:gpt2")
    with pytest.raises(ValueError, match=r"--model gpt-mini disagrees with --init-from .*gpt2"):
        hfdir.resolve_spec("gpt-mini", str(d))
    with pytest.raises(ValueError, match=r"--seq-len applies with --init-from"):
        hfdir.resolve_spec("gpt-tiny", "", seq_len=32)


# ---- what an export carries over: one source for agent local and the coordinator ----


def test_the_source_takes_the_imported_models_ids_and_tokenizer(tmp_path: Path) -> None:
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
        "hidden_size": 8, "rope_theta": 1e4}))
    (src / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [2, 7], "temperature": 0.6, "transformers_version": "x"}))
    (src / "tokenizer.json").write_text('{"model": {}}')
    source = hfexport.export_source("", str(src))
    assert source.config == {"architectures": ["MistralForCausalLM"], "bos_token_id": 1,
                             "eos_token_id": 2}
    assert source.generation == {"eos_token_id": [2, 7], "temperature": 0.6}
    assert source.tokenizer == str(src)
    # what the coordinator's status carries is the same source
    assert hfexport.ExportSource.from_proto(source.to_proto()) == source
    out = hfexport.write_export(tmp_path / "out", SPEC, stage_files(tmp_path, [(0, 3)]),
                                source=source)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"]
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": [2, 7], "temperature": 0.6}
    assert (out / "tokenizer.json").is_file()


def test_prepared_data_gives_its_end_of_text_id_and_nothing_gives_null(tmp_path: Path) -> None:
    from dtfm.core.tokenfiles import TokenMeta, write_meta

    data = tmp_path / "data"
    data.mkdir()
    (data / "tokenizer.json").write_text('{"model": {}}')
    (data / "train.bin").write_bytes(bytes(20))
    write_meta(data, TokenMeta(dtype="uint16", vocab_size=30, tokenizer_hash="h", eot_id=5,
                               eot_token="<|endoftext|>", max_token_id=29,
                               documents={"train": 1, "val": 1},
                               tokens={"train": 10, "val": 10}, val_fraction=0.1))
    source = hfexport.export_source(str(data / "train.bin"), "")
    assert source.config == {"bos_token_id": 5, "eos_token_id": 5}
    assert source.tokenizer == str(data)
    out = hfexport.write_export(tmp_path / "a", SPEC, stage_files(tmp_path, [(0, 3)]),
                                source=source)
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 5, "eos_token_id": 5}
    # no model, no prepared data (the bundled corpus, bare .bin files): the ids are null, not
    # left to a class default like GPT-2's 50256, outside the vocabulary
    gpt = ModelSpec("g", vocab_size=32, n_layers=1, d_model=8, n_heads=2, seq_len=16)
    none = hfexport.export_source(str(tmp_path / "missing"), "")
    assert none == hfexport.ExportSource()
    out = hfexport.write_export(tmp_path / "b", gpt, stage_files(tmp_path, [(0, 1)], gpt),
                                source=none)
    config = json.loads((out / "config.json").read_text())
    assert config["bos_token_id"] is None and config["eos_token_id"] is None
    transformers = pytest.importorskip("transformers")
    assert transformers.AutoConfig.from_pretrained(out).eos_token_id is None


def test_a_malformed_source_from_a_coordinator_is_refused() -> None:
    from protos.dtfm.v1 import coordinator_pb2

    with pytest.raises(ExportError, match=r"malformed export config .*upgrade it"):
        hfexport.ExportSource.from_proto(coordinator_pb2.ExportSource(config_json="[1]"))
    big = json.dumps({"eos_token_id": 1, "x": "y" * hfexport.MAX_SOURCE_JSON})
    with pytest.raises(ExportError, match=r"generation config"):
        hfexport.ExportSource.from_proto(coordinator_pb2.ExportSource(generation_json=big))
