"""Hugging Face `config.json` <-> `ModelSpec`, and which checkpoint tensor each parameter is.

Owns the mapping between dtfm's model and the four Hugging Face causal LMs whose blocks it
builds: `GPT2LMHeadModel` (dtfm's GPT with `activation="gelu_tanh"`, learned positions, Conv1D
weights stored transposed) and `LlamaForCausalLM`, `Qwen2ForCausalLM`, `MistralForCausalLM`
(dtfm's llama block; Qwen2 adds q/k/v biases; Mistral only without a sliding window that bites).
The coordinator plans from `spec_from_hf_config` alone (no torch, no tensors); a worker asks
`part_tensors` which tensors its parts need and `agent/worker/hfload.py` reads just those.

Both the configs `transformers` 4.x writes (`rope_theta` + `rope_scaling`) and 5.x's
(`rope_parameters`) are read, combined as transformers 5 combines them (`rope_settings`), so
that dtfm computes the model transformers computes; a RoPE dtfm does not compute, or both keys
saying different things, is refused. Exports write the 4.x keys, which both versions load.

dtfm trains the LM head as its own parameter: a checkpoint whose config ties it to the input
embedding (`tie_word_embeddings`, `ties_embeddings`) is imported by copying the embedding into
the head, and an export says `tie_word_embeddings: false`.

Pure Python: no torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtfm.core.spec import ModelSpec

GPT2 = "GPT2LMHeadModel"
LLAMA = "LlamaForCausalLM"
QWEN2 = "Qwen2ForCausalLM"
MISTRAL = "MistralForCausalLM"
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (GPT2, LLAMA, QWEN2, MISTRAL)
MODEL_TYPES = {GPT2: "gpt2", LLAMA: "llama", QWEN2: "qwen2", MISTRAL: "mistral"}
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
DEFAULT_SEQ_CAP = 2048  # seq_len 0: the config's max positions, at most this many
GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
EMBEDDING_INDEX = -1  # the part indices of agent/worker/model.py (kept equal by a test)
HEAD_INDEX = -2
HEAD_TENSOR = "lm_head.weight"
GPT2_PREFIX = "transformer."  # GPT-2 checkpoints saved from GPT2Model lack it


class HfConfigError(ValueError):
    """A config.json dtfm cannot build (or a directory without one); the message says why."""


def read_hf_config(model_dir: str | Path) -> dict:
    """The parsed config.json of a Hugging Face model directory."""
    path = Path(model_dir) / CONFIG_FILE
    if not Path(model_dir).is_dir():
        raise HfConfigError(f"model directory {model_dir} does not exist (it should hold "
                            f"{CONFIG_FILE} and model.safetensors)")
    if not path.is_file():
        raise HfConfigError(f"{path} is missing: a Hugging Face model directory holds "
                            f"{CONFIG_FILE} beside model.safetensors (save_pretrained writes both)")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HfConfigError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise HfConfigError(f"{path} holds a JSON {type(config).__name__}, not an object")
    return config


def architecture_of(config: dict) -> str:
    """The config's architecture, or an error naming it and listing the supported ones."""
    names = config.get("architectures") or []
    if not isinstance(names, list) or not names:
        names = [a for a, t in MODEL_TYPES.items() if t == config.get("model_type")]
    supported = [n for n in names if n in SUPPORTED_ARCHITECTURES]
    if not supported:
        given = ", ".join(map(str, names)) or f"model_type {config.get('model_type')!r}"
        raise HfConfigError(f"config.json: architecture {given} is not supported; dtfm builds "
                            f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return supported[0]


def ties_embeddings(config: dict) -> bool:
    """Whether the checkpoint's LM head is its input embedding (GPT-2's default: yes)."""
    return bool(config.get("tie_word_embeddings", architecture_of(config) == GPT2))


def _int(config: dict, key: str, *, default: Any = None, low: int = 1) -> int:
    value = config.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise HfConfigError(f"config.json: {key} must be an integer >= {low}, got {value!r}")
    return value


def _float(config: dict, key: str, default: float) -> float:
    value = config.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value > 0):
        raise HfConfigError(f"config.json: {key} must be a number > 0, got {value!r}")
    return float(value)


def _refuse(config: dict, key: str, ok: Any, why: str) -> None:
    value = config.get(key, ok)
    if value != ok:
        raise HfConfigError(f"config.json: {key}={value!r} is not supported: {why}")


def _seq_len(max_positions: int, seq_len: int) -> int:
    if seq_len < 0:
        raise HfConfigError(f"sequence length must be >= 0, got {seq_len}")
    return seq_len or min(max_positions, DEFAULT_SEQ_CAP)


def spec_from_hf_config(config: dict, *, name: str = "", seq_len: int = 0) -> ModelSpec:
    """The `ModelSpec` of the model `config` (a parsed config.json) describes.

    `seq_len` 0: the config's max positions capped at 2048. `name` empty: the architecture's
    model type. Raises `HfConfigError` (a ValueError) naming an unsupported architecture or the
    config key whose value dtfm's block cannot reproduce."""
    arch = architecture_of(config)
    name = name or str(config.get("_name_or_path") or MODEL_TYPES[arch])
    if arch == GPT2:
        return _gpt2_spec(config, name, seq_len)
    return _llama_spec(config, arch, name, seq_len)


def _gpt2_spec(config: dict, name: str, seq_len: int) -> ModelSpec:
    act = config.get("activation_function", "gelu_new")
    if not isinstance(act, str) or act not in GPT2_ACTIVATIONS:
        raise HfConfigError(f"config.json: activation_function={act!r} is not supported; dtfm's "
                            f"GPT block has {', '.join(GPT2_ACTIVATIONS)}")
    _refuse(config, "scale_attn_weights", True, "dtfm scales attention by 1/sqrt(head_dim)")
    _refuse(config, "scale_attn_by_inverse_layer_idx", False,
            "dtfm does not scale attention by layer")
    _refuse(config, "add_cross_attention", False, "dtfm builds decoder-only models")
    d = _int(config, "n_embd", default=768)
    positions = _int(config, "n_positions", default=1024)
    seq = _seq_len(positions, seq_len)
    if seq > positions:
        raise HfConfigError(f"sequence length {seq} is longer than config.json's n_positions="
                            f"{positions} (the learned position embedding's rows)")
    return _spec(name, vocab_size=_int(config, "vocab_size", default=50257),
                 n_layers=_int(config, "n_layer", default=12), d_model=d,
                 n_heads=_int(config, "n_head", default=12), seq_len=seq,
                 d_ff=_int(config, "n_inner", default=4 * d), arch="gpt",
                 norm_eps=_float(config, "layer_norm_epsilon", 1e-5),
                 activation=GPT2_ACTIVATIONS[act], max_positions=positions)


def _spec(name: str, **fields: Any) -> ModelSpec:
    """ModelSpec(name, **fields), its ValueError (shapes no block has) an HfConfigError.

    The fields are computed by the caller, outside: a key's own HfConfigError already says
    `config.json:`, and wrapping it again doubled the prefix."""
    try:
        return ModelSpec(name, **fields)
    except ValueError as e:
        raise HfConfigError(f"{CONFIG_FILE}: {e}") from None


ROPE_KEYS = ("rope_parameters", "rope_scaling")
SCALED_ROPE_TYPES = ("llama3", "yarn", "longrope")  # transformers gives them a pretraining length


def rope_settings(config: dict) -> tuple[dict[str, Any], str]:
    """The RoPE settings `transformers` (5.x, the version tests check against) applies to
    `config`, and the key they come from, resolved as its `convert_rope_params_to_dict` and
    `standardize_rope_params` do: a non-empty `rope_scaling` (4.x's key) replaces
    `rope_parameters` (5.x's) whole; `rope_theta` and `partial_rotary_factor` fall back to the
    top-level keys (theta then to 10000); `rope_type` to the legacy `type`, then "default"; a
    scaled type's `original_max_position_embeddings` is the top-level key, else its own, else
    `max_position_embeddings` (4.x reads only `rope_scaling` and `rope_theta`, the same
    whenever `rope_scaling` is set).

    A config that has both keys saying different things is refused: transformers silently
    drops `rope_parameters` then, and which of the two the checkpoint was trained with is
    not for dtfm to guess."""
    given = {key: _rope_object(config, key) for key in ROPE_KEYS}
    both = all(given.values())
    resolved = {key: _resolved_rope(config, value) for key, value in given.items()}
    if both and resolved["rope_scaling"] != resolved["rope_parameters"]:
        raise HfConfigError(
            f"config.json: rope_scaling {_show(given['rope_scaling'])} and rope_parameters "
            f"{_show(given['rope_parameters'])} disagree; transformers applies rope_scaling "
            f"(theta {resolved['rope_scaling']['rope_theta']:g}) and ignores rope_parameters: "
            f"delete the key the checkpoint was not trained with")
    key = "rope_scaling" if given["rope_scaling"] else "rope_parameters"
    return resolved[key], key


def _rope_object(config: dict, key: str) -> dict:
    value = config.get(key)
    if value is None or value == {}:
        return {}
    if not isinstance(value, dict):
        raise HfConfigError(f"config.json: {key} must be an object (or null), got {value!r}")
    nested = [k for k, v in value.items() if isinstance(v, dict)]
    if nested:
        raise HfConfigError(f"config.json: {key} holds settings per layer type ({nested[0]!r}); "
                            f"dtfm's rotary embedding is the same in every layer: give one "
                            f"object of rope_type, rope_theta, ...")
    return value


def _resolved_rope(config: dict, given: dict) -> dict[str, Any]:
    out = dict(given)
    out.pop("type", None)
    out["rope_type"] = given.get("rope_type", given.get("type", "default"))
    out.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if config.get("partial_rotary_factor") is not None:
        out.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    if out["rope_type"] in SCALED_ROPE_TYPES:
        original = config.get("original_max_position_embeddings")
        if original is not None:
            out["original_max_position_embeddings"] = original
        out.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return out


def _show(rope: dict) -> str:
    return json.dumps(rope, sort_keys=True)


def _rope(config: dict) -> dict[str, Any]:
    """The ModelSpec rope fields of `rope_settings(config)`; HfConfigError naming the key for
    a RoPE dtfm's rotary embedding does not compute."""
    params, key = rope_settings(config)
    kind = params["rope_type"]
    _refuse(params, "partial_rotary_factor", 1.0, "dtfm rotates every dimension of a head")
    try:
        theta = _float(params, "rope_theta", 10000.0)
        if kind == "default":
            return {"rope_theta": theta}
        if kind == "linear":
            return {"rope_theta": theta, "rope_type": "linear",
                    "rope_factor": _float(params, "factor", 1.0)}
        if kind == "llama3":
            return {"rope_theta": theta, "rope_type": "llama3",
                    "rope_factor": _float(params, "factor", 1.0),
                    "rope_low_freq_factor": _float(params, "low_freq_factor", 1.0),
                    "rope_high_freq_factor": _float(params, "high_freq_factor", 4.0),
                    "rope_original_max_positions": _int(
                        params, "original_max_position_embeddings")}
    except HfConfigError as e:
        raise HfConfigError(str(e).replace(f"{CONFIG_FILE}: ", f"{CONFIG_FILE}: {key}.",
                                           1)) from None
    raise HfConfigError(f"config.json: {key} rope_type {kind!r} is not supported: dtfm's rotary "
                        f"embedding computes default, linear and llama3; a checkpoint trained "
                        f"with {kind!r} would not compute what it was trained to")


def _llama_spec(config: dict, arch: str, name: str, seq_len: int) -> ModelSpec:
    _refuse(config, "hidden_act", "silu", "dtfm's llama block has a SwiGLU (silu) MLP")
    _refuse(config, "mlp_bias", False, "dtfm's llama block has no MLP biases")
    if arch != QWEN2:
        _refuse(config, "attention_bias", False, "dtfm's llama block has biases on q/k/v only "
                "(Qwen2's layout), not on the output projection")
    positions = _int(config, "max_position_embeddings", default=2048)
    _check_window(config, arch, positions)
    d, heads = _int(config, "hidden_size"), _int(config, "num_attention_heads")
    seq = _seq_len(positions, seq_len)
    derived = d // heads if d % heads == 0 else None
    head_dim = _int(config, "head_dim", default=derived)
    kv_heads = _int(config, "num_key_value_heads", default=heads)
    return _spec(  # sizes equal to their derived default stay 0, as presets write them
        name, vocab_size=_int(config, "vocab_size"),
        n_layers=_int(config, "num_hidden_layers"), d_model=d, n_heads=heads,
        seq_len=seq, d_ff=_int(config, "intermediate_size"), arch="llama",
        n_kv_heads=0 if kv_heads == heads else kv_heads,
        head_dim=0 if head_dim == derived else head_dim,
        norm_eps=_float(config, "rms_norm_eps", 1e-6), qkv_bias=arch == QWEN2,
        max_positions=positions, **_rope(config))


def _check_window(config: dict, arch: str, positions: int) -> None:
    """Refuse a sliding-window attention that is narrower than the model's context: dtfm's
    attention is full causal (a window as wide as every position is no window)."""
    window = config.get("sliding_window")
    kinds = set(config.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise HfConfigError(f"config.json: layer_types {sorted(kinds)} is not supported: dtfm's "
                            f"attention is full causal in every layer")
    if arch == QWEN2 and not config.get("use_sliding_window", False):
        return
    if arch == LLAMA or window is None:
        return
    if not isinstance(window, int) or window < positions:
        raise HfConfigError(
            f"config.json: sliding_window={window!r} (narrower than max_position_embeddings="
            f"{positions}) is not supported: dtfm's attention is full causal; a checkpoint "
            f"without a sliding window (null) imports")


def hf_config_from_spec(spec: ModelSpec, *, source: dict | None = None) -> dict:
    """The config.json an export writes for `spec`: GPT2LMHeadModel for the gpt block,
    Qwen2ForCausalLM for the llama block with q/k/v biases, LlamaForCausalLM otherwise (or
    `source`'s architecture, the imported config, where it is Mistral). Token ids (bos, eos,
    pad) are carried over from `source`. Always `tie_word_embeddings: false`."""
    base: dict[str, Any] = {"torch_dtype": "float32", "tie_word_embeddings": False,
                            "vocab_size": spec.vocab_size}
    if source:
        base.update({k: source[k] for k in TOKEN_ID_KEYS if source.get(k) is not None})
    if spec.arch == "gpt":
        return {"architectures": [GPT2], "model_type": "gpt2", **base,
                "n_embd": spec.d_model, "n_layer": spec.n_layers, "n_head": spec.n_heads,
                "n_inner": spec.d_ff, "n_positions": spec.positions, "n_ctx": spec.positions,
                "activation_function": "gelu_new" if spec.activation == "gelu_tanh" else "gelu",
                "layer_norm_epsilon": spec.norm_eps, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}
    arch = QWEN2 if spec.qkv_bias else LLAMA
    if not spec.qkv_bias and source and _source_arch(source) == MISTRAL:
        arch = MISTRAL
    out = {"architectures": [arch], "model_type": MODEL_TYPES[arch], **base,
           "hidden_size": spec.d_model, "intermediate_size": spec.d_ff,
           "num_hidden_layers": spec.n_layers, "num_attention_heads": spec.n_heads,
           "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_size,
           "hidden_act": "silu", "rms_norm_eps": spec.norm_eps,
           "max_position_embeddings": spec.positions, "rope_theta": spec.rope_theta,
           "rope_scaling": _rope_scaling(spec)}
    if arch == LLAMA:
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(sliding_window=None, use_sliding_window=False)
    return out


def _source_arch(source: dict) -> str | None:
    try:
        return architecture_of(source)
    except HfConfigError:
        return None


def _rope_scaling(spec: ModelSpec) -> dict | None:
    if spec.rope_type == "linear":
        return {"rope_type": "linear", "factor": spec.rope_factor}
    if spec.rope_type == "llama3":
        return {"rope_type": "llama3", "factor": spec.rope_factor,
                "low_freq_factor": spec.rope_low_freq_factor,
                "high_freq_factor": spec.rope_high_freq_factor,
                "original_max_position_embeddings": spec.rope_original_max_positions}
    return None


def generation_config_from_spec(spec: ModelSpec, source: dict | None = None) -> dict:
    """The generation_config.json an export writes: the token ids `source` (the imported
    generation_config.json or config.json) names that fit the vocabulary, and its sampling
    settings where it has them."""
    out: dict[str, Any] = {}
    for key, value in (source or {}).items():
        if key in TOKEN_ID_KEYS:
            ids = value if isinstance(value, list) else [value]
            if value is not None and all(isinstance(i, int) and 0 <= i < spec.vocab_size
                                         for i in ids):
                out[key] = value
        elif key in ("do_sample", "temperature", "top_k", "top_p"):
            out[key] = value
    return out


def eos_token_ids(*configs: dict | None) -> list[int]:
    """The end-of-sequence ids generation stops at: the first of `configs` (generation_config
    before config, as transformers reads them) that names any."""
    for config in configs:
        value = (config or {}).get("eos_token_id")
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        return [int(i) for i in ids]
    return []


@dataclass(frozen=True)
class HfTensor:
    """Where one dtfm parameter lives in a Hugging Face checkpoint."""

    name: str  # the global HF tensor name, e.g. "model.layers.3.self_attn.q_proj.weight"
    transpose: bool  # True where the HF layout is the transpose of dtfm's (GPT-2 Conv1D)


def part_tensors(spec: ModelSpec, part_index: int) -> dict[str, HfTensor]:
    """The HF tensor of every parameter of part `part_index` (EMBEDDING_INDEX, HEAD_INDEX or
    a layer), keyed by the parameter's name inside the part `build_part` returns."""
    if part_index not in (EMBEDDING_INDEX, HEAD_INDEX) and not 0 <= part_index < spec.n_layers:
        raise ValueError(f"part index {part_index} is outside the model's {spec.n_layers} layers")
    if spec.arch == "gpt":
        return _gpt2_part(part_index)
    return _llama_part(spec, part_index)


def _gpt2_part(i: int) -> dict[str, HfTensor]:
    if i == EMBEDDING_INDEX:
        return {"wte.weight": HfTensor("transformer.wte.weight", False),
                "wpe.weight": HfTensor("transformer.wpe.weight", False)}
    if i == HEAD_INDEX:
        return {"ln_f.weight": HfTensor("transformer.ln_f.weight", False),
                "ln_f.bias": HfTensor("transformer.ln_f.bias", False),
                "lm_head.weight": HfTensor("lm_head.weight", False)}
    h = f"transformer.h.{i}"
    out = {}
    for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
        for p in ("weight", "bias"):
            out[f"{ours}.{p}"] = HfTensor(f"{h}.{theirs}.{p}", False)
    for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                         ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
        out[f"{ours}.weight"] = HfTensor(f"{h}.{theirs}.weight", True)
        out[f"{ours}.bias"] = HfTensor(f"{h}.{theirs}.bias", False)
    return out


LLAMA_LAYER = (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm"),
               ("attn.q_proj", "self_attn.q_proj"), ("attn.k_proj", "self_attn.k_proj"),
               ("attn.v_proj", "self_attn.v_proj"), ("attn.o_proj", "self_attn.o_proj"),
               ("mlp.gate_proj", "mlp.gate_proj"), ("mlp.up_proj", "mlp.up_proj"),
               ("mlp.down_proj", "mlp.down_proj"))


def _llama_part(spec: ModelSpec, i: int) -> dict[str, HfTensor]:
    if i == EMBEDDING_INDEX:
        return {"wte.weight": HfTensor("model.embed_tokens.weight", False)}
    if i == HEAD_INDEX:
        return {"ln_f.weight": HfTensor("model.norm.weight", False),
                "lm_head.weight": HfTensor("lm_head.weight", False)}
    out = {f"{ours}.weight": HfTensor(f"model.layers.{i}.{theirs}.weight", False)
           for ours, theirs in LLAMA_LAYER}
    if spec.qkv_bias:
        for p in ("q_proj", "k_proj", "v_proj"):
            out[f"attn.{p}.bias"] = HfTensor(f"model.layers.{i}.self_attn.{p}.bias", False)
    return out


def embedding_tensor(spec: ModelSpec) -> str:
    """The input embedding's HF name (what a tied checkpoint's head is)."""
    return part_tensors(spec, EMBEDDING_INDEX)["wte.weight"].name


def stored_name(name: str, names: Container[str]) -> str | None:
    """The name HF tensor `name` has among a checkpoint's `names` (GPT-2 files saved from
    `GPT2Model` lack `transformer.`), or None where it is not there."""
    if name in names:
        return name
    short = name.removeprefix(GPT2_PREFIX)
    return short if short != name and short in names else None


def source_tensor(spec: ModelSpec, tensor: HfTensor, tied: bool) -> str:
    """The HF tensor a parameter starts from: its own, or, for the head of a checkpoint whose
    head is its input embedding (`tied`), the embedding (dtfm's untied head starts as it)."""
    return embedding_tensor(spec) if tensor.name == HEAD_TENSOR and tied else tensor.name
