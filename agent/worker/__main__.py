"""Entry point `dtfm.launcher` spawns (for the agent's supervisor and `agent local`): one worker.

`python -m agent.worker --assignment PATH [--progress PATH]`; PATH holds a binary-serialized
`dtfm.v1.Assignment`. Progress is JSON lines (the step, done and error events of
`dtfm.core.events`) appended to the progress file, or stdout. Exit status 0 means training
finished.

`python -m agent.worker --spare` is the same worker started before its assignment exists
(`dtfm.launcher.Spare`): it imports torch and every worker module, then waits for one line
on stdin, the JSON list of the flags above, and carries on exactly as a fresh worker would.
End of input without a line means "not needed": it exits 0. Importing is most of a cold
start (seconds, more when several workers start on one machine), so a spare starts training
that much sooner.

The worker logs one `start-up:` line (JSON) with wall-clock marks: when the agent received
the assignment (`--assigned-at`), when this process started, when its imports finished and
when it had its assignment; `bench/startup.py` reads it with the later phases' log lines.
"""

from __future__ import annotations

import time

STARTED_AT = time.time()  # before the imports below, which are most of a cold start

import os  # noqa: E402
import queue  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

from agent.worker import zygote  # noqa: E402 - no torch: cheap
from dtfm.core import spareprio  # noqa: E402 - nor here
from dtfm.core.events import WorkerEnv  # noqa: E402 - no torch either
from dtfm.core.files import open_private_append  # noqa: E402 - nor here

PARENT_ENV = WorkerEnv.SUPERVISOR_PID


def die_with_supervisor() -> None:
    """Exit when the agent that spawned us dies, even by SIGKILL.

    The worker runs in its own session so that a stop can kill its whole group, which also
    means it would outlive a crashed agent and keep its GPU busy. The kernel's parent-death
    signal closes that gap; the pid check closes the race where the agent died first. Armed
    before torch is imported, so a spare still importing dies with its agent too.
    """
    expected = os.environ.get(PARENT_ENV)
    if not expected or not sys.platform.startswith("linux"):
        return
    if not zygote.die_with(int(expected)):
        sys.exit("the agent that started this worker is gone")


RESTORE_NICE_FLAG = spareprio.RESTORE_NICE_FLAG


def restore_niceness(argv: list[str]) -> int | None:
    """The niceness `--restore-nice N` names: the launcher lowered this spare to the idle
    class (dtfm/core/spareprio.py) and it goes back to N at hand-over. None: it runs at its
    launcher's priority already. Read before argparse is imported: the hand-over thread
    starts before the imports."""
    if RESTORE_NICE_FLAG not in argv[:-1]:
        return None
    try:
        return int(argv[argv.index(RESTORE_NICE_FLAG) + 1])
    except ValueError:
        return None  # argparse rejects it below, with the flag's name


def restore_priority(niceness: int | None) -> None:
    """Back to the launcher's niceness and the normal scheduling class, for every thread,
    including those started since the launcher raised this process."""
    if niceness is not None:
        spareprio.raise_to(os.getpid(), niceness, spareprio.SPARE_PATIENCE_S)


class Handover(threading.Thread):
    """A spare's ear on stdin while its main thread imports and warms up: the moment the
    assignment's line arrives the whole process gets its launcher's priority back, so the
    rest of the import runs at full priority instead of finishing below the peers. Every
    line read goes to `lines` ("" at end of input): a zygote (agent/worker/zygote.py) reads
    its fork requests from there."""

    def __init__(self, priority: int | None) -> None:
        super().__init__(name="spare-handover", daemon=True)
        self.priority = priority
        self.lines: queue.Queue[str] = queue.Queue()

    def run(self) -> None:
        restored = False
        try:
            while line := sys.stdin.readline():
                if not restored:
                    restore_priority(self.priority)
                    restored = True
                self.lines.put(line)
        finally:
            if not restored:
                restore_priority(self.priority)
            self.lines.put("")


HANDOVER: Handover | None = None
if __name__ == "__main__":
    die_with_supervisor()
    if "--spare" in sys.argv[1:]:
        HANDOVER = Handover(restore_niceness(sys.argv[1:]))
        HANDOVER.start()

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402

from agent.worker.train import read_assignment, run_assignment  # noqa: E402

IMPORTED_AT = time.time()
STARTUP_PREFIX = "start-up: "  # the log line bench/startup.py parses
log = logging.getLogger("agent.worker")


def make_parser() -> argparse.ArgumentParser:
    """The worker's flags; a spare parses the line it reads with this same parser."""
    parser = argparse.ArgumentParser(prog="python -m agent.worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--assignment", help="binary dtfm.v1.Assignment file")
    parser.add_argument("--progress", default=None, help="JSON-lines progress file (stdout)")
    parser.add_argument("--requests", default=None,
                        help="file the agent writes requests into while the worker trains "
                             "(dtfm.core.requests: a step to checkpoint after)")
    parser.add_argument("--log", default=None,
                        help="append stdout and stderr to this file from now on")
    parser.add_argument("--assigned-at", type=float, default=None,
                        help="wall-clock time the agent received the assignment (timing)")
    parser.add_argument("--spare", action="store_true",
                        help="import everything, then read the other flags from stdin")
    parser.add_argument(RESTORE_NICE_FLAG, type=int, default=None,
                        help="with --spare: the launcher lowered this process's priority "
                             "(dtfm/core/spareprio.py); back to this niceness at hand-over")
    parser.add_argument("--reply-fd", type=int, default=None,
                        help="with --spare: stay a zygote that forks a worker per request "
                             "and answers on this descriptor (agent/worker/zygote.py)")
    return parser


def warm_up() -> None:
    """What a fresh worker pays lazily on its way to the first step, paid by a spare before
    its assignment: `torch._dynamo`, which AdamW's constructor imports (about 3 s of CPU,
    more than torch itself), and the default corpus (`data.stdlib_corpus`, cached: about
    1.6 s). Neither changes what is computed. A failure here is only logged: the worker
    meets it again where it matters and reports it there, with its rank."""
    try:
        import torch._dynamo  # noqa: F401

        from agent.worker.data import stdlib_corpus

        stdlib_corpus()
    except Exception as exc:  # noqa: BLE001 - see above
        print(f"spare worker: warm-up failed ({exc!r}); the worker will pay for it later",
              file=sys.stderr)


FORK_WORKERS_ENV = "DTFM_FORK_WORKERS"


def fork_problem() -> str | None:
    """Why this warm spare must not fork a worker now (None: it may). `DTFM_FORK_WORKERS=0`
    in the agent's environment turns forking off (its spares then become their worker)."""
    import torch

    if os.environ.get(FORK_WORKERS_ENV, "1") == "0":
        return f"{FORK_WORKERS_ENV}=0 in the agent's environment"
    if torch.cuda.is_initialized():
        return "CUDA is initialized in the spare worker, and a forked child cannot use it"
    return None


def await_assignment(parser: argparse.ArgumentParser,
                     reply_fd: int | None = None) -> argparse.Namespace | None:
    """A spare's wait: the flags of the worker this process is to run, read from stdin.

    A plain spare reads one line, the JSON list of a fresh worker's flags. With `reply_fd`
    the spare is a zygote (agent/worker/zygote.py): it forks a worker per request and this
    returns in each forked child with its flags (and in the zygote for a "become" line).
    None at end of input (the agent discarded this spare, or died). A malformed line is the
    launcher's bug, so it ends the process with a message (exit 2) rather than a guess.
    """
    handover = HANDOVER
    if handover is None:  # main() called with --spare other than as `python -m`
        handover = Handover(None)
        handover.start()
    try:
        if reply_fd is not None:
            restore_priority(handover.priority)  # warm and idle: forked workers run at ours
            flags = zygote.serve(handover.lines, reply_fd, fork_problem=fork_problem)
        elif line := handover.lines.get():
            kind, flags = zygote.parse_request(line)
            if kind != "become":
                raise zygote.ZygoteError("a spare started without --reply-fd cannot fork")
        else:
            flags = None
    except zygote.ZygoteError as exc:
        parser.error(str(exc))
    if flags is None:
        return None
    args = parser.parse_args(flags)
    if args.spare:
        parser.error("the flags a spare reads cannot ask for another spare (--spare)")
    return args


def redirect_output(path: str) -> None:
    """Point this process's stdout and stderr (the file descriptors, so C code's output and
    a crash's traceback follow) at the assignment's log, as a fresh worker's would be."""
    sys.stdout.flush()
    sys.stderr.flush()
    with open_private_append(Path(path)) as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)


def log_startup(args: argparse.Namespace, warm_at: float | None, handed_at: float) -> None:
    """One line with this process's start-up marks (wall-clock seconds)."""
    marks = {"spare": warm_at is not None, "assigned_at": args.assigned_at,
             "started_at": STARTED_AT, "imported_at": IMPORTED_AT, "warm_at": warm_at,
             "ready_at": handed_at, "pid": os.getpid()}
    log.info("%s%s", STARTUP_PREFIX, json.dumps(marks))


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    warm_at = None  # a spare: when its warm-up ended
    if args.spare:
        warm_up()
        warm_at = time.time()
        taken = await_assignment(parser, args.reply_fd)
        if taken is None:
            return 0
        args = taken
    if not args.assignment:
        parser.error("--assignment is required (or --spare)")
    handed_at = time.time()
    if args.log:
        redirect_output(args.log)
    a = read_assignment(args.assignment)
    logging.basicConfig(
        level=os.environ.get("DTFM_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s rank{a.rank} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    log_startup(args, warm_at, handed_at)
    try:
        run_assignment(a, args.progress, args.requests)
    except Exception:
        log.exception("worker rank %d failed", a.rank)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
