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

What config.json and generation_config.json carry over besides the spec (the special-token
ids, an imported architecture, sampling settings) and where the tokenizer lies are one
`ExportSource`, built by one function (`export_source`) from the job's `--init-from` and
`--data`: `agent local --export-dir` calls it, and the coordinator calls it and sends the
result in its status, so `coordinator start --export-dir` and `coordinator export` write the
same ids and tokenizer a local run does. Ids come from the imported model's config.json and
generation_config.json, else from the prepared data's end-of-text token (`meta.json`: the
token between documents, so the one a trained model ends a document with); with neither, the
ids are written as null, so that `transformers` does not fall back on GPT-2's 50256.

Before anything is written the headers are checked: every tensor the model has appears in
exactly one stage file, and nothing else does. The directory is built under a temporary name
beside its destination and renamed into place, so an interrupted export (a full disk, a kill)
leaves nothing that looks complete; an existing non-empty destination is refused unless
`force`, and a destination that cannot be written (under /proc, a read-only disk) is refused
before anything is fetched (`make_parent`). The coordinator (`coordinator export`) and `agent
local --export-dir` both call `write_export`.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtfm.core import checkpoints as ondisk
from dtfm.core.hfconfig import (
    EMBEDDING_INDEX,
    GENERATION_CONFIG_FILE,
    HEAD_INDEX,
    TOKEN_ID_KEYS,
    generation_config_from_spec,
    hf_config_from_spec,
    part_tensors,
    read_hf_config,
)
from dtfm.core.hfdir import read_header
from dtfm.core.spec import ModelSpec
from dtfm.core.tokenfiles import TOKENIZER_FILES, meta_for

INDEX = "model.safetensors.index.json"
# What config.json carries over from an imported model's, besides what the spec gives: its
# architecture (a Mistral stays one) and its special-token ids. The ids that must be present:
# absent, transformers takes its class's defaults (GPT-2's 50256, outside a small vocabulary).
REQUIRED_IDS = ("bos_token_id", "eos_token_id")
CARRIED_KEYS = ("architectures", "model_type", *TOKEN_ID_KEYS)
GENERATION_KEYS = (*TOKEN_ID_KEYS, "do_sample", "temperature", "top_k", "top_p")
MAX_SOURCE_JSON = 64 * 1024  # an ExportSource's JSON on the wire, at most


class ExportError(Exception):
    """An export that could not be written; the message says why and what to do."""


@dataclass(frozen=True)
class StageFile:
    """One stage's weights: a safetensors file under HF names (its checkpoint's)."""

    stage: int
    path: Path


@dataclass(frozen=True)
class ExportSource:
    """What an export writes besides the weights and the spec's shape: the keys config.json
    (`config`) and generation_config.json (`generation`) carry over from the job's inputs,
    and the tokenizer (a tokenizer.json or a directory holding one; "" for none). Built by
    `export_source`; the coordinator sends it in its status (`to_proto`)."""

    config: dict[str, Any] = field(default_factory=dict)
    generation: dict[str, Any] = field(default_factory=dict)
    tokenizer: str = ""

    def to_proto(self) -> Any:
        from protos.dtfm.v1 import coordinator_pb2

        return coordinator_pb2.ExportSource(
            config_json=json.dumps(self.config, sort_keys=True) if self.config else "",
            generation_json=json.dumps(self.generation, sort_keys=True)
            if self.generation else "", tokenizer=self.tokenizer)

    @classmethod
    def from_proto(cls, msg: Any, where: str = "the coordinator") -> ExportSource:
        """The source a status carries; ExportError when it is malformed."""
        def parse(text: str, name: str, keys: tuple[str, ...]) -> dict[str, Any]:
            if not text:
                return {}
            try:
                body = json.loads(text) if len(text) <= MAX_SOURCE_JSON else None
            except ValueError:
                body = None
            if not isinstance(body, dict):
                raise ExportError(f"{where} sent a malformed export {name} (not a JSON object "
                                  f"of at most {MAX_SOURCE_JSON} bytes): upgrade it")
            return {k: v for k, v in body.items() if k in keys}

        return cls(parse(msg.config_json, "config", CARRIED_KEYS),
                   parse(msg.generation_json, "generation config", GENERATION_KEYS),
                   msg.tokenizer)


def export_source(data_path: str, init_from: str, tokenizer: str | Path = "") -> ExportSource:
    """What the job that trained on `--data data_path` from `--init-from init_from` exports
    beside its weights (`ExportSource`), as far as this machine holds those paths:

    - the ids and architecture of init_from's config.json, and what its
      generation_config.json says (generation falls back on the config's ids);
    - else, prepared data (`meta.json`): its end-of-text token as bos and eos (the token
      between documents: a trained model ends a document with it);
    - the tokenizer: `tokenizer` when given, else `find_tokenizer`'s.

    ValueError (naming the file) for an unreadable config.json or meta.json."""
    config: dict[str, Any] = {}
    generation: dict[str, Any] = {}
    if init_from:
        model = read_hf_config(init_from)
        config = {k: model[k] for k in CARRIED_KEYS if model.get(k) is not None}
        saved = _json_object(Path(init_from) / GENERATION_CONFIG_FILE)
        generation = {k: v for k, v in saved.items() if k in GENERATION_KEYS and v is not None}
    if data_path and not any(k in config for k in REQUIRED_IDS):
        meta, _ = meta_for(data_path)
        if meta is not None:
            config.update(bos_token_id=meta.eot_id, eos_token_id=meta.eot_id)
    found = tokenizer or find_tokenizer(data_path, init_from)
    return ExportSource(config, generation, str(found) if found else "")


def _json_object(path: Path) -> dict[str, Any]:
    """A JSON object file's content; {} when it is absent or holds no object."""
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def shard_name(k: int, total: int) -> str:
    return f"model-{k:05d}-of-{total:05d}.safetensors"


def tensor_bytes(header: dict) -> int:
    """Bytes of tensor data a safetensors header describes."""
    return sum(int(v["data_offsets"][1]) - int(v["data_offsets"][0])
               for k, v in header.items() if k != "__metadata__")


def expected_names(spec: ModelSpec) -> set[str]:
    """Every HF tensor name the whole model has (`dtfm.core.hfconfig.part_tensors`)."""
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


def check_destination(out: str | Path, force: bool, flag: str = "--out") -> None:
    """Refuse an existing non-empty `out` unless `force` (before any work is done); `flag`:
    the flag the user gave it with (`--export-dir`, `--out`)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{flag} {out} exists and is not a directory: give a new or empty "
                          f"directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{flag} {out} exists and is not empty: give an empty or new "
                          f"directory, or --force to replace it")


def check_not_base(out: str | Path, base: str | Path, flag: str = "--out",
                   base_flag: str = "--init-from") -> None:
    """Refuse (ExportError) an export destination that is the model the job started from,
    holds it, or lies inside it (symlinks resolved): the export replaces `out` whole, so the
    base, which a LoRA adapter needs beside it, would be lost. Nothing to check without a
    base."""
    if not base:
        return
    o, b = Path(out).resolve(), Path(base).resolve()
    if o == b:
        where = "is"
    elif o in b.parents:
        where = "holds"
    elif b in o.parents:
        where = "is inside"
    else:
        return
    raise ExportError(f"{flag} {out} {where} the base model {base_flag} {base}: the export "
                      f"replaces {out} whole, which would destroy the model the job starts "
                      f"from (and that an adapter export needs as its base); give a "
                      f"directory outside {b}")


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


def make_parent(out: str | Path, flag: str = "--out") -> Path:
    """Create the directory that will hold `out` (its missing parents) and prove it takes a
    new folder, before any work is done; ExportError naming `out` and what to do when not
    (under /proc or /sys, a read-only disk, a file in the way). Returns it."""
    parent = Path(out).absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        probe = parent / f".{Path(out).name}.probe-{os.getpid()}-{secrets.token_hex(4)}"
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        raise ExportError(f"{flag} {out}: cannot write a directory in {parent} "
                          f"({exc.strerror or exc}): give a directory on a disk you can "
                          f"write") from None
    return parent


def write_export(out: str | Path, spec: ModelSpec, files: Sequence[StageFile], *,
                 source: ExportSource | None = None, force: bool = False,
                 progress: Callable[[str], None] | None = None) -> Path:
    """Write the Hugging Face directory `out` from the stages' weights (in stage order), with
    what `source` carries over (`export_source`: token ids, tokenizer).

    Atomic: built in a temporary sibling, then renamed; on any failure (ENOSPC included) the
    temporary directory is removed and `out` is as it was. Returns `out`."""
    out = Path(out).absolute()
    source = source or ExportSource()
    say = progress or (lambda line: None)
    check_destination(out, force)
    files = sorted(files, key=lambda f: f.stage)
    if [f.stage for f in files] != list(range(len(files))) or not files:
        raise ExportError(f"stage files {[f.stage for f in files]} are not stages 0..S-1")
    where, total = weight_map(spec, files)
    toks = tokenizer_sources(source.tokenizer) if source.tokenizer else []
    config = hf_config_from_spec(spec, source=source.config)
    for key in REQUIRED_IDS:  # unknown is null: no class default (GPT-2's 50256) applies
        config.setdefault(key, None)
    generation = generation_config_from_spec(spec, {**source.config, **source.generation})
    make_parent(out)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        tmp.mkdir()
        _write_json(tmp / "config.json", config)
        _write_json(tmp / GENERATION_CONFIG_FILE, generation)
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
