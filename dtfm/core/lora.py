"""LoRA adapters, the torch-free half: which projections a job adapts, their sizes and names.

`--lora-rank R` (`TrainConfig.lora_rank`, 0 = off) freezes the base model and trains, beside
each targeted projection W (out x in), two matrices A (R x in) and B (out x R) with
y = W x + (alpha / R) * B A dropout(x), exactly as `peft`'s `LoraConfig` means its `r`,
`lora_alpha`, `lora_dropout` and `target_modules`. Targets are module names as the Hugging Face
model spells them, matched as `peft` matches them: a target names a module whose full name
equals it or ends with `.` + it (`q_proj` adapts every layer's `self_attn.q_proj`; GPT-2's
`c_proj` both its attention's and its MLP's output projection).

Planner (numpy only), config validation and the worker must agree on what is adapted and how
many numbers that is, and the exporter on each tensor's `peft` name, so all of that lives here,
with no torch: `targeted` (the projections of one layer), `layer_adapter_params` and
`stage_adapter_params` (what a stage trains and exchanges), `peft_name` (an adapter tensor's
name in `adapter_model.safetensors`) and `adapter_config` (`adapter_config.json`).
Embeddings, norms and the head are never adapted.

`--init-from` may name a `peft` adapter directory instead of a model: `from_adapter_dir`
turns that, at the edge, into `--init-from BASE` (adapter_config.json's
`base_model_name_or_path`) and `--lora-init DIR` (the adapters training starts from), with
the rank, alpha, dropout and targets the directory was trained with, so nothing past the
flags needs to know.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dtfm.core.spec import ModelSpec, TrainConfig

# peft's defaults for the families dtfm trains: every attention and MLP projection
DEFAULT_TARGETS = {
    "gpt": ("c_attn", "c_proj", "c_fc"),
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
PEFT_PREFIX = "base_model.model."  # what peft's save_pretrained puts before a model's names
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class Projection:
    """One Linear of a layer that may carry an adapter."""

    ours: str  # its module path inside dtfm's layer part, e.g. "attn.q_proj"
    theirs: str  # its module path inside a Hugging Face layer, e.g. "self_attn.q_proj"
    in_features: int
    out_features: int


def projections(spec: ModelSpec) -> list[Projection]:
    """Every projection of one layer of `spec` (the same in every layer), in module order."""
    d, ff = spec.d_model, spec.d_ff
    if spec.arch == "gpt":
        return [Projection("attn.qkv", "attn.c_attn", d, 3 * d),
                Projection("attn.proj", "attn.c_proj", d, d),
                Projection("mlp.fc", "mlp.c_fc", d, ff),
                Projection("mlp.proj", "mlp.c_proj", ff, d)]
    q, kv = spec.n_heads * spec.head_size, spec.kv_heads * spec.head_size
    return [Projection("attn.q_proj", "self_attn.q_proj", d, q),
            Projection("attn.k_proj", "self_attn.k_proj", d, kv),
            Projection("attn.v_proj", "self_attn.v_proj", d, kv),
            Projection("attn.o_proj", "self_attn.o_proj", q, d),
            Projection("mlp.gate_proj", "mlp.gate_proj", d, ff),
            Projection("mlp.up_proj", "mlp.up_proj", d, ff),
            Projection("mlp.down_proj", "mlp.down_proj", ff, d)]


def layer_prefix(spec: ModelSpec, layer: int) -> str:
    """A layer's module path in the Hugging Face model (`model.layers.3`, `transformer.h.3`)."""
    return f"transformer.h.{layer}" if spec.arch == "gpt" else f"model.layers.{layer}"


def target_names(spec: ModelSpec, targets: str) -> tuple[str, ...]:
    """The `--lora-targets` list (comma-separated), or the family's default where empty."""
    names = tuple(t.strip() for t in targets.split(",") if t.strip())
    return names or DEFAULT_TARGETS[spec.arch]


def _matches(full: str, target: str) -> bool:
    return full == target or full.endswith("." + target)  # peft's rule for a string list


def targeted(spec: ModelSpec, targets: str) -> list[Projection]:
    """The projections of each layer that `targets` adapts. ValueError naming the target and
    the modules there are, for a target that names none of them."""
    projs = projections(spec)
    full = {p: f"{layer_prefix(spec, 0)}.{p.theirs}" for p in projs}
    for target in target_names(spec, targets):
        if not any(_matches(full[p], target) for p in projs):
            raise ValueError(
                f"--lora-targets {target!r} names no module of a {spec.arch} layer "
                f"({spec.name}); its projections are "
                f"{', '.join(p.theirs.split('.')[-1] for p in projs)} (embeddings, norms and "
                f"the head are not adapted)")
    names = target_names(spec, targets)
    return [p for p in projs if any(_matches(full[p], t) for t in names)]


def layer_adapter_params(spec: ModelSpec, rank: int, targets: str = "") -> int:
    """Numbers one layer's adapters hold: R x (in + out) per targeted projection."""
    if rank == 0:
        return 0
    return sum(rank * (p.in_features + p.out_features) for p in targeted(spec, targets))


def stage_adapter_params(spec: ModelSpec, layer_begin: int, layer_end: int, rank: int,
                         targets: str = "") -> int:
    """Numbers the stage holding layers [layer_begin, layer_end) trains under LoRA."""
    return (layer_end - layer_begin) * layer_adapter_params(spec, rank, targets)


def trained_params(spec: ModelSpec, layer_begin: int, layer_end: int, rank: int = 0,
                   targets: str = "") -> int:
    """Parameters a stage trains (and exchanges between replicas): its adapters under LoRA
    (`rank` > 0), else all of them. The planner prices the data-parallel exchange with it."""
    if rank:
        return stage_adapter_params(spec, layer_begin, layer_end, rank, targets)
    return spec.stage_params(layer_begin, layer_end)


def peft_name(spec: ModelSpec, layer: int, proj: Projection, which: str) -> str:
    """The name `peft` saves adapter matrix `which` ("A" or "B") of `proj` in `layer` under."""
    return f"{PEFT_PREFIX}{layer_prefix(spec, layer)}.{proj.theirs}.lora_{which}.weight"


def max_rank(spec: ModelSpec, targets: str = "") -> tuple[int, Projection]:
    """The largest rank the projections `targets` adapts can take, and the projection that
    bounds it: a rank above a Linear's smaller side (min of in and out features) adds no
    expressiveness, only memory (B A is at most that rank anyway)."""
    smallest = min(targeted(spec, targets), key=lambda p: min(p.in_features, p.out_features))
    return min(smallest.in_features, smallest.out_features), smallest


def check(cfg: TrainConfig, spec: ModelSpec) -> None:
    """Raise ValueError naming the flag, for LoRA settings this model cannot train with: a
    LoRA flag without --lora-rank (it would be silently ignored), targets naming no module, a
    rank above the adapted projections' sizes."""
    if not cfg.lora_rank:
        defaults = TrainConfig()
        for flag, given, default in (("--lora-targets", cfg.lora_targets, ""),
                                     ("--lora-alpha", cfg.lora_alpha, defaults.lora_alpha),
                                     ("--lora-dropout", cfg.lora_dropout,
                                      defaults.lora_dropout)):
            if given != default:
                raise ValueError(f"{flag} applies with --lora-rank R > 0, which is not given "
                                 f"(full fine-tuning would ignore {flag}): add --lora-rank, or "
                                 f"drop {flag}")
        return
    bound, proj = max_rank(spec, cfg.lora_targets)
    if cfg.lora_rank > bound:
        raise ValueError(f"--lora-rank {cfg.lora_rank} exceeds {bound}, the smaller side of "
                         f"{proj.theirs} ({proj.in_features} in x {proj.out_features} out in "
                         f"{spec.name}), the smallest projection it adapts: a rank above that "
                         f"adds only memory; give --lora-rank {bound} or less")


def adapter_config(spec: ModelSpec, cfg: TrainConfig, base: str) -> dict[str, Any]:
    """`adapter_config.json` for a job's adapters: what `peft.PeftModel.from_pretrained`
    reads. `base` names the base model (its directory or hub id)."""
    names = sorted({p.theirs.split(".")[-1] for p in targeted(spec, cfg.lora_targets)})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha,
        "lora_dropout": cfg.lora_dropout,
        "target_modules": names,
        "bias": "none",
        "fan_in_fan_out": spec.arch == "gpt",  # GPT-2's Conv1D stores W transposed
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def is_adapter_dir(path: str | Path) -> bool:
    """Whether `path` is a `peft` adapter directory (adapter_config.json, no config.json)."""
    d = Path(path)
    return (d / ADAPTER_CONFIG).is_file() and not (d / "config.json").is_file()


# adapter_config.json settings dtfm's adapters do not have: their value must be peft's default
_PLAIN = {"bias": "none", "use_dora": False, "use_rslora": False, "modules_to_save": None,
          "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}


def read_adapter_config(d: Path, flag: str) -> dict[str, Any]:
    """`d`'s adapter_config.json, checked to be a LoRA adapter dtfm can continue; ValueError
    naming `flag`, the directory and the file otherwise (unreadable JSON included)."""
    where = f"{flag} {d}"
    try:
        config = json.loads((d / ADAPTER_CONFIG).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{where}: {ADAPTER_CONFIG} is not readable JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise ValueError(f"{where}: {ADAPTER_CONFIG} is not a LoRA adapter's (peft_type "
                         f"{config.get('peft_type') if isinstance(config, dict) else None!r}); "
                         f"dtfm continues LoRA adapters only")
    for key, plain in _PLAIN.items():
        if config.get(key, plain) not in (plain, [] if plain is None else plain):
            raise ValueError(f"{where}: {ADAPTER_CONFIG} sets {key} = {config[key]!r}, which "
                             f"dtfm's adapters do not have (it needs {plain!r})")
    r, targets = config.get("r"), config.get("target_modules")
    if not (isinstance(r, int) and r >= 1):
        raise ValueError(f"{where}: {ADAPTER_CONFIG}'s r must be a count >= 1, got {r!r}")
    if not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
        raise ValueError(f"{where}: {ADAPTER_CONFIG}'s target_modules must be a list of module "
                         f"names (dtfm does not take a regular expression), got {targets!r}")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not (
            alpha > 0 and math.isfinite(alpha)):
        raise ValueError(f"{where}: {ADAPTER_CONFIG}'s lora_alpha must be a number > 0, got "
                         f"{alpha!r}")
    if not (d / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"{where}: it has no {ADAPTER_WEIGHTS} (save the adapter with "
                         f"peft's save_pretrained(..., safe_serialization=True))")
    return config


def from_adapter_dir(cfg: TrainConfig, flag: str = "--init-from") -> TrainConfig:
    """`cfg` with `--init-from ADAPTER_DIR` resolved: init_from = its base (absolute),
    lora_init = the directory (absolute), and the LoRA settings it was trained with where the
    flags leave them at their defaults (dropout: the flag's when given). ValueError naming
    both values when a flag contradicts the directory, or the base is not here. `cfg`
    itself when `--init-from` is not an adapter directory. `flag`: what the messages call
    the directory (`agent generate` reads one as `--model-dir`)."""
    if not cfg.init_from or not is_adapter_dir(cfg.init_from):
        return cfg
    d = Path(cfg.init_from).absolute()
    if cfg.lora_init:
        raise ValueError(f"--init-from {d} is an adapter directory and --lora-init "
                         f"{cfg.lora_init} another: give one")
    config = read_adapter_config(d, flag)
    base = str(config.get("base_model_name_or_path") or "")
    if not base or not (Path(base) / "config.json").is_file():
        raise ValueError(f"{flag} {d} is a peft adapter directory whose base {base!r} "
                         f"(adapter_config.json's base_model_name_or_path) is not a model "
                         f"directory on this machine: put the base there, or give --init-from "
                         f"BASE --lora-init {d}")
    alpha = float(config.get("lora_alpha", 8))
    targets = ",".join(config["target_modules"])
    defaults = TrainConfig()
    for flag, given, default, theirs in (
            ("--lora-rank", cfg.lora_rank, defaults.lora_rank, config["r"]),
            ("--lora-alpha", cfg.lora_alpha, defaults.lora_alpha, alpha)):
        if given != default and given != theirs:
            raise ValueError(f"{flag} {given} contradicts the adapters of --init-from {d} "
                             f"(trained with {theirs}): drop {flag} to continue them")
    if cfg.lora_targets and set(target_names_of(cfg.lora_targets)) != set(
            config["target_modules"]):
        raise ValueError(f"--lora-targets {cfg.lora_targets} contradicts the adapters of "
                         f"--init-from {d} (targets {targets}): drop --lora-targets to "
                         f"continue them")
    dropout = cfg.lora_dropout if cfg.lora_dropout != defaults.lora_dropout else float(
        config.get("lora_dropout", 0.0))
    return replace(cfg, init_from=str(Path(base).absolute()), lora_init=str(d),
                   lora_rank=config["r"], lora_alpha=alpha, lora_dropout=dropout,
                   lora_targets=targets)


def target_names_of(targets: str) -> list[str]:
    """The names a `--lora-targets` value lists (no family default filled in)."""
    return [t.strip() for t in targets.split(",") if t.strip()]
