"""Entry point the agent's supervisor and `agent local` spawn: one worker process.

`python -m agent.worker --assignment PATH [--progress PATH]`; PATH holds a binary-serialized
`dtfm.v1.Assignment`. Progress is JSON lines (step, done, error events) appended to the
progress file, or stdout. Exit status 0 means training finished.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from agent.worker.train import read_assignment, run_assignment


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.worker", description=__doc__)
    parser.add_argument("--assignment", required=True, help="binary dtfm.v1.Assignment file")
    parser.add_argument("--progress", default=None, help="JSON-lines progress file (stdout)")
    args = parser.parse_args(argv)
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
