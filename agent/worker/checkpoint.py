"""Per-stage checkpoints: model, optimizer, step and data position, written atomically.

A crash must never leave a half-written checkpoint where resume would find it, so every file
is written to a temporary name, fsynced, renamed into place, and the directory fsynced. Files
are named by stage and step; the worker resumes from the newest step that every stage holds
(agreed by an all-reduce), so a crash between two stages' writes is harmless.

A checkpoint directory may sit on shared storage that others can write, and unpickling runs
arbitrary code, so files are loaded with `weights_only=True`: only tensors and plain types
(dict, list, tuple, str, int, float, bool, None) load; the worker saves nothing else. Files are
written 0600 and their directories made 0700, since weights are the user's data.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

KEEP = 2
_NAME = re.compile(r"^step-(\d{8})\.pt$")


def stage_dir(root: str | Path, stage: int) -> Path:
    return Path(root) / f"stage-{stage}"


def path_for(root: str | Path, stage: int, step: int) -> Path:
    return stage_dir(root, stage) / f"step-{step:08d}.pt"


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save to `path` so readers see either the old file or the complete new one."""
    _private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _private_dir(d: Path) -> None:
    """Create `d` (and the checkpoint root above it) 0700: weights are private to the user."""
    for part in (d.parent, d):
        part.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            os.chmod(part, 0o700)
        except PermissionError:  # a shared root owned by someone else: leave it, log why
            log.warning("checkpoint: cannot make %s private (not its owner)", part)


def save_stage(root: str | Path, stage: int, step: int, state: dict[str, Any]) -> Path:
    """Write stage `stage`'s state after `step` completed steps; keep the newest KEEP."""
    path = path_for(root, stage, step)
    atomic_save({"step": step, **state}, path)
    for old in steps_available(root, stage)[:-KEEP]:
        path_for(root, stage, old).unlink(missing_ok=True)
    log.info("checkpoint: stage %d step %d -> %s", stage, step, path)
    return path


def steps_available(root: str | Path, stage: int) -> list[int]:
    """Completed-step numbers this stage has checkpoints for, ascending."""
    d = stage_dir(root, stage)
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _NAME.match(p.name)))


def load_stage(root: str | Path, stage: int, step: int) -> dict[str, Any]:
    """Load a stage's state; refuses (ValueError) anything but tensors and plain types."""
    path = path_for(root, stage, step)
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {path} is missing: every rank of stage {stage} must see the same "
            f"checkpoint directory (shared storage when replicas run on different machines)"
        )
    try:
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"checkpoint {path} holds objects other than tensors and plain types, so it was "
            f"not loaded (loading it could run code someone planted): remove the file or "
            f"point --checkpoint-dir elsewhere. torch said: {str(e).splitlines()[0]}"
        ) from e
    return state
