"""A local Hugging Face model directory as `--init-from` names it: which spec it gives, what
identifies it, and whether a machine holds the same one.

The coordinator reads only `config.json` (the spec, via `dtfm.core.hfconfig`); every agent
holds the whole directory on its own disk, like `--data`, and each worker later reads only
its stage's tensors (`agent.worker.hfload`). So that a machine holding another checkpoint
under the same path fails at once instead of training on it, the coordinator hashes
`config.json` and the index of a sharded checkpoint and every worker compares its own copy's
hash (`check_dir`) before it joins (a single file of other shapes fails its load, naming the
tensor).

Pure Python: no torch, no grpc (the coordinator and the agent daemon use it).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from dtfm.core.spec import ModelSpec

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit on a header


def read_header(path: str | Path) -> dict:
    """The JSON header of a safetensors file (tensor name -> dtype, shape, data_offsets, plus
    `__metadata__`): its first 8 bytes are the header's length, little-endian. ValueError
    naming the file when it is not one."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path} is not a safetensors file: it is shorter than 8 bytes")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise ValueError(f"{path} is not a safetensors file: its header claims {n} bytes")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError:
        header = None
    if len(raw) != n or not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is not JSON")
    return header


def weights_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of `model_dir`: the shards its index names, or the single file.
    ValueError naming what is missing and what a directory must hold."""
    d = Path(model_dir)
    index = d / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index} is not a safetensors index (no weight_map: {exc!r})") \
                from None
        missing = [n for n in names if not (d / n).is_file()]
        if missing:
            raise ValueError(f"{index} names shard {missing[0]}, which is not in {d}"
                             + (f" ({len(missing)} shards missing)" if len(missing) > 1 else ""))
        return [d / n for n in names]
    if (d / SINGLE).is_file():
        return [d / SINGLE]
    raise ValueError(f"--init-from {d}: it holds neither {SINGLE} nor {INDEX} (a Hugging Face "
                     f"model saved with safe_serialization; .bin checkpoints are not read)")


def dir_hash(model_dir: str | Path) -> str:
    """What identifies the checkpoint in `model_dir`: sha256 of its config.json and, for a
    sharded one, its index (the coordinator needs only those two files). Reads no tensor."""
    d = Path(model_dir)
    h = hashlib.sha256()
    h.update((d / CONFIG).read_bytes())
    if (d / INDEX).is_file():
        h.update(b"\0index\0" + (d / INDEX).read_bytes())
    return h.hexdigest()


def check_dir(model_dir: str | Path, expected_hash: str = "") -> None:
    """Raise ValueError (naming the directory and what to do) unless this machine holds the
    checkpoint `model_dir` names: config.json, its weights, and, given `expected_hash`, the
    same files as the machine that planned the job."""
    d = Path(model_dir)
    if not d.is_dir():
        raise ValueError(f"--init-from {d}: no such directory on this machine (every agent "
                         f"needs its own copy of the model directory, like --data)")
    if not (d / CONFIG).is_file():
        raise ValueError(f"--init-from {d}: it has no {CONFIG} (give a directory a Hugging "
                         f"Face model was saved to with save_pretrained)")
    weights_files(d)
    if expected_hash:
        mine = dir_hash(d)
        if mine != expected_hash:
            raise ValueError(
                f"--init-from {d} on this machine is not the checkpoint the job was planned "
                f"with: its config.json and index hash to {mine[:12]}..., the coordinator's to "
                f"{expected_hash[:12]}...; copy the same model directory to every agent")


def spec_from_dir(model_dir: str | Path, *, seq_len: int = 0, name: str = "") -> ModelSpec:
    """The model spec `model_dir`'s config.json describes (reads only config.json)."""
    from dtfm.core.hfconfig import read_hf_config, spec_from_hf_config

    d = Path(model_dir)
    config = read_hf_config(d)
    return spec_from_hf_config(config, name=name or f"hf:{d.name}", seq_len=seq_len)


def same_shape(a: ModelSpec, b: ModelSpec) -> bool:
    """Whether two specs build the same parameters (names and the sequence length aside)."""
    from dataclasses import asdict

    skip = ("name", "seq_len", "max_positions")
    da, db = asdict(a), asdict(b)
    return all(da[k] == db.get(k) for k in da if k not in skip)


def resolve_spec(model: str, init_from: str, seq_len: int = 0) -> ModelSpec:
    """The spec a job trains: preset `model`, or, with `init_from`, the directory's
    config.json; both given, the preset must describe the same model (ValueError naming
    both). `seq_len` (only with `init_from`) shortens the sequences trained on."""
    from dtfm.core.presets import get_preset

    if not init_from:
        if seq_len:
            raise ValueError("--seq-len applies with --init-from; for a preset give "
                             f"--model {model or 'NAME'}:seq={seq_len}")
        return get_preset(model)
    spec = spec_from_dir(init_from, seq_len=seq_len)
    if model:
        preset = get_preset(model)
        if not same_shape(preset, spec):
            raise ValueError(
                f"--model {model} disagrees with --init-from {init_from}: the preset has "
                f"{preset.n_layers} layers, d_model {preset.d_model}, vocabulary "
                f"{preset.vocab_size}, the checkpoint's config.json {spec.n_layers} layers, "
                f"d_model {spec.d_model}, vocabulary {spec.vocab_size}; drop --model (the "
                f"spec comes from config.json)")
    return spec


def model_tokenizer_hash(init_from: str) -> str | None:
    """The fingerprint (`dtfm.core.tokenfiles.tokenizer_hash`) of the tokenizer.json beside
    the model `--init-from` names, which prepared data (`meta.json`) must have been tokenized
    with; None without --init-from or without a tokenizer.json there (nothing to compare)."""
    from dtfm.core.tokenfiles import TOKENIZER_NAME, tokenizer_hash

    if not init_from or not (Path(init_from) / TOKENIZER_NAME).is_file():
        return None
    return tokenizer_hash(init_from)
