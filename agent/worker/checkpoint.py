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

Files are written 0600 and their directories made 0700, since weights are the user's data.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from agent.worker import errors
from dtfm.core import checkpoints as ondisk
from dtfm.core.checkpoints import (
    KEEP,
    MANIFEST_FORMAT,
    FileEntry,
    Manifest,
    job_dir,
    job_key,
    manifest_for,
    other_jobs,
    path_for,
    prune,
    stage_dir,
    steps_available,
    verify,
)
from dtfm.core.events import WorkerEnv

__all__ = [
    "KEEP", "MANIFEST_FORMAT", "Digest", "Finder", "Location", "agree", "atomic_save",
    "job_dir", "job_key", "load_stage", "locate", "manifest_for", "other_jobs", "path_for",
    "prune", "save_stage", "stage_dir", "steps_available", "verify",
]

log = logging.getLogger(__name__)

# (step, path, reason): called once per step a scan finds unusable
RejectFn = Callable[[int, Path, str], None]


# ---- where this worker checkpoints ----


@dataclass(frozen=True)
class Location:
    """Where a worker checkpoints, how often, and whether this replica writes.

    `own` is True for the agent's own directory (not shared with other machines): there every
    replica writes its stage, since after a reschedule any of them may be the one that needs
    it. In an operator's directory, which may be shared storage, only replica 0 writes: two
    machines replacing one file could pair one's manifest with the other's file.
    """

    root: Path
    job_id: str
    every: int
    own: bool

    @property
    def dir(self) -> Path:
        return job_dir(self.root, self.job_id)

    def writes(self, replica: int) -> bool:
        return self.own or replica == 0

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
               job_id: str = "", layers: Iterable[int] | None = None) -> Path:
    """Write stage `stage`'s state after `step` completed steps under job folder `root`,
    then its manifest, then prune to the newest KEEP complete steps."""
    path, manifest = path_for(root, stage, step), manifest_for(root, stage, step)
    # A manifest of an earlier write of this step must not vouch for the new file mid-write.
    manifest.unlink(missing_ok=True)
    digest = atomic_save({"step": step, **state}, path)
    body = Manifest(job_id, stage, step, None if layers is None else ondisk.parse_layers(
        list(layers)), (FileEntry(path.name, digest.size, digest.sha256.hexdigest()),))
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
    return state


class Finder:
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

    def newest_intact(self, at_most: int | None = None) -> int:
        """The newest intact step <= `at_most` (no bound: None), or 0 if there is none."""
        for step in reversed(self.steps):
            if (at_most is None or step <= at_most) and self.intact(step):
                return step
        return 0

    def intact(self, step: int) -> bool:
        if step not in self._verdict:
            reason = verify(self.root, self.stage, step, job_id=self.job_id,
                            layers=self.layers)
            self._verdict[step] = reason
            if reason:
                self.on_reject(step, path_for(self.root, self.stage, step), reason)
        return self._verdict[step] is None


def agree(finder: Finder, world_min: Callable[[int], int]) -> int:
    """The newest step that every rank's stage holds intact (0: none), the same on every rank.

    Each rank proposes its newest intact step no newer than the current bound; the bound
    becomes the minimum over all ranks, until it stops moving. A rank whose newest step is
    damaged thus pulls every rank back to an older step that all of them hold intact, not
    merely to the minimum of their newest ones (which the damaged rank might not hold). Every
    rank sees the same minima, so all leave the loop in the same round; the bound only falls,
    so there are at most as many rounds as steps on disk.
    """
    bound: int | None = None
    while True:
        agreed = world_min(finder.newest_intact(bound))
        if agreed == 0 or agreed == bound:
            return agreed
        bound = agreed
