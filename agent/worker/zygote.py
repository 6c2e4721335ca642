"""A warm spare that forks each assignment's worker instead of becoming it (a "zygote").

Why: a fresh worker pays python's, torch's and the worker's imports, `torch._dynamo` (which
AdamW's constructor imports) and the default corpus before its first step: about 3-6 s of CPU,
and every recovery, re-plan and move pays it again on every rank. A spare pays it once, ahead
of time, but then becomes that one worker, and the next spare pays it all again. A zygote is a
spare that stays: once warm it waits, and for each assignment it forks a child that is
already warm. Forking after torch is imported is the path torch's own DataLoader workers take
on Linux; the zygote never runs a torch operation, never touches CUDA and starts no thread of
its own but the line reader, so the child inherits no thread pool and no held lock it needs.

Protocol (the launcher's side is `dtfm.zygote`): the zygote reads JSON lines on stdin. A
JSON list is today's spare hand-over: become this worker (only before the first fork). An
object `{"fork": [flags]}` forks a worker with those flags (`dtfm.launcher.worker_flags`).
It answers on its reply descriptor with lines `ready`, `pid N` or `refused REASON` (one per
fork request, in order) and `exit N CODE` (CODE as `subprocess.Popen.returncode`: negative
for a signal). It refuses to fork once CUDA is initialized in it (a forked child cannot use
a parent's CUDA context); nothing in the worker's imports or warm-up does that today. End of input
ends the zygote; its children die with it (their parent-death signal).

Each child starts a session of its own (a stop kills its group, as for a fresh worker), arms
its parent-death signal against the zygote (which has armed its own against the agent), and
moves its output to its assignment's log (the `--log` flag, as a handed-over spare does).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
from collections.abc import Callable

REAP_S = 0.05  # how often an idle zygote looks for ended children
PR_SET_PDEATHSIG = 1


class ZygoteError(Exception):
    """A line the launcher should never send (the launcher's bug): ends the zygote."""


def parse_request(line: str) -> tuple[str, list[str]]:
    """("become", flags) or ("fork", flags) from one request line."""
    try:
        request = json.loads(line)
    except ValueError:
        request = None
    flags = request.get("fork") if isinstance(request, dict) else request
    if not (isinstance(flags, list) and all(isinstance(f, str) for f in flags)):
        raise ZygoteError(f"a spare expects a JSON list of flags or {{\"fork\": [...]}}, "
                          f"got {line[:200]!r}")
    return ("fork" if isinstance(request, dict) else "become"), flags


def exit_code(status: int) -> int:
    """`os.waitpid`'s status as `Popen.returncode` reads it."""
    return os.waitstatus_to_exitcode(status)


def _reap(children: set[int], reply: int) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        if pid in children:
            children.discard(pid)
            os.write(reply, f"exit {pid} {exit_code(status)}\n".encode())


def die_with(parent_pid: int) -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; elsewhere a
    no-op); False if `parent_pid` is no longer its parent (it died before the arming)."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    return os.getppid() == parent_pid


def _become_child(zygote_pid: int, reply: int) -> None:
    """In the forked child: a session of its own, death with the zygote, no zygote pipes."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    if not die_with(zygote_pid):
        os._exit(1)  # the zygote died between the fork and the signal's arming
    os.close(reply)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the zygote's request pipe is not the worker's to read
    os.close(devnull)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - the process's stdin from now on


def serve(lines: queue.Queue[str], reply: int,
          fork_problem: Callable[[], str | None] = lambda: None) -> list[str] | None:
    """Fork a worker per request until one says "become" or input ends.

    Returns the flags this process should run as a worker: in a forked child, its request's;
    in the zygote itself, a "become" request's; None at end of
    input (the zygote should exit). A "become" after a fork is refused (ZygoteError): the
    zygote must outlive its children to report their exits. A fork that `fork_problem` gives
    a reason against is answered `refused REASON` (the launcher then spawns the worker).
    """
    zygote_pid = os.getpid()
    children: set[int] = set()
    forked = False
    os.write(reply, b"ready\n")
    while True:
        _reap(children, reply)
        try:
            line = lines.get(timeout=REAP_S)
        except queue.Empty:
            continue
        if not line:
            return None
        kind, flags = parse_request(line)
        if kind == "become":
            if forked:
                raise ZygoteError("a spare that has forked workers cannot become one")
            return flags
        if problem := fork_problem():
            os.write(reply, f"refused {' '.join(problem.split())}\n".encode())
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _become_child(zygote_pid, reply)
            return flags
        forked = True
        children.add(pid)
        os.write(reply, f"pid {pid}\n".encode())
