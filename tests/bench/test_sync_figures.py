"""bench/sync.py's figures without the emulator: the flags a network-free twin shares with
its job, and the mean step after the learning rate's warm-up (which `--pipeline-delay 1`
flushes step by step)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def sync() -> ModuleType:
    """bench/sync.py, which imports its siblings as a script does (bench/ is no package)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCH))
        return importlib.import_module("sync")


def test_the_twin_runs_the_jobs_schedule_and_warm_up_and_nothing_else(sync: ModuleType) -> None:
    flags = ["--pp-compress", "int8", "--sync-every", "4", "--schedule", "1f1b",
             "--pipeline-delay", "1", "--warmup-steps", "3", "--outer-delay", "1"]
    assert sync.schedule_flags(flags, 4) == ["--schedule", "1f1b", "--pipeline-delay", "1",
                                             "--warmup-steps", "3", "--outer-delay", "1"]
    # at H = 1 replicas drop both delays (epochplan.with_sync); the warm-up stays
    assert sync.schedule_flags(flags, 1) == ["--schedule", "1f1b", "--warmup-steps", "3"]
    assert sync.warmup_of(flags) == 3
    assert sync.warmup_of(["--schedule", "1f1b"]) == 10  # TrainConfig's default


def test_the_mean_step_after_the_warm_up_leaves_out_the_flushed_steps(
        sync: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "rank0.progress.jsonl"
    times = {1: 9.0, 2: 2.0, 3: 2.0, 4: 1.0, 5: 1.0, 6: 1.0}  # steps 2-3: the warm-up
    path.write_text("".join(json.dumps({"event": "step", "step": k, "step_s": v,
                                        "stage": 0, "replica": 0}) + "\n"
                            for k, v in times.items()))
    got = sync.figures({path}, 100, warmup_steps=3)
    assert got["mean_step_s"] == pytest.approx(7.0 / 5)
    assert got["mean_step_after_warmup_s"] == pytest.approx(1.0)
    assert "mean_step_after_warmup_s" not in sync.figures({path}, 100)
