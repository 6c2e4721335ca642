"""Training with int4h pipeline links stays within int8's margin of the exact run.

Real processes over gloo (`agent local`, 2 stages, gpt-tiny, 12 steps, seed 1): the same job
uncompressed and with `--pp-compress int4h` (rotated int4 forward, stochastic rounding of
the gradients back), launched side by side to keep the test short. The margin is int8's in
`test_compress_training.py`, 0.5 % of the uncompressed loss at every step and in
validation, the issue's bar for 4-bit activations with rotation; measured here within
0.05 %. The pipeline's byte counters must show int4's wire size: the rotation costs nothing
on the wire. That the seeded stochastic rounding repeats is pinned in `test_rotate.py`.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dtfm.core.codecs import Codec
from tests.agent.worker.testlib import LocalRun, run_local

COMMON = ("--model", "gpt-tiny", "--batch", "8", "--steps", "12", "--seed", "1",
          "--eval-batches", "2", "--timeout", "60", "--stages", "2", "--replicas", "1",
          "--micro-batches", "2")
MARGIN = 0.005


def _run(workdir: Path, codec: str) -> tuple[LocalRun, int]:
    run = run_local(*COMMON, "--pp-compress", codec, "--workdir", str(workdir), timeout=90)
    assert run.rc == 0, run.stderr
    events = [json.loads(line) for p in sorted(workdir.glob("rank*.progress.jsonl"))
              for line in p.read_text().splitlines() if line.strip()]
    return run, sum(e["pp_bytes"] for e in events if e["event"] == "step")


@pytest.mark.timeout(200)
def test_int4h_training_stays_within_int8s_margin(tmp_path: Path) -> None:
    with ThreadPoolExecutor(2) as pool:
        jobs = {c: pool.submit(_run, tmp_path / c, c) for c in ("none", "int4h")}
        (base, base_bytes), (run, run_bytes) = (jobs[c].result() for c in ("none", "int4h"))
    assert base.losses[-1] < base.losses[0] - 0.5  # it learns, so the comparison means something
    assert len(run.losses) == len(base.losses) == 12
    for i, (x, y) in enumerate(zip(run.losses, base.losses, strict=True)):
        assert abs(x - y) <= MARGIN * y, f"int4h step {i + 1}: {x} vs {y}"
    assert run.losses != base.losses  # the codec really was on
    assert run.done is not None and base.done is not None
    val, ref = run.done["val_loss"], base.done["val_loss"]
    assert abs(val - ref) <= MARGIN * ref, f"int4h validation loss {val} vs {ref}"
    assert run_bytes / base_bytes == pytest.approx(Codec("int4").ratio_to(4), rel=0.02)
