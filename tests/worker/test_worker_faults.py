"""A worker that dies or hangs takes the whole local job down with a clear error, no hang.

Faults go through the worker's `DTFM_FAULT` seam (rank:step[:mode]), not sleeps.
"""

from __future__ import annotations

import time

import pytest
from dtfm_worker_testlib import run_local

FLAGS = ("--model", "gpt-tiny", "--stages", "2", "--replicas", "2", "--batch", "8",
         "--steps", "50", "--eval-batches", "1")


@pytest.mark.timeout(90)
def test_dead_worker_stops_the_job_with_its_rank_and_code() -> None:
    t0 = time.monotonic()
    run = run_local(*FLAGS, "--timeout", "30", env={"DTFM_FAULT": "3:3"}, timeout=80)
    elapsed = time.monotonic() - t0
    assert run.rc != 0
    assert "rank 3 (stage 1, replica 1) exited with code 17" in run.stderr, run.stderr
    assert "fault injection" in run.stderr  # the dead rank's last stderr lines are shown
    assert [s["step"] for s in run.steps] == [1, 2]
    assert run.done is None
    assert elapsed < 60


@pytest.mark.timeout(90)
def test_hung_worker_times_out_and_stops_the_job() -> None:
    t0 = time.monotonic()
    run = run_local(*FLAGS, "--timeout", "4", env={"DTFM_FAULT": "1:2:hang"}, timeout=80)
    elapsed = time.monotonic() - t0
    assert run.rc != 0
    assert "exited with code" in run.stderr and "stopped the other 3 workers" in run.stderr
    assert run.done is None
    assert elapsed < 60
