"""`dtfm.core.hfdir.check_weights`: weights that cannot be the model config.json describes are
refused from the safetensors headers alone, before any command allocates the model (issue 31:
a config.json of absurd sizes ended in the allocator's traceback; an integer tensor was cast
into a weight without a word).

Pure Python (numpy writes the files): the coordinator runs this without torch.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from dtfm.core import hfdir
from dtfm.core.hfconfig import EMBEDDING_INDEX, HEAD_INDEX, part_tensors, spec_from_hf_config

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
          "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
          "num_attention_heads": 2, "max_position_embeddings": 32, "tie_word_embeddings": True}


def _shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The HF tensors of the llama `config` with their HF shapes (tied: no lm_head)."""
    d, ff, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out.update({f"{p}.input_layernorm.weight": (d,), f"{p}.post_attention_layernorm.weight":
                    (d,), f"{p}.mlp.gate_proj.weight": (ff, d), f"{p}.mlp.up_proj.weight": (ff, d),
                    f"{p}.mlp.down_proj.weight": (d, ff)})
        out.update({f"{p}.self_attn.{x}_proj.weight": (d, d) for x in "qkvo"})
    return out


def _model(tmp_path: Path, config: dict = CONFIG, **tensors: np.ndarray) -> Path:
    d = tmp_path / "model"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    weights = {n: np.ones(s, np.float32) for n, s in _shapes(CONFIG).items()}
    weights.update({k.replace("__", "."): v for k, v in tensors.items()})
    save_file(weights, str(d / "model.safetensors"))
    return d


def test_the_model_config_json_describes_passes(tmp_path: Path) -> None:
    d = _model(tmp_path)
    spec = hfdir.resolve_spec("", str(d))
    hfdir.check_weights(spec, d)
    hfdir.check_dir(d, hfdir.dir_hash(d), spec)
    names = {t.name for i in (EMBEDDING_INDEX, 0, 1, HEAD_INDEX)
             for t in part_tensors(spec, i).values()}
    assert names - set(_shapes(CONFIG)) == {"lm_head.weight"}  # tied: the embedding


@pytest.mark.parametrize("sizes", [{"hidden_size": 1_000_000, "head_dim": 8},
                                   {"vocab_size": 10**12}, {"intermediate_size": 10**9}])
def test_absurd_sizes_in_config_json_are_refused_in_one_line(tmp_path: Path,
                                                             sizes: dict) -> None:
    d = _model(tmp_path, {**CONFIG, **sizes})
    with pytest.raises(ValueError, match=r"^--init-from .*model: .*'s tensors .* hold [\d,]+ "
                       r"values, but config\.json's sizes .* give it [\d,]+: config\.json does "
                       r"not describe these weights$"):
        hfdir.resolve_spec("", str(d))


def test_more_layers_than_the_weights_hold_names_the_missing_tensor(tmp_path: Path) -> None:
    d = _model(tmp_path, {**CONFIG, "num_hidden_layers": 3})
    with pytest.raises(ValueError, match=r"tensor model\.layers\.2\..* is missing"):
        hfdir.resolve_spec("", str(d))


def test_a_coordinator_holding_only_config_json_leaves_the_check_to_each_worker(
        tmp_path: Path) -> None:
    d = tmp_path / "config-only"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**CONFIG, "hidden_size": 1_000_000,
                                               "head_dim": 8}))
    spec = hfdir.resolve_spec("", str(d))  # plans from config.json, as documented
    worker = _model(tmp_path, {**CONFIG, "hidden_size": 1_000_000, "head_dim": 8})
    with pytest.raises(ValueError, match="config.json does not describe these weights"):
        hfdir.check_dir(worker, hfdir.dir_hash(worker), spec)


def test_an_integer_tensor_is_not_a_weight(tmp_path: Path) -> None:
    d = _model(tmp_path, model__layers__1__mlp__up_proj__weight=np.ones((24, 16), np.int32))
    with pytest.raises(ValueError, match=r"tensor model\.layers\.1\.mlp\.up_proj\.weight in "
                       r".*model\.safetensors holds I32 values, not a weight"):
        hfdir.resolve_spec("", str(d))
    # a tensor no part uses may be anything (the load refuses extras separately)
    d2 = _model(tmp_path / "x", extra=np.ones(3, np.int64))
    hfdir.check_weights(hfdir.resolve_spec("", str(d2)), d2)


def test_a_header_claiming_more_than_its_file_holds_is_refused(tmp_path: Path) -> None:
    d = _model(tmp_path)
    path = d / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    entry = header["model.layers.0.mlp.down_proj.weight"]
    entry["shape"] = [16, 24_000]  # the data offsets stay those of 16 x 24
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    spec = spec_from_hf_config({**CONFIG, "intermediate_size": 24_000})
    with pytest.raises(ValueError, match=r"down_proj\.weight in .* claims shape \[16, 24000\] "
                       r"of F32 at bytes \d+\.\.\d+, but the file holds \d+ bytes"):
        hfdir.check_weights(spec, d)
