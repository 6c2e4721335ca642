"""config.json <-> ModelSpec for the four supported architectures, and the errors for the rest.

The configs here are what `transformers` writes (5.x: `rope_parameters`; 4.x: `rope_theta`
and `rope_scaling`, as the Hub's Llama 3.2 and Qwen2.5 configs are); tests/agent/
test_hf_models.py checks the resulting models against `transformers` itself.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dtfm.core.hfconfig import (
    EMBEDDING_INDEX,
    HEAD_INDEX,
    SUPPORTED_ARCHITECTURES,
    HfConfigError,
    eos_token_ids,
    generation_config_from_spec,
    hf_config_from_spec,
    part_tensors,
    read_hf_config,
    spec_from_hf_config,
    ties_embeddings,
)
from dtfm.core.presets import get_preset
from dtfm.core.spec import ModelSpec

GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function":
        "gelu_new", "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
        "n_inner": None, "layer_norm_epsilon": 1e-5, "vocab_size": 50257,
        "bos_token_id": 50256, "eos_token_id": 50256}
# Llama-3.2-1B's config.json as the Hub has it (4.x keys).
LLAMA32_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "attention_bias": False, "bos_token_id": 128000,
              "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
              "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
              "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
              "rms_norm_eps": 1e-05, "rope_scaling": {
                  "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256}
QWEN25_05B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
              "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
              "hidden_size": 896, "intermediate_size": 4864, "max_position_embeddings": 32768,
              "max_window_layers": 24, "num_attention_heads": 14, "num_hidden_layers": 24,
              "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
              "sliding_window": 32768, "tie_word_embeddings": True, "use_sliding_window": False,
              "vocab_size": 151936}
MISTRAL_5X = {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": None,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "sliding_window": None,
              "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
              "vocab_size": 300}


def test_gpt2_config_is_dtfms_gpt_with_tanh_gelu_and_1024_positions() -> None:
    spec = spec_from_hf_config(GPT2)
    assert (spec.arch, spec.activation, spec.vocab_size, spec.n_layers, spec.d_model,
            spec.n_heads, spec.d_ff) == ("gpt", "gelu_tanh", 50257, 12, 768, 12, 3072)
    assert (spec.seq_len, spec.max_positions) == (1024, 1024)  # capped at n_positions
    assert spec.embedding_params() == (50257 + 1024) * 768
    assert spec_from_hf_config(GPT2, seq_len=256).seq_len == 256
    assert ties_embeddings(GPT2)  # GPT-2's default: tied
    with pytest.raises(HfConfigError, match="n_positions=1024"):
        spec_from_hf_config(GPT2, seq_len=2048)


def test_llama_3_2_1b_config_is_the_llama_1b_preset() -> None:
    spec = spec_from_hf_config(LLAMA32_1B, name="llama-1b")
    assert spec == get_preset("llama-1b")
    assert spec.seq_len == 2048  # 131072 positions, capped
    assert ties_embeddings(LLAMA32_1B)


def test_qwen2_5_config_is_the_qwen_preset_with_qkv_biases() -> None:
    spec = spec_from_hf_config(QWEN25_05B, name="qwen-0.5b")
    assert spec == get_preset("qwen-0.5b")
    assert spec.qkv_bias and spec.head_size == 64 and spec.kv_heads == 2


def test_transformers_5_rope_parameters_and_mistral_without_window() -> None:
    spec = spec_from_hf_config(MISTRAL_5X, seq_len=128)
    assert (spec.arch, spec.head_size, spec.kv_heads, spec.rope_type, spec.qkv_bias) == (
        "llama", 16, 2, "", False)
    v5 = dict(LLAMA32_1B, rope_parameters=dict(LLAMA32_1B["rope_scaling"], rope_theta=5e5))
    del v5["rope_scaling"], v5["rope_theta"]
    assert spec_from_hf_config(v5, name="llama-1b") == get_preset("llama-1b")
    linear = dict(MISTRAL_5X, rope_parameters={"rope_theta": 1e4, "rope_type": "linear",
                                               "factor": 2.0})
    assert spec_from_hf_config(linear).rope_factor == 2.0


@pytest.mark.parametrize("config,needle", [
    ({"architectures": ["BertForMaskedLM"]}, "BertForMaskedLM is not supported"),
    (dict(MISTRAL_5X, sliding_window=64), "sliding_window=64"),
    (dict(QWEN25_05B, use_sliding_window=True, sliding_window=4096), "sliding_window=4096"),
    (dict(LLAMA32_1B, rope_scaling={"rope_type": "yarn", "factor": 4.0}), "'yarn'"),
    (dict(QWEN25_05B, layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (dict(LLAMA32_1B, hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(LLAMA32_1B, attention_bias=True), "attention_bias=True"),
    (dict(LLAMA32_1B, num_key_value_heads=5), "n_kv_heads=5"),
    (dict(LLAMA32_1B, hidden_size="big"), "hidden_size must be an integer"),
    (dict(GPT2, activation_function="relu"), "activation_function='relu'"),
    (dict(GPT2, activation_function=[]), "activation_function=\\[\\]"),
    (dict(GPT2, scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (dict(MISTRAL_5X, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     r"rope_scaling \{.*\} and rope_parameters \{.*\} disagree"),
    (dict(LLAMA32_1B, rope_scaling="llama3"), "rope_scaling must be an object"),
    (dict(MISTRAL_5X, rope_parameters={"full_attention": {"rope_type": "default"}}),
     "rope_parameters holds settings per layer type"),
    (dict(MISTRAL_5X, partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
])
def test_unsupported_configs_name_what_is_wrong(config: dict, needle: str) -> None:
    with pytest.raises(HfConfigError, match=needle) as err:
        spec_from_hf_config(config)
    if "not supported; dtfm builds" in str(err.value):
        assert all(a in str(err.value) for a in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("config", [dict(GPT2, n_layer="x"), dict(LLAMA32_1B, vocab_size=0),
                                    dict(LLAMA32_1B, rope_scaling=dict(
                                        LLAMA32_1B["rope_scaling"], factor="x"))])
def test_errors_say_config_json_once(config: dict) -> None:
    with pytest.raises(HfConfigError) as err:
        spec_from_hf_config(config)
    assert str(err.value).count("config.json") == 1, str(err.value)


def test_rope_keys_combine_as_transformers_5_combines_them() -> None:
    """tests/agent/test_hf_models.py checks these against transformers' own logits."""
    top_theta = dict(MISTRAL_5X, rope_parameters={"rope_type": "default"}, rope_theta=1e6)
    assert spec_from_hf_config(top_theta).rope_theta == 1e6
    own = dict(top_theta, rope_parameters={"rope_type": "default", "rope_theta": 1e3})
    assert spec_from_hf_config(own).rope_theta == 1e3
    llama3 = {k: v for k, v in LLAMA32_1B["rope_scaling"].items()
              if k != "original_max_position_embeddings"}
    assert spec_from_hf_config(dict(LLAMA32_1B, rope_scaling=llama3)
                               ).rope_original_max_positions == 131072
    top = dict(LLAMA32_1B, original_max_position_embeddings=4096)
    assert spec_from_hf_config(top).rope_original_max_positions == 4096
    agree = dict(LLAMA32_1B, rope_parameters=dict(LLAMA32_1B["rope_scaling"], rope_theta=5e5))
    assert spec_from_hf_config(agree, name="llama-1b") == get_preset("llama-1b")
    # an empty or null rope_scaling is no rope_scaling
    assert spec_from_hf_config(dict(MISTRAL_5X, rope_scaling={})).rope_type == ""


def test_read_hf_config_names_the_missing_or_broken_file(tmp_path: Path) -> None:
    with pytest.raises(HfConfigError, match="config.json is missing"):
        read_hf_config(tmp_path)
    with pytest.raises(HfConfigError, match="does not exist"):
        read_hf_config(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(HfConfigError, match="not readable JSON"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(GPT2))
    assert read_hf_config(tmp_path) == GPT2


@pytest.mark.parametrize("source", [GPT2, LLAMA32_1B, QWEN25_05B, MISTRAL_5X])
def test_exported_config_reads_back_as_the_same_spec(source: dict) -> None:
    spec = spec_from_hf_config(source, seq_len=128)
    out = hf_config_from_spec(spec, source=source)
    assert out["architectures"] == source["architectures"]
    assert out["tie_word_embeddings"] is False and not ties_embeddings(out)
    assert json.loads(json.dumps(out)) == out
    assert replace(spec_from_hf_config(out, seq_len=128), name=spec.name) == spec
    assert eos_token_ids(out) == eos_token_ids(source)


def test_presets_export_to_their_architectures() -> None:
    assert hf_config_from_spec(get_preset("gpt-tiny"))["activation_function"] == "gelu"
    assert hf_config_from_spec(get_preset("qwen-0.5b"))["architectures"] == ["Qwen2ForCausalLM"]
    llama = hf_config_from_spec(get_preset("llama-1b"))
    assert llama["rope_scaling"]["rope_type"] == "llama3"
    assert spec_from_hf_config(llama, name="llama-1b") == get_preset("llama-1b")


def test_generation_config_keeps_the_token_ids_that_fit() -> None:
    spec = spec_from_hf_config(LLAMA32_1B)
    gen = generation_config_from_spec(spec, {"bos_token_id": 128000, "eos_token_id": [128001,
                                             128008], "do_sample": True, "temperature": 0.6})
    assert gen == {"bos_token_id": 128000, "eos_token_id": [128001, 128008], "do_sample": True,
                   "temperature": 0.6}
    tiny = replace(spec, vocab_size=1000)
    assert generation_config_from_spec(tiny, {"eos_token_id": 128001}) == {}
    assert eos_token_ids({"eos_token_id": None}, {"eos_token_id": 7}) == [7]
    assert eos_token_ids(None, {}) == []


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "qwen-0.5b"])
def test_part_tensors_name_every_layer_tensor_once(name: str) -> None:
    spec = get_preset(name)
    seen: list[str] = []
    for i in (EMBEDDING_INDEX, *range(spec.n_layers), HEAD_INDEX):
        seen += [t.name for t in part_tensors(spec, i).values()]
    assert len(seen) == len(set(seen))
    prefix = "transformer.h.1." if spec.arch == "gpt" else "model.layers.1."
    assert sum(n.startswith(prefix) for n in seen) == len(part_tensors(spec, 1))
    with pytest.raises(ValueError, match="outside the model's"):
        part_tensors(spec, spec.n_layers)


def test_model_spec_wire_round_trip_and_old_peers() -> None:
    from protos.dtfm.v1 import common_pb2

    for name in ("llama-1b", "qwen-0.5b", "gpt-tiny"):
        spec = get_preset(name)
        assert ModelSpec.from_proto(spec.to_proto()) == spec
    old = common_pb2.ModelSpec(name="x", vocab_size=256, n_layers=2, d_model=64, n_heads=4,
                               seq_len=64, d_ff=256)
    assert ModelSpec.from_proto(old) == ModelSpec("x", 256, 2, 64, 4, 64)


@pytest.mark.parametrize("kwargs,needle", [
    ({"arch": "mamba"}, "arch must be one of"),
    ({"n_kv_heads": 3}, "not a multiple of n_kv_heads=3"),
    ({"qkv_bias": True}, "for arch 'llama'"),
    ({"max_positions": 32}, "max_positions=32 is shorter"),
    ({"arch": "llama", "head_dim": 7}, "even head_dim"),
    ({"rope_theta": 0.0}, "rope_theta must be > 0"),
])
def test_model_spec_refuses_shapes_no_block_has(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        ModelSpec("x", 256, 2, 64, 4, 64, **kwargs)
