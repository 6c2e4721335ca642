"""LoRA adapters on a stage: the frozen base's targeted Linears gain A and B, nothing else trains.

`apply` turns every projection `dtfm.core.lora.targeted` names, in every layer of the stage,
into a `LoraLinear`, which keeps the Linear's own `weight` and `bias` under the same names (so
loading the base from `--init-from`, `hfload`, and every name-keyed path still see the base as
they always did) and adds `lora_A` (R x in) and `lora_B` (out x R) as `peft` builds them:
A kaiming-uniform (a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))), B zeros, so training starts
from exactly the base model. Each layer's A comes from its own generator (seed, layer), so
every layout starts from the same adapters, which is what makes a 2 x 2 run equal a
single-process one. Every base parameter gets `requires_grad = False`: the optimizer
(`optim.make_optimizer`), the data-parallel exchange (`data_parallel.GradAverager`) and the
outer step (`outer.OuterSync`) take only trainable parameters, so the base is in none of them.
Under `--dtype bf16` every frozen tensor (the adapted Linears' weights and biases, embeddings,
norms, head) is held in bf16, half the bytes of full fine-tuning's fp32 masters, while the
adapters stay fp32 masters as every trained weight is: autocast computes the matmuls in bf16
either way, `hfload` copies the base's values into the bf16 tensors (rounding them once), and
the first stage widens its embedding back to fp32, so the residual stream stays fp32 as in full
fine-tuning; LayerNorms widen their bf16 parameters per call (`WideLayerNorm`). A bf16 base runs
under autocast only, which `--dtype bf16` always turns on. The merged export never sees this
copy: `loramerge` rebuilds the base from `--init-from` in its own precision.

A checkpoint holds only the adapters (`adapter_tensors`, under `peft`'s names, so an export is
those files joined) beside the optimizer state; `load_adapters` maps them back. The base is
always re-read from `--init-from` (or rebuilt from the seed for a preset).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from agent.worker.model import part_generator
from dtfm.core import lora as spec_lora
from dtfm.core.spec import ModelSpec, TrainConfig

# what the frozen base is held in, by the job's --dtype (the planner's `memory` prices the same)
BASE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# keeps the adapters' init stream apart from the base's (`model.build_part` uses the seed itself)
SEED_OFFSET = 0x10AA


class LoraLinear(nn.Linear):
    """y = x W^T + b + (alpha / r) * dropout(x) A^T B^T, with W and b frozen."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float,
                 gen: torch.Generator) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        factory = {"device": base.weight.device, "dtype": torch.float32}
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **factory)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **factory)
        bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform_(a=sqrt(5)), as peft
        with torch.no_grad():
            a = torch.empty(rank, self.in_features).uniform_(-bound, bound, generator=gen)
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.zero_()
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)  # a bf16 base: autocast casts x to match
        return out + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


def _child(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    *parents, name = path.split(".")
    for p in parents:
        root = getattr(root, p)
    return root, name


def apply(stage: nn.Module, spec: ModelSpec, cfg: TrainConfig) -> int:
    """Freeze the stage and put adapters on its targeted projections; returns the adapters'
    parameter count. A no-op returning 0 when `cfg.lora_rank` is 0."""
    if not cfg.lora_rank:
        return 0
    projs = spec_lora.targeted(spec, cfg.lora_targets)
    for p in stage.parameters():
        p.requires_grad_(False)
    count = 0
    for index, layer in stage.layers.items():
        gen = part_generator(cfg.seed + SEED_OFFSET, int(index))
        for proj in projs:
            parent, name = _child(layer, proj.ours)
            base = getattr(parent, name)
            wrapped = LoraLinear(base, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, gen)
            setattr(parent, name, wrapped)
            count += wrapped.lora_A.weight.numel() + wrapped.lora_B.weight.numel()
    _hold_base_in(stage, BASE_DTYPES[str(cfg.dtype)])
    return count


def _hold_base_in(stage: nn.Module, dtype: torch.dtype) -> None:
    """Cast every frozen floating-point parameter to `dtype` in place (the adapters, trained,
    stay fp32); below fp32 the embedding's output is widened back to fp32."""
    if dtype == torch.float32:
        return
    for p in stage.parameters():
        if not p.requires_grad and p.is_floating_point():
            p.data = p.data.to(dtype)
    for path, module in list(stage.named_modules()):
        if type(module) is nn.LayerNorm:
            parent, name = _child(stage, path)
            setattr(parent, name, WideLayerNorm(module))
    embed = getattr(stage, "embed", None)
    if embed is not None:
        embed.register_forward_hook(lambda _m, _i, out: out.float())


class WideLayerNorm(nn.LayerNorm):
    """A LayerNorm whose (bf16) weight and bias are widened to its input's dtype for the
    call, as CUDA's autocast does for layer_norm; the CPU's rejects fp32 input with bf16
    parameters. Keeps the LayerNorm's own parameters under the same names."""

    def __init__(self, base: nn.LayerNorm) -> None:
        nn.Module.__init__(self)
        self.normalized_shape, self.eps = base.normalized_shape, base.eps
        self.elementwise_affine = base.elementwise_affine
        self.weight, self.bias = base.weight, base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def wide(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(x.dtype)
        return F.layer_norm(x, self.normalized_shape, wide(self.weight), wide(self.bias),
                            self.eps)


def held(stage: nn.Module) -> dict[str, tuple[int, str]]:
    """{"trained": ..., "frozen": ...}: each kind's bytes and dtypes among the stage's real
    parameters, for the worker's log."""
    out: dict[str, tuple[int, set[str]]] = {"trained": (0, set()), "frozen": (0, set())}
    for p in stage.parameters():
        kind = "trained" if p.requires_grad else "frozen"
        n, dtypes = out[kind]
        out[kind] = (n + p.numel() * p.element_size(), dtypes | {str(p.dtype).split(".")[-1]})
    return {k: (n, ",".join(sorted(d))) for k, (n, d) in out.items()}


def _adapters(stage: nn.Module, spec: ModelSpec,
              cfg: TrainConfig) -> list[tuple[str, str, nn.Parameter]]:
    """(peft name, stage parameter name, parameter) of every adapter matrix of the stage."""
    out = []
    for index, layer in stage.layers.items():
        for proj in spec_lora.targeted(spec, cfg.lora_targets):
            module = layer.get_submodule(proj.ours)
            for which in ("A", "B"):
                param = getattr(module, f"lora_{which}").weight
                out.append((spec_lora.peft_name(spec, int(index), proj, which),
                            f"layers.{index}.{proj.ours}.lora_{which}.weight", param))
    return out


def adapter_tensors(stage: nn.Module, spec: ModelSpec, cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """The stage's adapters under `peft`'s names, contiguous on the CPU (a checkpoint's
    safetensors file, and so an export's)."""
    return {peft: p.detach().to("cpu").contiguous() for peft, _, p in _adapters(stage, spec, cfg)}


def adapter_state(tensors: Mapping[str, torch.Tensor], stage: nn.Module, spec: ModelSpec,
                  cfg: TrainConfig, *, piece: bool = False) -> dict[str, torch.Tensor]:
    """A checkpoint's adapter tensors (peft names) under the stage's parameter names, for
    `load_state_dict(strict=False)`. ValueError naming a missing tensor (a checkpoint of another
    rank or targets). With `piece` (one old stage's checkpoint after a re-split, holding only
    some of this stage's layers) only the adapters it holds: peft names carry the global layer
    index, so each lands on its layer whatever the cut, and `checkpoint.merge_states` refuses
    the whole when a layer's adapters are in none of the pieces."""
    out = {}
    for peft, ours, param in _adapters(stage, spec, cfg):
        if peft not in tensors:
            if piece:
                continue
            raise ValueError(f"the LoRA checkpoint lacks adapter {peft}: it was written with "
                             f"other --lora-targets or layers than this job's")
        if tensors[peft].shape != param.shape:  # another rank: torch's error names neither
            raise ValueError(f"the LoRA adapters' {peft} has shape {list(tensors[peft].shape)}, "
                             f"but this job's --lora-rank {cfg.lora_rank} needs "
                             f"{list(param.shape)}: they were trained with another rank")
        out[ours] = tensors[peft]
    return out


def load_adapters(stage: nn.Module, tensors: Mapping[str, torch.Tensor], spec: ModelSpec,
                  cfg: TrainConfig) -> None:
    """Copy adapter values (peft names) into the stage; the base is left as it is."""
    state = adapter_state(tensors, stage, spec, cfg)
    missing_or_extra = stage.load_state_dict(state, strict=False)
    if missing_or_extra.unexpected_keys:  # pragma: no cover - names come from the stage itself
        raise ValueError(f"unexpected adapter keys {missing_or_extra.unexpected_keys}")


def read_adapter_dir(path: str, check_only: bool = False) -> dict[str, torch.Tensor]:
    """`--lora-init`'s adapters (peft names), read from this machine's copy of the peft
    adapter directory; with `check_only`, only whether it is here (before the worker joins:
    a machine lacking it fails at once). ValueError naming the directory otherwise."""
    weights = Path(path) / spec_lora.ADAPTER_WEIGHTS
    if not weights.is_file():
        raise ValueError(f"--lora-init {path}: no {spec_lora.ADAPTER_WEIGHTS} there on this "
                         f"machine (every agent needs its own copy of the adapter directory, "
                         f"like --init-from)")
    if check_only:
        return {}
    try:
        return load_file(str(weights))
    except SafetensorError as exc:
        raise ValueError(f"--lora-init {path}: {weights} is not a readable safetensors file "
                         f"({exc})") from None


@torch.no_grad()
def merge_adapters(layers: Mapping[int, nn.Module], tensors: Mapping[str, torch.Tensor],
                   spec: ModelSpec, cfg: TrainConfig) -> None:
    """Fold adapters (peft names) into plain layers, in place: W += (alpha / r) B A for each
    targeted projection of each layer in `layers` (keyed by layer index). The one merge: the
    merged export (`loramerge`) and `agent generate` on an adapter directory both call it, so
    they compute the same weights. ValueError naming a missing adapter."""
    scaling = cfg.lora_alpha / cfg.lora_rank
    for index, layer in layers.items():
        for proj in spec_lora.targeted(spec, cfg.lora_targets):
            a, b = (spec_lora.peft_name(spec, int(index), proj, w) for w in ("A", "B"))
            if a not in tensors or b not in tensors:
                raise ValueError(f"the adapters lack {a if a not in tensors else b}: they were "
                                 f"trained with other targets or layers")
            module = layer.get_submodule(proj.ours)
            delta = tensors[b].float() @ tensors[a].float() * scaling
            module.weight.copy_(module.weight + delta.to(module.weight.dtype))
