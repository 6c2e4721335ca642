"""A LoRA job's export: a `peft` adapter directory, assembled from stage checkpoints, no torch.

Under `--lora-rank` each stage checkpoint's safetensors file holds that stage's adapters under
`peft`'s names (`agent.worker.lora.adapter_tensors`), so the export is those files joined into
one `adapter_model.safetensors` plus `adapter_config.json` (`dtfm.core.lora.adapter_config`,
naming the base), which `peft.PeftModel.from_pretrained(base, DIR)` loads. Joining is done on
the bytes (header JSON + data, `_join`): the coordinator's export must not need torch, and the
tensors are copied exactly. Before anything is written the headers are checked: every adapter
the job has appears in exactly one stage file, and nothing else does. The directory is written
like a full export (`hfexport`): in a temporary sibling, then renamed; a non-empty destination
only with `force`.

A cluster's export (`coordinator export`, `coordinator start --export-dir`) learns that its job
trains adapters, and with what settings, from the coordinator's status: `lora_source` puts the
job's LoRA settings and base in `ExportSource.lora`, `config_from_source` reads them back.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

from dtfm.core import hfexport
from dtfm.core import lora as spec_lora
from dtfm.core.hfdir import read_header
from dtfm.core.hfexport import ExportError, StageFile
from dtfm.core.spec import ModelSpec, TrainConfig
from protos.dtfm.v1 import coordinator_pb2


def lora_source(cfg: TrainConfig) -> coordinator_pb2.LoraSource:
    """What the coordinator's status carries of a LoRA job (`ExportSource.lora`) for an export
    made elsewhere: peft's settings, the base (the job's `--init-from`, absolute) and the seed
    a preset's base is rebuilt from."""
    return coordinator_pb2.LoraSource(
        rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
        targets=cfg.lora_targets, seed=cfg.seed,
        base=str(Path(cfg.init_from).absolute()) if cfg.init_from else "")


def config_from_source(msg: coordinator_pb2.LoraSource, spec: ModelSpec,
                       where: str = "the coordinator") -> TrainConfig:
    """The training config an export of the job needs (the LoRA fields, `init_from` = the
    base, the seed), from a status's `ExportSource.lora`; ExportError when it is not a LoRA
    setting `spec` can have (a malformed or foreign status)."""
    cfg = TrainConfig(lora_rank=msg.rank, lora_alpha=msg.alpha, lora_dropout=msg.dropout,
                      lora_targets=msg.targets, init_from=msg.base, seed=msg.seed)
    try:
        if msg.rank < 1:
            raise ValueError(f"rank {msg.rank} < 1")
        cfg.validate()
        spec_lora.check(cfg, spec)
    except ValueError as exc:
        raise ExportError(f"{where} sent LoRA settings this model cannot have ({exc}): "
                          f"upgrade it") from None
    return cfg


def expected_adapters(spec: ModelSpec, cfg: TrainConfig) -> set[str]:
    """Every adapter tensor name the job has (`peft`'s)."""
    projs = spec_lora.targeted(spec, cfg.lora_targets)
    return {spec_lora.peft_name(spec, layer, p, which)
            for layer in range(spec.n_layers) for p in projs for which in ("A", "B")}


def _join(files: Sequence[StageFile], out: Path, want: set[str]) -> int:
    """Write one safetensors file holding every tensor of `files`; returns its tensor count.
    ExportError when a tensor is doubled, missing or not an adapter of the job."""
    entries: list[tuple[str, dict, StageFile, int]] = []  # name, header entry, file, data start
    seen: dict[str, int] = {}
    for f in files:
        try:
            header = read_header(f.path)
        except (OSError, ValueError) as exc:
            raise ExportError(f"stage {f.stage}'s adapters {f.path}: {exc}") from None
        start = 8 + struct.unpack("<Q", f.path.open("rb").read(8))[0]
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if name in seen:
                raise ExportError(f"adapter {name} is in stage {f.stage}'s file and stage "
                                  f"{seen[name]}'s: the stage files are of different splits")
            seen[name] = f.stage
            entries.append((name, entry, f, start))
    missing, extra = sorted(want - set(seen)), sorted(set(seen) - want)
    if missing:
        raise ExportError(f"no stage file holds adapter {missing[0]} ({len(missing)} missing): "
                          f"the stages' files are not this LoRA job's whole set of adapters")
    if extra:
        raise ExportError(f"tensor {extra[0]} of stage {seen[extra[0]]}'s file is not an "
                          f"adapter of this job (a checkpoint of full fine-tuning, or of other "
                          f"--lora-targets?)")
    entries.sort(key=lambda e: e[0])
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, entry, _, _ in entries:
        begin, end = (int(x) for x in entry["data_offsets"])
        header[name] = {"dtype": entry["dtype"], "shape": entry["shape"],
                        "data_offsets": [offset, offset + end - begin]}
        offset += end - begin
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
    with open(out, "wb") as fo:
        fo.write(struct.pack("<Q", len(raw)) + raw)
        for _, entry, f, start in entries:
            begin, end = (int(x) for x in entry["data_offsets"])
            with open(f.path, "rb") as fi:
                fi.seek(start + begin)
                fo.write(fi.read(end - begin))
        fo.flush()
        os.fsync(fo.fileno())
    os.chmod(out, 0o644)
    return len(entries)


def write_adapter_export(out: str | Path, spec: ModelSpec, cfg: TrainConfig,
                         files: Sequence[StageFile], *, base: str = "",
                         tokenizer: str | Path | None = None, force: bool = False,
                         progress: Callable[[str], None] | None = None) -> Path:
    """Write the `peft` adapter directory `out` from the stages' adapter files. `base` names
    the base model in `adapter_config.json` (default: the job's `--init-from`, absolute)."""
    out = Path(out).absolute()
    say = progress or (lambda line: None)
    hfexport.check_destination(out, force)
    files = sorted(files, key=lambda f: f.stage)
    if [f.stage for f in files] != list(range(len(files))) or not files:
        raise ExportError(f"stage files {[f.stage for f in files]} are not stages 0..S-1")
    toks = hfexport.tokenizer_sources(tokenizer) if tokenizer else []
    base = base or (str(Path(cfg.init_from).absolute()) if cfg.init_from else spec.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        n = _join(files, tmp / spec_lora.ADAPTER_WEIGHTS, expected_adapters(spec, cfg))
        with open(tmp / spec_lora.ADAPTER_CONFIG, "w", encoding="utf-8") as f:
            json.dump(spec_lora.adapter_config(spec, cfg, base), f, indent=2, sort_keys=True)
            f.write("\n")
        for src in toks:
            shutil.copyfile(src, tmp / src.name)
        hfexport.install(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"exporting the adapters to {out} failed: {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"export: wrote {out} ({n} adapter tensors of rank {cfg.lora_rank}, base {base})")
    return out
