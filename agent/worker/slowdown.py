"""The test and benchmark seam for devices slower than this machine's cores."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

ENV_SLOWDOWN = "DTFM_COMPUTE_SLOWDOWN"  # >= 1: emulate a device this many times slower
# a file holding that factor, read before every step: the WAN emulator's live compute changes
ENV_SLOWDOWN_FILE = "DTFM_COMPUTE_SLOWDOWN_FILE"


def compute_slowdown() -> float:
    """The test and benchmark seam for uneven devices on one machine: forward and backward
    passes take this factor longer (the worker idles for the difference). The factor comes
    from DTFM_COMPUTE_SLOWDOWN_FILE once that file exists (`WanEmulator.live.set_compute` writes
    it while the job runs), else from DTFM_COMPUTE_SLOWDOWN."""
    raw = os.environ.get(ENV_SLOWDOWN, "1")
    if path := os.environ.get(ENV_SLOWDOWN_FILE):
        with contextlib.suppress(FileNotFoundError):
            raw = Path(path).read_text().strip()
    try:
        factor = float(raw)
    except ValueError:
        factor = float("nan")
    if not (1.0 <= factor < 1000.0):
        raise ValueError(f"{ENV_SLOWDOWN}={raw!r}: give a factor >= 1 (2 = half as fast)")
    return factor
