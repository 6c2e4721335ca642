"""Assemble a Hugging Face model directory from a job's stage checkpoints, with no torch.

Every stage checkpoint holds its weights as a safetensors file under Hugging Face tensor names
and layout (`step-NNNNNNNN.safetensors`, `agent.worker.checkpoint`), so an export is those
files, renamed, plus what describes them:

- `config.json` (`dtfm.core.hfconfig.hf_config_from_spec`: `tie_word_embeddings` false, dtfm
  trains the head as its own parameter) and `generation_config.json`;
- one stage: `model.safetensors`; S stages: `model-0000k-of-0000S.safetensors` and
  `model.safetensors.index.json`, whose weight map and total size come from the files'
  headers (8-byte length, JSON);
- the tokenizer files, when the job had a tokenizer (`tokenizer.json` and its companions).

Before anything is written the headers are checked: every tensor the model has appears in
exactly one stage file, and nothing else does. The directory is built under a temporary name
beside its destination and renamed into place, so an interrupted export (a full disk, a kill)
leaves nothing that looks complete; an existing non-empty destination is refused unless
`force`. The coordinator (`coordinator export`) and `agent local --export-dir` both call
`write_export`.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dtfm.core import checkpoints as ondisk
from dtfm.core.hfdir import read_header
from dtfm.core.spec import ModelSpec

INDEX = "model.safetensors.index.json"
# What a Hugging Face tokenizer directory may hold; whichever of these exist are copied.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


class ExportError(Exception):
    """An export that could not be written; the message says why and what to do."""


@dataclass(frozen=True)
class StageFile:
    """One stage's weights: a safetensors file under HF names (its checkpoint's)."""

    stage: int
    path: Path


def shard_name(k: int, total: int) -> str:
    return f"model-{k:05d}-of-{total:05d}.safetensors"


def tensor_bytes(header: dict) -> int:
    """Bytes of tensor data a safetensors header describes."""
    return sum(int(v["data_offsets"][1]) - int(v["data_offsets"][0])
               for k, v in header.items() if k != "__metadata__")


def expected_names(spec: ModelSpec) -> set[str]:
    """Every HF tensor name the whole model has (`dtfm.core.hfconfig.part_tensors`)."""
    from dtfm.core.hfconfig import EMBEDDING_INDEX, HEAD_INDEX, part_tensors

    names: set[str] = set()
    for index in (EMBEDDING_INDEX, *range(spec.n_layers), HEAD_INDEX):
        names.update(t.name for t in part_tensors(spec, index).values())
    return names


def weight_map(spec: ModelSpec, files: Sequence[StageFile]) -> tuple[dict[str, str], int]:
    """The index's weight map (tensor -> shard name) and total size, from the files' headers.
    ExportError naming the stage and tensor when a tensor is missing, doubled or unknown."""
    where: dict[str, str] = {}
    total = 0
    for k, f in enumerate(files, start=1):
        try:
            header = read_header(f.path)
        except (OSError, ValueError) as exc:
            raise ExportError(f"stage {f.stage}'s weights {f.path}: {exc}") from None
        name = shard_name(k, len(files)) if len(files) > 1 else "model.safetensors"
        for tensor in header:
            if tensor == "__metadata__":
                continue
            if tensor in where:
                raise ExportError(f"tensor {tensor} is in stage {f.stage}'s weights and in "
                                  f"{where[tensor]}: the stage files are of different splits")
            where[tensor] = name
        total += tensor_bytes(header)
    want = expected_names(spec)
    missing, extra = sorted(want - set(where)), sorted(set(where) - want)
    if missing:
        raise ExportError(f"no stage file holds tensor {missing[0]} ({len(missing)} missing): "
                          f"the stages' files do not make up the whole of {spec.name}")
    if extra:
        raise ExportError(f"tensor {extra[0]} in {where[extra[0]]} is not a tensor of "
                          f"{spec.name}")
    return where, total


def check_destination(out: str | Path, force: bool) -> None:
    """Refuse an existing non-empty `out` unless `force` (before any work is done)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"--out {out} exists and is not empty: give an empty or new "
                          f"directory, or --force to replace it")


def tokenizer_sources(tokenizer: str | Path) -> list[Path]:
    """The tokenizer files to copy: `tokenizer` is a tokenizer.json or a directory holding
    one (as `agent prepare --out` and a Hugging Face model directory do)."""
    p = Path(tokenizer)
    if p.is_file():
        return [p]
    if p.is_dir():
        found = [p / n for n in TOKENIZER_FILES if (p / n).is_file()]
        if found:
            return found
    raise ExportError(f"--tokenizer {p}: neither a tokenizer.json nor a directory holding "
                      f"one of {', '.join(TOKENIZER_FILES)}")


def write_export(out: str | Path, spec: ModelSpec, files: Sequence[StageFile], *,
                 tokenizer: str | Path | None = None, force: bool = False,
                 source_config: dict | None = None,
                 progress: Callable[[str], None] | None = None) -> Path:
    """Write the Hugging Face directory `out` from the stages' weights (in stage order).

    Atomic: built in a temporary sibling, then renamed; on any failure (ENOSPC included) the
    temporary directory is removed and `out` is as it was. Returns `out`."""
    from dtfm.core.hfconfig import generation_config_from_spec, hf_config_from_spec

    out = Path(out).absolute()
    say = progress or (lambda line: None)
    check_destination(out, force)
    files = sorted(files, key=lambda f: f.stage)
    if [f.stage for f in files] != list(range(len(files))) or not files:
        raise ExportError(f"stage files {[f.stage for f in files]} are not stages 0..S-1")
    where, total = weight_map(spec, files)
    toks = tokenizer_sources(tokenizer) if tokenizer else []
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        _write_json(tmp / "config.json", hf_config_from_spec(spec, source=source_config))
        _write_json(tmp / "generation_config.json",
                    generation_config_from_spec(spec, source_config))
        for k, f in enumerate(files, start=1):
            name = shard_name(k, len(files)) if len(files) > 1 else "model.safetensors"
            say(f"export: stage {f.stage} -> {name} ({f.path.stat().st_size / 2**20:.1f} MiB)")
            _copy(f.path, tmp / name)
        if len(files) > 1:
            _write_json(tmp / INDEX, {"metadata": {"total_size": total},
                                      "weight_map": dict(sorted(where.items()))})
        for src in toks:
            _copy(src, tmp / src.name)
        ondisk.fsync_dir(tmp)
        _install(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ExportError(f"the disk holding {out.parent} filled up while exporting "
                              f"({total / 2**30:.2f} GiB of weights): nothing was left under "
                              f"{out}; free space or export elsewhere") from exc
        raise ExportError(f"exporting to {out} failed: {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"export: wrote {out} ({len(where)} tensors, {total / 2**20:.1f} MiB)")
    return out


def _write_json(path: Path, body: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(body, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _copy(src: Path, dst: Path) -> None:
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        shutil.copyfileobj(fi, fo, 8 * 1024 * 1024)
        fo.flush()
        os.fsync(fo.fileno())
    os.chmod(dst, 0o644)


def _install(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`; an existing `out` (empty, or `force`) is moved aside first and
    removed only once the new one is in place."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{secrets.token_hex(4)}"
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        if old is not None:
            os.replace(old, out)
        raise
    ondisk.fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def install(tmp: Path, out: Path) -> None:
    """Put the directory `tmp` in place as `out`, atomically (`_install`): for another
    exporter (`dtfm.core.loraexport`) writing its own directory the same way."""
    _install(tmp, out)


def local_stage_files(root: str | Path, job_id: str, stages: int) -> tuple[int, list[StageFile]]:
    """The newest step every stage holds complete under checkpoint directory `root` (one
    machine's, or shared storage), and each stage's weights of it. ExportError when none."""
    jroot = ondisk.job_dir(root, job_id)
    held = [{m.step: m for m in ondisk.complete_steps(jroot, s, job_id)} for s in range(stages)]
    common = set(held[0]).intersection(*held[1:])
    with_weights = [step for step in common if all(
        any(f.name == ondisk.weights_name(step) for f in h[step].files) for h in held)]
    if not with_weights:
        raise ExportError(f"no step of job {job_id} is checkpointed with its weights by all "
                          f"{stages} stages under {jroot}")
    step = max(with_weights)
    return step, [StageFile(s, ondisk.weights_for(jroot, s, step)) for s in range(stages)]


def find_tokenizer(data_path: str, init_from: str) -> Path | None:
    """The tokenizer a job had: the files beside its data (`agent prepare` saves its
    tokenizer.json in the data directory; `--data` may name that or a file in it), else the
    ones of the model it started from; None when neither holds any."""
    data = Path(data_path) if data_path else None
    dirs = [data if data is None or data.is_dir() else data.parent,
            Path(init_from) if init_from else None]
    for d in dirs:
        if d is not None and d.is_dir() and any((d / n).is_file() for n in TOKENIZER_FILES):
            return d
    return None
