"""A spare handed its assignment runs at its launcher's priority at once, even while it cannot
run itself (dtfm/core/spareprio.py: on a loaded machine its own restore came 65 s late).

A real spare (`python -m agent.worker --spare` through `dtfm.launcher.Spare`) is lowered to
the idle scheduling class by its launcher as it starts; the test then stops it (SIGSTOP: as
starved as a spare can be, its own hand-over thread cannot run) and hands it an assignment.
Its threads must be back in the normal class and at the launcher's niceness before it runs
again.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from dtfm.core import spareprio
from dtfm.launcher import Spare, WorkerFiles, worker_env
from dtfm.procs import wait_for
from tests.dtfm.test_launcher import REPO, _assignment

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                                 reason="needs Linux and root, where a spare is lowered"),
              pytest.mark.timeout(120)]


def _policies(pid: int) -> set[tuple[int, int]]:
    """(scheduling class, niceness) of every thread of `pid`."""
    found = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            found.add((os.sched_getscheduler(int(tid)), os.getpriority(os.PRIO_PROCESS,
                                                                       int(tid))))
        except OSError:  # a thread that just ended
            continue
    return found


def test_a_spare_handed_its_assignment_is_raised_by_its_launcher(tmp_path: Path) -> None:
    base = {**os.environ, "DTFM_LOG_LEVEL": "WARNING"}
    spare = Spare.start(tmp_path, worker_env(threads=1, timeout_s=30.0, base=base), cwd=REPO)
    try:
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        wait_for(lambda: any(c == os.SCHED_IDLE for c, _ in _policies(spare.pid)), 60,
                 "the spare to be in the idle class", 0.05)
        os.kill(spare.pid, signal.SIGSTOP)
        worker = spare.take(_assignment(steps=1), WorkerFiles.in_dir(tmp_path, "r0"))
        assert worker is not None
        assert _policies(spare.pid) == {(os.SCHED_OTHER, mine)}, _policies(spare.pid)
    finally:
        os.kill(spare.pid, signal.SIGCONT)
        spare.stop(grace_s=5.0)


def test_a_spare_raised_before_its_first_import_is_never_lowered_after(tmp_path: Path) -> None:
    """The race CI lost: an agent's spare starts as it joins, and its assignment (which
    raises it) can come before the spare's first imports are done. When the spare lowered
    itself after those imports, it undid the raise and imported for minutes in the idle
    class behind every busy process; six of a job's nine took 200 s to get warm. Lowered by
    its launcher before `start` returns, a spare raised at once stays raised until warm."""
    base = {**os.environ, "DTFM_LOG_LEVEL": "WARNING"}
    spare = Spare.start(tmp_path, worker_env(threads=1, timeout_s=30.0, base=base), cwd=REPO)
    try:
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.sched_getscheduler(spare.pid) == os.SCHED_IDLE  # lowered by start itself
        spareprio.raise_to_mine(spare.pid)  # what an assignment does to a spare not yet warm
        seen: set[tuple[int, int]] = set()

        def warm() -> bool:
            seen.update(_policies(spare.pid))
            return spare.ready

        wait_for(warm, 90, "the spare to get warm", 0.02)
        assert seen == {(os.SCHED_OTHER, mine)}, seen
    finally:
        spare.stop(grace_s=5.0)
