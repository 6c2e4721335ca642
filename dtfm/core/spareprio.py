"""A spare worker's CPU priority: lowered by its launcher when it starts, raised by its launcher
when it is handed an assignment.

A spare imports torch (seconds of CPU) while its agent's worker may be training on the same
cores, so it imports in the idle scheduling class, at nice +10, with its session's autogroup
at nice 19. The autogroup is what made the nice alone useless: the spare runs in its own
session, and where the kernel groups sessions (`kernel.sched_autogroup_enabled`, on in most
distributions) CPU time is shared between sessions first, so a spare at any nice or class got
as much CPU as a whole agent, and 16 spares importing at once on 2 cores delayed the agents'
pings by a second. Only where the launcher can raise it back (root, or an RLIMIT_NICE that
allows it): a worker must never train at a lower priority than its peers.

Both moves are the launcher's, made from its own process, so they happen in the order it makes
them. The spare used to lower itself once its first imports were done, and on a loaded
machine an assignment could arrive first: the launcher raised a spare that was not yet low,
the spare then lowered itself and imported for minutes in the idle class behind every busy
process (CI: six of nine spares of one job took 200 s to get warm, the job's 240 s budget ran
out). Raising from the launcher matters for the same reason: the spare's own thread that
restores it runs in the idle class too, behind every busy process, and needs the GIL from a
main thread still importing torch in that class (tests/system/test_wan_replan.py saw a first
step 72 s after the assignment). The spare still restores itself when its assignment line
arrives (`raise_to` on itself), for threads it starts after the launcher's raise.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

IDLE_NICE_STEP = 10  # how much nicer than its launcher a waiting spare is
# the flag that tells a spare its launcher lowered it, and the niceness to go back to
RESTORE_NICE_FLAG = "--restore-nice"
AUTOGROUP_IDLE_NICE = 19
# without CAP_SYS_ADMIN the kernel takes one autogroup write per 0.1 s from all processes
# together (EAGAIN otherwise): the launcher retries briefly (it calls from its event loop's
# thread), the spare raising itself as long as it used to (its own thread may wait)
LAUNCHER_PATIENCE_S = 0.1
SPARE_PATIENCE_S = 3.0
AUTOGROUP_RETRY_S = 0.02


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:  # it is gone
        return []


def _set_autogroup_nice(pid: int, nice: int, patience_s: float) -> None:
    """`pid`'s session's autogroup niceness, where the kernel has autogroups; best effort,
    retried for at most `patience_s` while the kernel's rate limit refuses it."""
    group = Path(f"/proc/{pid}/autogroup")
    for _ in range(max(1, round(patience_s / AUTOGROUP_RETRY_S))):
        try:
            group.write_text(str(nice))
            return
        except BlockingIOError:  # the kernel's rate limit on unprivileged writes
            time.sleep(AUTOGROUP_RETRY_S)
        except OSError:  # no autogroups here, a sandbox that forbids it, or it is gone
            return


def restorable_niceness() -> int | None:
    """This process's niceness, which a spare it lowers goes back to at hand-over; None where
    it could not raise a spare back to it (not Linux; neither root nor an RLIMIT_NICE that
    allows it), so spares are not lowered at all."""
    if not sys.platform.startswith("linux"):
        return None
    import resource

    mine = os.getpriority(os.PRIO_PROCESS, 0)
    limit = resource.getrlimit(resource.RLIMIT_NICE)[0]
    allowed = os.geteuid() == 0 or limit == resource.RLIM_INFINITY or 20 - limit <= mine
    return mine if allowed else None


def lower_to_idle(pid: int, niceness: int) -> None:
    """Lower process `pid` (a spare this process just started, in a session of its own) to
    the idle class and `niceness` + 10 on every thread it has (threads it starts later
    inherit them), and its autogroup to nice 19."""
    for tid in _threads(pid):
        with contextlib.suppress(OSError):  # a thread that just ended
            os.setpriority(os.PRIO_PROCESS, tid, min(19, niceness + IDLE_NICE_STEP))
            if hasattr(os, "SCHED_IDLE"):
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    _set_autogroup_nice(pid, AUTOGROUP_IDLE_NICE, LAUNCHER_PATIENCE_S)


def raise_to(pid: int, niceness: int, patience_s: float = LAUNCHER_PATIENCE_S) -> None:
    """Give process `pid` `niceness` and the normal scheduling class on every thread (both
    are per thread on Linux), and its autogroup niceness 0 (a new session's). Best effort:
    where the kernel refuses, the spare's own restore (`patience_s` = SPARE_PATIENCE_S)
    does it when it runs."""
    if not sys.platform.startswith("linux"):
        return
    _set_autogroup_nice(pid, 0, patience_s)
    for tid in _threads(pid):
        with contextlib.suppress(OSError):  # a thread that just ended
            if hasattr(os, "SCHED_IDLE") and os.sched_getscheduler(tid) == os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, niceness)


def raise_to_mine(pid: int) -> None:
    """`raise_to` this process's own niceness: a spare handed its assignment."""
    raise_to(pid, os.getpriority(os.PRIO_PROCESS, 0))
