"""Raising a handed-over spare worker back to its launcher's CPU priority, from the launcher.

A waiting spare lowers its own priority (agent.worker's `idle_priority`: the idle scheduling
class, nice +10, its autogroup at nice 19) and raises it back itself when its assignment's
line arrives. On a loaded machine that comes late: the thread that raises it runs in the idle
class too, behind every busy process, and needs the GIL from a main thread still importing
torch in that class. A spare assigned mid-import finished its import 65 s after its peers'
(tests/system/test_wan_replan.py saw a first step 72 s after the assignment, and a re-plan
weighed a move at that cost). The launcher runs at full priority, so it raises the spare at
hand-over (`raise_to_mine`); the spare's own restore stays, for threads it starts later.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path


def raise_to_mine(pid: int) -> None:
    """Give process `pid` (a spare this process started and just handed its assignment) this
    process's niceness and the normal scheduling class on every thread, and its autogroup
    niceness 0 (a new session's). Best effort: where the kernel refuses, the spare's own
    restore does it when it runs."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError):  # no autogroups here, or not ours to set
        Path(f"/proc/{pid}/autogroup").write_text("0")
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:  # it is gone
        return
    for tid in tids:
        with contextlib.suppress(OSError):  # a thread that just ended
            if hasattr(os, "SCHED_IDLE") and os.sched_getscheduler(tid) == os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
