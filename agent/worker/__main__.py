"""Entry point `dtfm.launcher` spawns (for the agent's supervisor and `agent local`): one worker.

`python -m agent.worker --assignment PATH [--progress PATH]`; PATH holds a binary-serialized
`dtfm.v1.Assignment`. Progress is JSON lines (the step, done and error events of
`dtfm.core.events`) appended to the progress file, or stdout. Exit status 0 means training
finished.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from agent.worker.train import read_assignment, run_assignment
from dtfm.core.events import WorkerEnv

PARENT_ENV = WorkerEnv.SUPERVISOR_PID
PR_SET_PDEATHSIG = 1


def die_with_supervisor() -> None:
    """Exit when the agent that spawned us dies, even by SIGKILL.

    The worker runs in its own session so that a stop can kill its whole group, which also
    means it would outlive a crashed agent and keep its GPU busy. The kernel's parent-death
    signal closes that gap; the pid check closes the race where the agent died first.
    """
    expected = os.environ.get(PARENT_ENV)
    if not expected or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != int(expected):
        sys.exit("the agent that started this worker is gone")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.worker", description=__doc__)
    parser.add_argument("--assignment", required=True, help="binary dtfm.v1.Assignment file")
    parser.add_argument("--progress", default=None, help="JSON-lines progress file (stdout)")
    args = parser.parse_args(argv)
    die_with_supervisor()
    a = read_assignment(args.assignment)
    logging.basicConfig(
        level=os.environ.get("DTFM_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s rank{a.rank} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        run_assignment(a, args.progress)
    except Exception:
        logging.getLogger("agent.worker").exception("worker rank %d failed", a.rank)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
