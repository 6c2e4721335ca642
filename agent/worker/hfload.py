"""Hugging Face safetensors checkpoints in and out of dtfm's model parts.

Owns reading a model directory's weights (`model.safetensors`, or the shards a
`model.safetensors.index.json` names) into the parts a worker holds, and handing a stage's
parameters back under Hugging Face names and layout for writing. Which tensor each parameter
is, and its layout, comes from `dtfm.core.hfconfig.part_tensors`; this module does the I/O.

Loading is memory-mapped (`safetensors.safe_open`) and selective: only the shards holding a
part's tensors are opened and only those tensors are read, one at a time, straight into the
parameter, so a worker's memory grows by its stage's share of the model, never the whole.

What a checkpoint may do that the loader absorbs: GPT-2 files saved without the
`transformer.` prefix; a tied model (config `tie_word_embeddings`, GPT-2's default): dtfm's
untied head starts as a copy of the input embedding, whether or not the file kept a
`lm_head.weight`; non-parameter buffers older
savers kept (GPT-2's `attn.bias` / `attn.masked_bias` masks, rotary `inv_freq`) are ignored.
Everything else is an error naming the tensor and the file: a missing or mis-shaped tensor, an
integer (quantized) tensor where a weight belongs, an index naming a file that is not there, a
directory with no weights. (`dtfm.core.hfdir.check_weights` checks the same from the headers
alone, before a command allocates the model.)
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from dtfm.core.hfconfig import (
    EMBEDDING_INDEX,
    HEAD_INDEX,
    HEAD_TENSOR,
    HfTensor,
    part_tensors,
    read_hf_config,
    source_tensor,
    stored_name,
    ties_embeddings,
)
from dtfm.core.spec import ModelSpec

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some savers wrote beside the parameters; no model computes anything from them.
IGNORED = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq)$")


class CheckpointError(ValueError):
    """A model directory whose weights do not fit the model; the message names what and where."""


@dataclass(frozen=True)
class Checkpoint:
    """Which file of a model directory holds each tensor (read from headers only)."""

    model_dir: Path
    files: dict[str, str]  # tensor name -> file name inside model_dir
    tied: bool  # the head is the input embedding

    @classmethod
    def open(cls, model_dir: str | Path) -> Checkpoint:
        root = Path(model_dir)
        config = read_hf_config(root)
        index, single = root / INDEX_FILE, root / WEIGHTS_FILE
        if index.is_file():
            files = _index_files(index)
        elif single.is_file():
            files = dict.fromkeys(_keys(single), WEIGHTS_FILE)
        else:
            raise CheckpointError(f"{root} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}: dtfm "
                                  f"reads safetensors weights (save_pretrained writes them)")
        return cls(root, files, ties_embeddings(config))

    def locate(self, name: str) -> str | None:
        """The name `name` has in this checkpoint (GPT-2's may lack `transformer.`), or None."""
        return stored_name(name, self.files)

    def source(self, spec: ModelSpec, tensor: HfTensor) -> str:
        """The checkpoint tensor a parameter loads from; CheckpointError if there is none."""
        name = source_tensor(spec, tensor, self.tied)
        found = self.locate(name)
        if found is None:
            where = INDEX_FILE if (self.model_dir / INDEX_FILE).is_file() else WEIGHTS_FILE
            untied = (" (config.json has tie_word_embeddings false, so the head is not the "
                      "input embedding)" if name == HEAD_TENSOR else "")
            raise CheckpointError(f"tensor {name} is missing from {self.model_dir / where}: the "
                                  f"model its config.json describes needs it{untied}")
        return found

    def read(self, wanted: Iterable[str]) -> Iterable[tuple[str, str, torch.Tensor]]:
        """(name, file, tensor) for each of `wanted`, opening each file once, in file order."""
        by_file: dict[str, list[str]] = {}
        for name in dict.fromkeys(wanted):
            by_file.setdefault(self.files[name], []).append(name)
        for file, names in sorted(by_file.items()):
            path = self.model_dir / file
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for name in names:
                        yield name, file, f.get_tensor(name)
            except SafetensorError as e:
                raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None


def _keys(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None


def _index_files(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index} is not a safetensors index with a weight_map: "
                              f"{e!r}") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: weight_map is not an object of tensor -> file")
    for name, file in weight_map.items():
        if not (index.parent / str(file)).is_file():
            raise CheckpointError(f"{index} names shard {file} (holding tensor {name}), which "
                                  f"is not in {index.parent}: copy the whole directory")
    return {str(k): str(v) for k, v in weight_map.items()}


def load_parts_from_hf(parts: Mapping[int, nn.Module], spec: ModelSpec,
                       model_dir: str | Path) -> None:
    """Copy each part's parameters (key: part index, as `build_part` takes it) in place from
    the Hugging Face directory `model_dir`, reading only the tensors these parts need."""
    ckpt = Checkpoint.open(model_dir)
    targets: dict[str, list[tuple[str, nn.Parameter, bool]]] = {}
    for index, part in parts.items():
        params = dict(part.named_parameters())
        for key, tensor in part_tensors(spec, index).items():
            source = ckpt.source(spec, tensor)
            targets.setdefault(source, []).append((tensor.name, params[key], tensor.transpose))
    with torch.no_grad():
        for source, file, value in ckpt.read(targets):
            if not value.dtype.is_floating_point:  # copy_ would cast it without a word
                raise CheckpointError(
                    f"tensor {source} in {ckpt.model_dir / file} holds {value.dtype} values, "
                    f"not a weight: dtfm loads floating-point tensors (float32, bfloat16, "
                    f"float16); give the unquantized checkpoint")
            for name, param, transpose in targets[source]:
                data = value.t() if transpose else value
                if data.shape != param.shape:
                    shown = tuple(value.shape)
                    need = tuple(param.shape)[::-1] if transpose else tuple(param.shape)
                    raise CheckpointError(
                        f"tensor {source} in {ckpt.model_dir / file} has shape {shown} but the "
                        f"model config.json describes needs {need} for {name}")
                param.copy_(data)


def unexpected_tensors(spec: ModelSpec, model_dir: str | Path) -> list[str]:
    """Tensors of the checkpoint that no part of the whole model uses (buffers aside), sorted."""
    ckpt = Checkpoint.open(model_dir)
    used = {ckpt.locate(t.name) for i in (EMBEDDING_INDEX, *range(spec.n_layers), HEAD_INDEX)
            for t in part_tensors(spec, i).values()}
    if ckpt.tied:
        used.add(HEAD_TENSOR)  # the tied head's own copy, where a saver kept one
    return sorted(n for n in ckpt.files if n not in used and not IGNORED.search(n))


def stage_tensors_hf(parts: Mapping[int, nn.Module], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The parts' parameters under Hugging Face names and layout, contiguous on the CPU, for
    writing a stage's safetensors file (checkpoints, exports). Written at once, while no step
    runs, so a CPU parameter already in HF layout is handed over as it is: only a transposed
    (GPT-2 Conv1D) or device-resident one is copied, and once."""
    out: dict[str, torch.Tensor] = {}
    for index, part in parts.items():
        params = dict(part.named_parameters())
        for key, tensor in part_tensors(spec, index).items():
            value = params[key].detach()
            value = value.t() if tensor.transpose else value
            out[tensor.name] = value.to("cpu").contiguous()
    return out


def check_init_dir(model_dir: str, expected_hash: str, spec: ModelSpec, *,
                   extra: bool) -> None:
    """Refuse (ValueError: a config error, so the job fails instead of retrying) a
    `--init-from` directory this machine lacks or holds another version of, and, with
    `extra` (one rank checks, once), a checkpoint holding tensors the model does not use."""
    from dtfm.core.hfdir import check_dir

    check_dir(model_dir, expected_hash, spec)  # spec: its sizes, before Stage allocates them
    if not extra:
        return
    extra_names = unexpected_tensors(spec, model_dir)
    if extra_names:
        raise ValueError(f"--init-from {model_dir}: its checkpoint holds {len(extra_names)} "
                         f"tensor(s) no part of {spec.name} uses, such as {extra_names[0]} ("
                         f"another "
                         f"architecture, or a model with more layers than its config.json says)")
