"""Every step event says what the replica checks took of it (`verify_s`), so their cost is
read inside one run (bench/integrity_world.py; issue 43's "at most 5 %") instead of as two
runs' tokens/s, which move by 15 % on a shared machine. Real gloo workers, 1 x 2, sharded."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import stepsplit
from tests.agent.worker.testlib import run_local

FLAGS = ("--model", "gpt-tiny", "--stages", "1", "--replicas", "2", "--micro-batches", "1",
         "--batch", "4", "--steps", "10", "--eval-batches", "0", "--checkpoint-every", "0",
         "--dp-mode", "sharded", "--timeout", "30")


@pytest.mark.timeout(120)
def test_each_step_reports_the_checks_time_within_the_step(tmp_path: Path) -> None:
    work = tmp_path / "work"
    run = run_local(*FLAGS, "--verify", "full", "--workdir", str(work), timeout=110)
    assert run.rc == 0, run.stderr
    events = [json.loads(line) for p in sorted(work.glob("*.progress.jsonl"))
              for line in p.read_text().splitlines() if line.startswith("{")]
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 20  # 10 steps, 2 ranks
    for e in steps:  # the checks ran every step (scoring, the averages' checks): inside it
        assert math.isfinite(e["verify_s"]) and 0 < e["verify_s"] < e["step_s"], e
    share = stepsplit.checks_share(events)
    assert share is not None and 0 < share["share"] <= share["worst_rank_share"] < 1
