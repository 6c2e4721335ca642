"""Per-stage checkpoints: model, optimizer, step and data position, written atomically.

A crash must never leave a half-written checkpoint where resume would find it, so every file
is written to a temporary name, fsynced, renamed into place, and the directory fsynced. Files
are named by stage and step; the worker resumes from the newest step that every stage holds
(agreed by an all-reduce), so a crash between two stages' writes is harmless.
"""

from __future__ import annotations

import logging
import os
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
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
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
    path = path_for(root, stage, step)
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {path} is missing: every rank of stage {stage} must see the same "
            f"checkpoint directory (shared storage when replicas run on different machines)"
        )
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    return state
