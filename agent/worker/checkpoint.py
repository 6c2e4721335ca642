"""A worker's stage checkpoints: where it writes them, saving with torch, loading, resuming.

The layout on disk, the manifest, verification and pruning live in `dtfm.core.checkpoints`
(re-exported here), because the agent daemon, which must not import torch, serves them to
peers and fetches the ones it lacks. This module adds what needs torch or the worker:

- **Where** (`locate`): the operator's `--checkpoint-dir`, or else the agent's own
  `STATE_DIR/checkpoints`, passed as `DTFM_AGENT_CHECKPOINT_DIR`.
- **Saving** (`save_stage`): `torch.save` through a writer that hashes what it writes (no
  second read), atomically, then the manifest, last, then pruning. A refused write raises
  `errors.StorageError` naming the file and what to do: torch reports it as "enforce fail ...
  unexpected pos" with the `OSError` (ENOSPC, EDQUOT, EROFS) only in the chain.
- **Loading** (`load_stage`): only a step that passes `verify`, and with `weights_only=True`:
  a checkpoint directory may sit on shared storage others can write, and unpickling runs
  arbitrary code, so only tensors and plain types load; the worker saves nothing else. (The
  checksum guards against damage, not against an attacker, who can write a manifest too.)
- **Resuming** (`Finder`, `agree`): every rank loads the newest step every rank holds intact.
- **Resuming on another split** (`SpanFinder`, `load_span`): after the job changed its stage
  count, a stage's layers come from several old stages' checkpoints (`dtfm.core.checkpoints.
  sources`), all of one step that each of them holds intact. Weights join by parameter name
  (names carry global layer indices); AdamW's state, which torch keys by position, joins by
  the parameter names each checkpoint lists in its optimizer's order (`param_names`); the
  data position must be the same in every piece, as every stage runs the same sampler.

Files are written 0600 and their directories made 0700, since weights are the user's data.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from agent.worker import errors
from dtfm.core import checkpoints as ondisk
from dtfm.core.checkpoints import (
    KEEP,
    MANIFEST_FORMAT,
    FileEntry,
    Manifest,
    Source,
    job_dir,
    job_key,
    manifest_for,
    other_jobs,
    path_for,
    prune,
    sources,
    stage_dir,
    steps_available,
    verify,
)
from dtfm.core.events import WorkerEnv

__all__ = [
    "KEEP", "MANIFEST_FORMAT", "Digest", "Finder", "Location", "Source", "SpanFinder", "agree",
    "atomic_save", "atomic_save_safetensors", "job_dir", "job_key", "load_span", "load_stage",
    "locate", "manifest_for", "merge_states", "model_state", "optimizer_names", "other_jobs",
    "path_for", "prune", "save_stage", "sources", "stage_buffers", "stage_dir",
    "stage_weights_hf", "steps_available", "verify",
]

log = logging.getLogger(__name__)

# (step, path, reason): called once per step a scan finds unusable
RejectFn = Callable[[int, Path, str], None]


# ---- where this worker checkpoints ----


@dataclass(frozen=True)
class Location:
    """Where a worker checkpoints, how often, and whether this replica writes.

    `own` is True for the agent's own directory (not shared with other machines): there every
    replica writes its stage; in an operator's directory, which may be shared storage, only
    replica 0 does (`dtfm.core.checkpoints.writes` says why).
    """

    root: Path
    job_id: str
    every: int
    own: bool

    @property
    def dir(self) -> Path:
        return job_dir(self.root, self.job_id)

    def writes(self, replica: int) -> bool:
        return ondisk.writes(not self.own, replica)

    def due(self, step: int, last: int) -> bool:
        return step == last or step % self.every == 0


def locate(configured: str, job_id: str, every: int,
           env: Mapping[str, str] | None = None) -> Location | None:
    """The worker's checkpoint location, or None when checkpoints are off.

    `configured` (the assignment's `checkpoint_dir`) wins; without it the agent's own
    directory from `DTFM_AGENT_CHECKPOINT_DIR`; `every` == 0 turns checkpoints off (the operator
    said so: the default is 50).
    """
    if every == 0:
        return None
    if configured:
        return Location(Path(configured), job_id, every, own=False)
    own = (os.environ if env is None else env).get(WorkerEnv.AGENT_CHECKPOINT_DIR, "")
    if own:
        return Location(Path(own), job_id, every, own=True)
    return None


# ---- writing ----


@dataclass
class Digest:
    """Size and sha256 of what went through a `_HashingWriter`."""

    size: int = 0
    sha256: Any = field(default_factory=hashlib.sha256)


class _HashingWriter:
    """A write-only file that hashes what it writes, so saving costs no second read."""

    def __init__(self, f: IO[bytes], digest: Digest) -> None:
        self._f, self._digest = f, digest

    def write(self, data: Any) -> int:
        view = memoryview(data)
        n = self._f.write(view)
        self._digest.sha256.update(view)
        self._digest.size += view.nbytes
        return n if n is not None else view.nbytes

    def flush(self) -> None:
        self._f.flush()


def atomic_save(obj: Any, path: Path) -> Digest:
    """torch.save to `path` so readers see either the old file or the complete new one;
    returns its size and sha256. A refused write raises `errors.StorageError`."""
    digest = Digest()
    _atomic_write(path, lambda f: torch.save(obj, _HashingWriter(f, digest)))
    return digest


def atomic_save_safetensors(tensors: Mapping[str, torch.Tensor], path: Path) -> Digest:
    """Write `tensors` as a safetensors file (metadata format pt, which `transformers`
    requires), atomically; returns its size and sha256. The file is serialized in memory
    first (the stage's weights once more, briefly), so hashing needs no second read."""
    from safetensors.torch import save

    data = save(dict(tensors), metadata={"format": "pt"})
    digest = Digest()
    _atomic_write(path, lambda f: _HashingWriter(f, digest).write(data))
    return digest


def _atomic_write(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """`ondisk.atomic_write`, with a refused write raised as `errors.StorageError`."""
    try:
        ondisk.atomic_write(path, write)
    except Exception as e:
        cause = errors.os_error_in(e)
        if cause is None:
            raise
        raise errors.StorageError(path, cause) from e


def save_stage(root: str | Path, stage: int, step: int, state: dict[str, Any], *,
               job_id: str = "", layers: Iterable[int] | None = None,
               weights: Mapping[str, torch.Tensor] | None = None) -> Path:
    """Write stage `stage`'s state after `step` completed steps under job folder `root`,
    then its manifest, then prune to the newest KEEP complete steps.

    `weights` (the stage's parameters under Hugging Face names, `stage_tensors_hf`) go to
    their own safetensors file beside the `.pt`, which then holds no weights (`state` without
    `model`, its buffers under `buffers`); the manifest lists both files."""
    path, manifest = path_for(root, stage, step), manifest_for(root, stage, step)
    # A manifest of an earlier write of this step must not vouch for the new file mid-write.
    manifest.unlink(missing_ok=True)
    entries = []
    if weights is not None:
        wpath = ondisk.weights_for(root, stage, step)
        wdigest = atomic_save_safetensors(weights, wpath)
        entries.append(FileEntry(wpath.name, wdigest.size, wdigest.sha256.hexdigest()))
    digest = atomic_save({"step": step, **state}, path)
    entries.insert(0, FileEntry(path.name, digest.size, digest.sha256.hexdigest()))
    body = Manifest(job_id, stage, step, None if layers is None else ondisk.parse_layers(
        list(layers)), tuple(entries))
    data = body.to_bytes()
    _atomic_write(manifest, lambda f: f.write(data))
    prune(root, stage, step)
    log.info("checkpoint: stage %d step %d -> %s (%d bytes)", stage, step, path, digest.size)
    return path


# ---- reading ----


def load_stage(root: str | Path, stage: int, step: int, *,
               job_id: str | None = None) -> dict[str, Any]:
    """Load a verified stage checkpoint. Raises FileNotFoundError when it is absent,
    `errors.CorruptCheckpoint` when it fails `verify`, ValueError for anything but tensors
    and plain types; every message names the file."""
    path = path_for(root, stage, step)
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {path} is missing: every rank of stage {stage} must hold it (on "
            f"shared storage named by --checkpoint-dir, or in its agent's own directory, "
            f"where the agent fetches it from a peer before the worker starts)"
        )
    reason = verify(root, stage, step, job_id=job_id)
    if reason:
        raise errors.CorruptCheckpoint(f"checkpoint {path} was not loaded: {reason}")
    try:
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"checkpoint {path} holds objects other than tensors and plain types, so it was "
            f"not loaded (loading it could run code someone planted): remove the file or "
            f"point --checkpoint-dir elsewhere. torch said: {str(e).splitlines()[0]}"
        ) from e
    except Exception as e:  # it passed its checksum: changed since, or a torch bug
        raise errors.CorruptCheckpoint(
            f"checkpoint {path} could not be loaded: {str(e).splitlines()[0]}") from e
    wpath = ondisk.weights_for(root, stage, step)
    if any(f.name == wpath.name for f in ondisk.read_manifest(root, stage, step).files):
        try:
            from safetensors.torch import load_file

            state["weights_hf"] = load_file(wpath, device="cpu")
        except Exception as e:  # it passed its checksum (verify read it): changed since
            raise errors.CorruptCheckpoint(
                f"checkpoint weights {wpath} could not be loaded: "
                f"{str(e).splitlines()[0]}") from e
    return state


# ---- weights under Hugging Face names ----


def _prefix(index: int) -> str:
    from dtfm.core.hfconfig import EMBEDDING_INDEX, HEAD_INDEX

    return {EMBEDDING_INDEX: "embed.", HEAD_INDEX: "head."}.get(index, f"layers.{index}.")


def stage_weights_hf(stage: Any, spec: Any) -> dict[str, torch.Tensor]:
    """The stage's parameters under Hugging Face names and layout, for its safetensors file."""
    from agent.worker.hfload import stage_tensors_hf

    return stage_tensors_hf(stage.parts(), spec)


def stage_buffers(stage: nn.Module) -> dict[str, torch.Tensor]:
    """The entries of the stage's state dict that are not parameters (the `.pt` keeps them)."""
    params = {name for name, _ in stage.named_parameters()}
    return {k: v for k, v in stage.state_dict().items() if k not in params}


def model_state(state: Mapping[str, Any], spec: Any) -> dict[str, torch.Tensor]:
    """A loaded checkpoint's weights under the stage's parameter names: its `model` entry
    (checkpoints from before the safetensors file), else its Hugging Face tensors mapped back
    through `hfconfig.part_tensors` for the layers it holds, plus its buffers. ValueError
    naming the tensor when one is missing."""
    if "model" in state:
        return dict(state["model"])
    from dtfm.core.hfconfig import EMBEDDING_INDEX, HEAD_INDEX, part_tensors

    begin, end = (int(x) for x in state["layers"])
    indices = list(range(begin, end))
    if begin == 0:
        indices.insert(0, EMBEDDING_INDEX)
    if end == spec.n_layers:
        indices.append(HEAD_INDEX)
    tensors = state["weights_hf"]
    out: dict[str, torch.Tensor] = dict(state.get("buffers", {}))
    for index in indices:
        for name, t in part_tensors(spec, index).items():
            if t.name not in tensors:
                raise ValueError(f"checkpoint weights of layers [{begin}, {end}) lack tensor "
                                 f"{t.name}")
            value = tensors[t.name]
            out[_prefix(index) + name] = value.t().contiguous() if t.transpose else value
    return out


class _Steps:
    """What `Finder` and `SpanFinder` share: the newest of their `steps` that is `intact`."""

    steps: list[int]

    def intact(self, step: int) -> bool:
        raise NotImplementedError

    def newest_intact(self, at_most: int | None = None) -> int:
        """The newest intact step <= `at_most` (no bound: None), or 0 if there is none."""
        for step in reversed(self.steps):
            if (at_most is None or step <= at_most) and self.intact(step):
                return step
        return 0


class Finder(_Steps):
    """This stage's checkpoints of one job, newest first, each verified at most once.

    Verifying reads the whole file, so it is lazy: usually only the newest step is read.
    Every step found unusable is reported once through `on_reject` (file and reason).
    """

    def __init__(self, root: str | Path, stage: int, *, job_id: str,
                 layers: Iterable[int] | None = None, on_reject: RejectFn | None = None) -> None:
        self.root, self.stage, self.job_id = Path(root), stage, job_id
        self.layers = None if layers is None else list(layers)
        self.on_reject = on_reject or (lambda step, path, reason: None)
        self.steps = steps_available(root, stage)
        self._verdict: dict[int, str | None] = {}

    def intact(self, step: int) -> bool:
        if step not in self._verdict:
            reason = verify(self.root, self.stage, step, job_id=self.job_id,
                            layers=self.layers)
            self._verdict[step] = reason
            if reason:
                self.on_reject(step, path_for(self.root, self.stage, step), reason)
        return self._verdict[step] is None


class SpanFinder(_Steps):
    """The steps that every stage folder a worker resumes from holds intact, with the layer
    range it must hold (one `Finder` per source; the same questions as a `Finder`)."""

    def __init__(self, root: str | Path, srcs: Sequence[Source], *, job_id: str,
                 on_reject: RejectFn | None = None) -> None:
        if not srcs:
            raise ValueError("a stage resumes from at least one stage folder")
        self.finders = [Finder(root, src.stage, job_id=job_id, layers=src.layers,
                               on_reject=on_reject) for src in srcs]
        common = set(self.finders[0].steps).intersection(*(f.steps for f in self.finders[1:]))
        self.steps = sorted(common)

    def intact(self, step: int) -> bool:
        return all(f.intact(step) for f in self.finders)


def agree(finder: Finder | SpanFinder, world_min: Callable[[int], int],
          below: int = 0) -> int:
    """The newest step that every rank's stage holds intact (0: none), the same on every rank,
    and below `below` where that is > 0 (an integrity rollback: steps from the first one
    proven bad on are never resumed from, `Assignment.resume_before`).

    Each rank proposes its newest intact step no newer than the current bound; the bound
    becomes the minimum over all ranks, until it stops moving. A rank whose newest step is
    damaged thus pulls every rank back to an older step that all of them hold intact, not
    merely to the minimum of their newest ones (which the damaged rank might not hold). Every
    rank sees the same minima, so all leave the loop in the same round; the bound only falls,
    so there are at most as many rounds as steps on disk.
    """
    bound: int | None = below - 1 if below > 0 else None
    if bound == 0:
        return 0
    while True:
        agreed = world_min(finder.newest_intact(bound))
        if agreed == 0 or agreed == bound:
            return agreed
        bound = agreed


# ---- resuming on another layer split ----


def optimizer_names(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """The parameter names of `model` in `opt`'s order: the order torch numbers them in its
    state dict, which is what `merge_states` needs to move AdamW's state by name."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    return [by_id[id(p)] for group in opt.param_groups for p in group["params"]]


def load_span(root: str | Path, srcs: Sequence[Source], step: int, *,
              job_id: str | None = None) -> list[dict[str, Any]]:
    """Load step `step` of every source stage (`load_stage`: verified, tensors only) and check
    that each holds the layer range it must."""
    states = []
    for src in srcs:
        state = load_stage(root, src.stage, step, job_id=job_id)
        if tuple(state.get("layers", ())) != src.layers:
            raise ValueError(
                f"checkpoint {path_for(root, src.stage, step)} holds layers "
                f"{state.get('layers')}, not {list(src.layers)} as the job's record of its "
                f"split says")
        states.append(state)
    return states


def merge_states(states: Sequence[Mapping[str, Any]], srcs: Sequence[Source], model: nn.Module,
                 opt: torch.optim.Optimizer,
                 names_of: Callable[[Source], list[str]]) -> dict[str, Any]:
    """One state for `model` and `opt` from the checkpoints of the stages that held its layers.

    `names_of(src)` gives a source's parameter names in its optimizer's order when its
    checkpoint does not list them (`param_names`, written since re-splitting exists). A frozen
    parameter (a LoRA job's base) is in no checkpoint and not asked for: the worker reads it
    from `--init-from` or the seed. Raises ValueError naming what is missing or inconsistent;
    nothing is loaded half."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    want = [k for k in model.state_dict() if k not in frozen]
    weights = {k: v for st in states for k, v in st["model"].items() if k in want}
    missing = [k for k in want if k not in weights]
    if missing:
        raise ValueError(f"the checkpoints of stages {[s.stage for s in srcs]} lack "
                         f"{len(missing)} parameter(s) of this stage, such as {missing[0]}")
    positions = {tuple(sorted(st["data_position"].items())) for st in states}
    if len(positions) != 1:
        raise ValueError(f"the checkpoints of stages {[s.stage for s in srcs]} disagree on the "
                         f"data position ({sorted(positions)}): they are not of one step")
    by_name: dict[str, Any] = {}
    for st, src in zip(states, srcs, strict=True):
        names = list(st.get("param_names") or names_of(src))
        for index, per_param in st["optimizer"]["state"].items():
            by_name[names[int(index)]] = per_param
    fresh = opt.state_dict()
    order = optimizer_names(model, opt)
    moved = {i: by_name[name] for i, name in enumerate(order) if name in by_name}
    if moved and len(moved) != len(order):
        lacking = next(name for name in order if name not in by_name)
        raise ValueError(f"the checkpoints of stages {[s.stage for s in srcs]} hold optimizer "
                         f"state for some parameters of this stage but not for {lacking}")
    groups = [{**old, "params": new["params"]} for old, new in
              zip(states[0]["optimizer"]["param_groups"], fresh["param_groups"], strict=True)]
    return {"model": weights, "optimizer": {"state": moved, "param_groups": groups},
            "data_position": dict(states[0]["data_position"])}
