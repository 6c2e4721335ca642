"""A local Hugging Face model directory as `--init-from` names it: which spec it gives, what
identifies it, and whether a machine holds the same one.

The coordinator reads only `config.json` (the spec, via `dtfm.core.hfconfig`); every agent
holds the whole directory on its own disk, like `--data`, and each worker later reads only
its stage's tensors (`agent.worker.hfload`). So that a machine holding another checkpoint
under the same path fails at once instead of training on it, the coordinator hashes
`config.json` and the index of a sharded checkpoint and every worker compares its own copy's
hash (`check_dir`) before it joins (a single file of other shapes fails its load, naming the
tensor). Before anything allocates the model, the weights' safetensors headers must give each
part the sizes config.json does (`check_weights`: on the coordinator where it holds them, and
on every worker), so a config.json of absurd sizes is a one-line error, not the allocator's.

Pure Python: no torch, no grpc (the coordinator and the agent daemon use it).
"""

from __future__ import annotations

import hashlib
import json
import math
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


def weights_files(model_dir: str | Path, flag: str = "--init-from") -> list[Path]:
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
    raise ValueError(f"{flag} {d}: it holds neither {SINGLE} nor {INDEX} (a Hugging Face "
                     f"model saved with safe_serialization; .bin checkpoints are not read)")


# Bytes per value of the safetensors dtypes a weight may have (anything else, such as the
# integers of a quantized checkpoint, is not a weight dtfm trains).
FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


def check_weights(spec: ModelSpec, model_dir: str | Path, flag: str = "--init-from") -> None:
    """Refuse (ValueError naming `flag`, the tensor and its file) weights that cannot be the
    model `spec` (from the directory's config.json) describes, from the safetensors headers
    alone, before anything is allocated: a needed tensor missing, not floating point, or whose
    header claims bytes the file does not hold, and a part (embedding, layer, head) whose
    tensors hold another number of values than `spec` gives it. A config.json of absurd sizes
    thus fails here in one line, not in the allocator; what passes is at most what the files
    really hold. (Each tensor's exact shape is checked as it loads, agent/worker/hfload.py.)"""
    from dtfm.core.hfconfig import (
        EMBEDDING_INDEX,
        HEAD_INDEX,
        part_tensors,
        read_hf_config,
        source_tensor,
        stored_name,
        ties_embeddings,
    )

    d = Path(model_dir)
    tied = ties_embeddings(read_hf_config(d))
    stored = _stored_tensors(d, flag)
    sizes = {EMBEDDING_INDEX: spec.embedding_params(), HEAD_INDEX: spec.head_params()}
    for index in (EMBEDDING_INDEX, *range(spec.n_layers), HEAD_INDEX):
        have, names = 0, []
        for tensor in part_tensors(spec, index).values():
            name = stored_name(source_tensor(spec, tensor, tied), stored)
            if name is None:
                raise ValueError(f"{flag} {d}: tensor {source_tensor(spec, tensor, tied)} is "
                                 f"missing from its weights; the model config.json describes "
                                 f"needs it")
            have += _values(flag, name, stored[name])
            names.append(name)
        need = sizes.get(index, spec.layer_params())
        if have != need:
            part = {EMBEDDING_INDEX: "the embedding", HEAD_INDEX: "the head"}.get(
                index, f"layer {index}")
            raise ValueError(
                f"{flag} {d}: {part}'s tensors ({names[0]}, ...) hold {have:,} values, but "
                f"config.json's sizes (vocabulary {spec.vocab_size}, d_model {spec.d_model}, "
                f"d_ff {spec.d_ff}, {spec.n_heads} heads of {spec.head_size}) give it "
                f"{need:,}: config.json does not describe these weights")


def _stored_tensors(d: Path, flag: str) -> dict[str, tuple[Path, dict, int]]:
    """Every tensor of `d`'s safetensors files -> (its file, its header entry, the bytes of
    data that file really holds)."""
    out: dict[str, tuple[Path, dict, int]] = {}
    for path in weights_files(d, flag):
        header = read_header(path)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        data_bytes = path.stat().st_size - 8 - n
        out.update((name, (path, entry, data_bytes)) for name, entry in header.items()
                   if name != "__metadata__")
    return out


def _values(flag: str, name: str, stored: tuple[Path, dict, int]) -> int:
    """The number of values of tensor `name`, refusing one that is not floating point or
    whose header claims bytes its file does not hold."""
    path, entry, data_bytes = stored
    try:
        dtype, shape = entry["dtype"], [int(n) for n in entry["shape"]]
        begin, end = (int(n) for n in entry["data_offsets"])
    except (TypeError, KeyError, ValueError):
        raise ValueError(f"{flag}: {path} is not a safetensors file: its header entry for "
                         f"{name} lacks a dtype, shape or data_offsets") from None
    if dtype not in FLOAT_BYTES:
        raise ValueError(f"{flag}: tensor {name} in {path} holds {dtype} values, not a weight: "
                         f"dtfm loads floating-point tensors ({', '.join(FLOAT_BYTES)}); "
                         f"give the unquantized checkpoint")
    values = math.prod(shape)
    if min(shape, default=0) < 0 or not 0 <= begin <= end <= data_bytes or \
            end - begin != values * FLOAT_BYTES[dtype]:
        raise ValueError(f"{flag}: tensor {name} in {path} claims shape {shape} of {dtype} at "
                         f"bytes {begin}..{end}, but the file holds {data_bytes} bytes of "
                         f"data: the file is damaged or not what its header says")
    return values


def dir_hash(model_dir: str | Path) -> str:
    """What identifies the checkpoint in `model_dir`: sha256 of its config.json and, for a
    sharded one, its index (the coordinator needs only those two files). Reads no tensor."""
    d = Path(model_dir)
    h = hashlib.sha256()
    h.update((d / CONFIG).read_bytes())
    if (d / INDEX).is_file():
        h.update(b"\0index\0" + (d / INDEX).read_bytes())
    return h.hexdigest()


def check_dir(model_dir: str | Path, expected_hash: str = "",
              spec: ModelSpec | None = None) -> None:
    """Raise ValueError (naming the directory and what to do) unless this machine holds the
    checkpoint `model_dir` names: config.json, its weights, and, given `expected_hash`, the
    same files as the machine that planned the job; given `spec`, weights of its sizes
    (`check_weights`: before a worker allocates its stage)."""
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
    if spec is not None:
        check_weights(spec, d)


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
    both). `seq_len` (only with `init_from`) shortens the sequences trained on. Where this
    machine holds the weights too, they must be the model's (`check_weights`), so absurd
    sizes in config.json fail here, not in a worker's allocator; a coordinator holding only
    config.json leaves that to each worker (`check_dir` with the spec)."""
    from dtfm.core.presets import get_preset

    if not init_from:
        if seq_len:
            raise ValueError("--seq-len applies with --init-from; for a preset give "
                             f"--model {model or 'NAME'}:seq={seq_len}")
        return get_preset(model)
    spec = spec_from_dir(init_from, seq_len=seq_len)
    try:
        weights_files(init_from)
    except ValueError:
        pass  # not on this machine: every worker checks its own copy
    else:
        check_weights(spec, init_from)
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
