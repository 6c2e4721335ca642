"""`--export-merged`: a LoRA job's base with its adapters folded in, as a plain Hugging Face
directory that `transformers` loads without `peft`.

W' = W + (alpha / r) * B A for every adapted projection, computed once in fp32 on the whole
model (the base from `--init-from`, or rebuilt from the seed for a preset, exactly as every
worker built it), then written through the ordinary export (`dtfm.core.hfexport.write_export`)
so the directory is the same kind a full fine-tune exports. Needs the whole model in one
process's memory, unlike the adapter export, which only joins files.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from agent.worker import lora
from agent.worker.hfload import load_parts_from_hf, stage_tensors_hf
from agent.worker.stage import Stage
from dtfm.core.hfexport import (
    ExportError,
    ExportSource,
    StageFile,
    check_destination,
    make_parent,
    write_export,
)
from dtfm.core.mergerequest import EXPORT_ERROR_EXIT, MergeRequest
from dtfm.core.spec import ModelSpec, TrainConfig


def merged_model(spec: ModelSpec, cfg: TrainConfig, adapters: dict[str, torch.Tensor]) -> Stage:
    """The whole model as one stage: the job's base with `adapters` (peft names) merged in
    (`lora.merge_adapters`); its projections stay plain."""
    model = Stage(spec, 0, spec.n_layers, cfg.seed)
    if cfg.init_from:
        load_parts_from_hf(model.parts(), spec, cfg.init_from)
    lora.merge_adapters({int(i): layer for i, layer in model.layers.items()}, adapters, spec,
                        cfg)
    return model


def write_merged_export(out: str | Path, spec: ModelSpec, cfg: TrainConfig,
                        files: Sequence[StageFile], *, source: ExportSource | None = None,
                        force: bool = False,
                        progress: Callable[[str], None] | None = None) -> Path:
    """Write `out` from the stages' adapter files: base + merged adapters, HF layout. The
    merged weights go to a temporary file beside `out` first: a place that cannot take it
    (unwritable, full) is an ExportError saying so, never the writer's own exception."""
    out = Path(out).absolute()
    check_destination(out, force)
    parent = make_parent(out)  # before the merge: an unwritable place fails first and fast
    adapters: dict[str, torch.Tensor] = {}
    for f in files:
        adapters.update(load_file(str(f.path)))
    model = merged_model(spec, cfg, adapters)
    tmp = parent / f".{out.name}.merged-{os.getpid()}-{secrets.token_hex(4)}.safetensors"
    try:
        try:
            save_file(stage_tensors_hf(model.parts(), spec), str(tmp))
        except (OSError, SafetensorError) as exc:
            raise ExportError(f"writing the merged weights to {tmp} failed ({exc}): give an "
                              f"export directory on a disk you can write, with room for the "
                              f"whole model") from None
        return write_export(out, spec, [StageFile(0, tmp)], source=source, force=force,
                            progress=progress)
    finally:
        tmp.unlink(missing_ok=True)


def write_lora_export(out: str | Path, spec: ModelSpec, cfg: TrainConfig,
                      files: Sequence[StageFile], *, source: ExportSource | None = None,
                      force: bool = False, merged: bool = False,
                      progress: Callable[[str], None] | None = None) -> Path:
    """A LoRA job's `--export-dir`: the peft adapter directory, or with `merged` the base with
    the adapters merged in."""
    if merged:
        return write_merged_export(out, spec, cfg, files, source=source, force=force,
                                   progress=progress)
    from dtfm.core.loraexport import write_adapter_export

    return write_adapter_export(out, spec, cfg, files,
                                tokenizer=source.tokenizer if source else None, force=force,
                                progress=progress)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m agent.worker.loramerge REQUEST`: the merge the torch-free coordinator runs
    as a child (`dtfm.launcher.run_merge`): progress on stdout, an ExportError's message as
    the last line of stderr with status EXPORT_ERROR_EXIT."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m agent.worker.loramerge REQUEST.json", file=sys.stderr)
        return EXPORT_ERROR_EXIT
    req = MergeRequest.loads(Path(args[0]).read_text())
    try:
        write_merged_export(req.out, req.spec, req.cfg, req.files, source=req.source,
                            force=req.force, progress=lambda line: print(line, flush=True))
    except ExportError as exc:
        print(exc, file=sys.stderr)
        return EXPORT_ERROR_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
