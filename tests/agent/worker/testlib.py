"""Helpers for the worker tests: run `python -m agent.local` for real and always reap it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]


@dataclass
class LocalRun:
    rc: int
    steps: list[dict[str, Any]] = field(default_factory=list)
    done: dict[str, Any] | None = None
    stderr: str = ""
    stdout: str = ""

    @property
    def losses(self) -> list[float]:
        return [float(s["loss"]) for s in self.steps]


def run_local(
    *flags: str, timeout: float = 120.0, env: dict[str, str] | None = None
) -> LocalRun:
    """Run a local job with `--json`; kills the launcher's whole session on any exit path."""
    cmd = [sys.executable, "-m", "agent.local", "--json", "--threads", "1", *flags]
    full_env = {**os.environ, "DTFM_LOG_LEVEL": "WARNING", **(env or {})}
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=full_env, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    run = LocalRun(proc.returncode, stderr=err, stdout=out)
    for line in out.splitlines():
        obj = json.loads(line)
        if "step" in obj:
            run.steps.append(obj)
        elif obj.get("done"):
            run.done = obj
    return run


def assert_resumed(resumed: LocalRun, full: LocalRun, after: int, rel: float = 1e-6) -> None:
    """A run resumed after step `after` trained the rest of `full`'s steps to its losses and
    validation loss."""
    assert resumed.rc == 0, resumed.stderr
    assert [s["step"] for s in resumed.steps] == list(range(after + 1, len(full.steps) + 1))
    assert_close(resumed.losses, full.losses[after:], rel)
    assert resumed.done is not None and full.done is not None
    assert abs(resumed.done["val_loss"] - full.done["val_loss"]) <= rel * full.done["val_loss"]


def assert_close(a: list[float], b: list[float], rel: float) -> None:
    assert len(a) == len(b) and a, (a, b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert abs(x - y) <= rel * abs(y), f"step {i + 1}: {x} vs {y} (rel {rel})"
