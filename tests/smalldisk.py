"""A real disk that fills up: a small tmpfs mounted for the length of a test (root only)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(d: Path, size: str = "256k") -> Iterator[Path]:
    """Mount a tmpfs of `size` on `d` (created) until the block ends; skips the test where
    mounting is not allowed."""
    d.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)]
                      ).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=False)
