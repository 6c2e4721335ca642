"""Whether a `peft` adapter directory's tensors are the adapters its config and the job say.

`--lora-init DIR`, `--init-from ADAPTER_DIR` (`agent local`, `coordinator start`) and
`agent generate --model-dir ADAPTER_DIR` all read `adapter_model.safetensors` into adapters of
the rank, targets and layers the job (or adapter_config.json) gives. A file whose tensors
disagree (an `r` of 16 in the config, rank-4 tensors) would otherwise fail deep in torch's
`load_state_dict` or, merged by `agent generate`, silently run at the wrong scale. So before
anything loads it, `check_adapter_dir` reads the safetensors header alone (bounded:
`dtfm.core.hfdir.read_header`, never a header that claims a terabyte) and compares every
adapter's name and shape with what `dtfm.core.lora` says the job has, naming the file, the
tensor and what disagrees. Pure Python: the coordinator runs it too.
"""

from __future__ import annotations

from pathlib import Path

from dtfm.core import lora
from dtfm.core.hfdir import FLOAT_BYTES, read_header
from dtfm.core.spec import ModelSpec, TrainConfig


def _rank_source(d: Path, cfg: TrainConfig) -> str:
    """What set the rank the tensors are checked against, for the message."""
    try:
        said = lora.read_adapter_config(d, "").get("r")
    except ValueError:
        said = None
    return f"{lora.ADAPTER_CONFIG}'s r" if said == cfg.lora_rank else "--lora-rank"


def _disagreement(d: Path, name: str, shape: object, want: list[int],
                  cfg: TrainConfig) -> str:
    """What a tensor of the wrong shape disagrees with, and what to do."""
    rank = shape[0 if name.endswith("lora_A.weight") else 1] \
        if isinstance(shape, list) and len(shape) == 2 else None
    if rank is None or rank == cfg.lora_rank:
        return (f"but the base model's projection needs {want}: the adapters were trained "
                f"on another base than the one their {lora.ADAPTER_CONFIG} names")
    source = _rank_source(d, cfg)
    fix = (f"fix r in {d / lora.ADAPTER_CONFIG}" if source != "--lora-rank"
           else f"give --lora-rank {rank}")
    return f"(rank {rank}), but {source} is {cfg.lora_rank}: {fix}"


def expected_shapes(spec: ModelSpec, cfg: TrainConfig) -> dict[str, list[int]]:
    """Every adapter tensor of the job (peft names) -> its shape: A is rank x in, B out x
    rank."""
    out: dict[str, list[int]] = {}
    for layer in range(spec.n_layers):
        for p in lora.targeted(spec, cfg.lora_targets):
            out[lora.peft_name(spec, layer, p, "A")] = [cfg.lora_rank, p.in_features]
            out[lora.peft_name(spec, layer, p, "B")] = [p.out_features, cfg.lora_rank]
    return out


def check_adapter_dir(path: str | Path, spec: ModelSpec, cfg: TrainConfig,
                      flag: str = "--lora-init") -> None:
    """Refuse (ValueError naming `flag`, the file and what disagrees) an adapter directory
    whose `adapter_model.safetensors` does not hold exactly the adapters `cfg` (rank,
    targets) gives `spec`: missing, unreadable, a tensor of another shape (another rank),
    one the targets do not adapt, one that is not floating point."""
    d = Path(path)
    if not d.is_dir():
        raise ValueError(f"{flag} {d}: no such directory on this machine; give a peft adapter "
                         f"directory (adapter_config.json, {lora.ADAPTER_WEIGHTS}), such as "
                         f"one `agent local --export-dir` wrote for a --lora-rank job")
    weights = d / lora.ADAPTER_WEIGHTS
    if not weights.is_file():
        raise ValueError(f"{flag} {d}: it has no {lora.ADAPTER_WEIGHTS} (save the adapter "
                         f"with peft's save_pretrained(..., safe_serialization=True))")
    try:
        header = read_header(weights)
    except OSError as exc:
        raise ValueError(f"{flag}: {weights} cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None
    want = expected_shapes(spec, cfg)
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if name not in want:
            targets = ", ".join(lora.target_names(spec, cfg.lora_targets))
            raise ValueError(f"{flag}: {weights} holds {name}, which is not an adapter this "
                             f"job has (targets {targets}, {spec.n_layers} layers of "
                             f"{spec.name}): its "
                             f"{lora.ADAPTER_CONFIG}'s target_modules, or its base, are not "
                             f"these tensors'")
        shape = entry.get("shape") if isinstance(entry, dict) else None
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        if dtype not in FLOAT_BYTES:
            raise ValueError(f"{flag}: tensor {name} in {weights} holds {dtype} values, not "
                             f"an adapter's floating-point ones")
        if shape != want[name]:
            raise ValueError(f"{flag}: tensor {name} in {weights} has shape {shape} "
                             f"{_disagreement(d, name, shape, want[name], cfg)}")
    missing = sorted(set(want) - set(header))
    if missing:
        raise ValueError(f"{flag}: {weights} lacks adapter {missing[0]} ({len(missing)} "
                         f"missing): it was trained with other target_modules or on another "
                         f"base than this job's")
