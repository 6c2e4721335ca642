"""The one way to start a training worker and follow it: `launch()` and `WorkerProcess`.

Both the agent's supervisor (one worker, under an asyncio daemon) and `agent local` (S x R
workers, a plain loop) start `python -m agent.worker --assignment PATH --progress PATH` the
same way, so it is written once here:

- the assignment is serialized to a private file (it names the rendezvous address), the
  worker's stdout and stderr go to a private log, and its JSON-lines progress to its own file,
  which is kept (`agent local --workdir`, the agent's state directory) for post-mortems;
- the worker runs in its own session, so stopping it stops whatever it started too, and with
  `WorkerEnv.SUPERVISOR_PID` it dies with the launching process even if that is SIGKILLed;
- it is spawned with `subprocess.Popen`, never an event loop's fork: CPython spawns with
  vfork/posix_spawn, which skips grpc's fork handlers; a plain fork() of a grpc process can
  crash the child (seen as SIGSEGV before exec under uvloop);
- its progress is read through `dtfm.core.events.parse_event`, by polling (`read_events`, for
  a loop over many workers) or as an async iterator (`follow`, for the daemon);
- it is stopped through `dtfm.procs`, the one terminate-then-kill.

A worker may also be started before its assignment exists (`Spare`): the same command with
`--spare` imports python, torch and the worker's modules (seconds, most of a cold start on a
busy machine) and then waits for one line on its stdin, the JSON list of exactly the flags a
fresh worker gets on its command line (`worker_flags`), so the two paths share one mapping.
A spare is used only when its environment is the one a fresh worker would get now. Once warm
a spare is a zygote (agent/worker/zygote.py, `Spare.fork`): it forks each worker, already
warm, and stays; `dtfm.forked` gives the launcher those children's exit statuses.

No torch and no grpc here: the daemons import this, and the worker itself imports only
`dtfm.core`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dtfm.core import spareprio
from dtfm.core.events import ProgressEvent, WorkerEnv, parse_event
from dtfm.core.files import open_private_append, write_private
from dtfm.core.hfexport import ExportError
from dtfm.core.mergerequest import EXPORT_ERROR_EXIT, MergeRequest
from dtfm.forked import ForkedChild, Replies
from dtfm.procs import terminate_all, terminate_all_async
from protos.dtfm.v1 import common_pb2

FOLLOW_POLL_S = 0.25
STOP_GRACE_S = 10.0
FORK_TIMEOUT_S = 10.0  # a warm zygote answers a fork in milliseconds
SPARE_LOG = "spare.log"  # a spare's output until it takes an assignment (then that one's log)


@dataclass(frozen=True)
class WorkerFiles:
    """Where one worker's assignment, progress, log and the agent's requests to it
    (`dtfm.core.requests`) live: `<dir>/<stem>.<kind>`."""

    assignment: Path
    progress: Path
    log: Path
    requests: Path

    @classmethod
    def in_dir(cls, workdir: Path, stem: str) -> WorkerFiles:
        return cls(workdir / f"{stem}.assignment.pb", workdir / f"{stem}.progress.jsonl",
                   workdir / f"{stem}.log", workdir / f"{stem}.requests")


def worker_env(*, threads: int = 0, timeout_s: float | None = None, bind_interface: str = "",
               local_rank: int | None = None,
               base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The worker's environment: `base` (this process's) plus what the worker must be told.

    `threads` > 0 caps both torch's and OpenMP's threads (several workers share one machine's
    cores); `timeout_s` bounds every collective; `bind_interface` is the operator's choice of
    interface for collectives; `local_rank` picks the GPU. Unset ones leave the worker's
    defaults (or whatever `base` holds) alone.
    """
    env = dict(os.environ if base is None else base)
    env["PYTHONUNBUFFERED"] = "1"
    env[WorkerEnv.SUPERVISOR_PID] = str(os.getpid())  # die with us (see agent.worker)
    if threads > 0:
        env["OMP_NUM_THREADS"] = env[WorkerEnv.THREADS] = str(threads)
    if timeout_s is not None:
        env[WorkerEnv.TIMEOUT] = str(timeout_s)
    if bind_interface:
        env[WorkerEnv.BIND_INTERFACE] = bind_interface
    if local_rank is not None:
        env["LOCAL_RANK"] = str(local_rank)
    return env


def worker_flags(files: WorkerFiles, *, assigned_at: float | None = None,
                 log: bool = False) -> list[str]:
    """The worker's flags: a fresh worker's command line, or the line a spare reads.

    `assigned_at` (wall-clock seconds) is when the agent received the assignment, for the
    worker's start-up timing; `log` asks the worker to move its own stdout and stderr to
    `files.log` (a spare's output was redirected elsewhere when it started).
    """
    flags = ["--assignment", str(files.assignment), "--progress", str(files.progress),
             "--requests", str(files.requests)]
    if log:
        flags += ["--log", str(files.log)]
    if assigned_at is not None:
        flags += ["--assigned-at", f"{assigned_at:.6f}"]
    return flags


def worker_argv(files: WorkerFiles, python: str = sys.executable, *,
                assigned_at: float | None = None) -> list[str]:
    """The worker's command line (the contract tests/agent/worker/test_entrypoint.py pins)."""
    return [python, "-m", "agent.worker", *worker_flags(files, assigned_at=assigned_at)]


def _write_files(assignment: common_pb2.Assignment, files: WorkerFiles) -> None:
    """Write the assignment; remove an old progress file of the same name (the worker
    appends, and a reader starts at offset 0) and old requests (meant for another run). The
    log is appended to, so an earlier run's log survives."""
    write_private(files.assignment, assignment.SerializeToString())
    files.progress.unlink(missing_ok=True)
    files.requests.unlink(missing_ok=True)


def launch(assignment: common_pb2.Assignment, files: WorkerFiles, env: Mapping[str, str],
           *, python: str = sys.executable, cwd: Path | None = None,
           assigned_at: float | None = None) -> WorkerProcess:
    """Write `assignment`, start its worker in a new session and return the handle."""
    _write_files(assignment, files)
    with open_private_append(files.log) as log:
        popen = subprocess.Popen(
            worker_argv(files, python, assigned_at=assigned_at), stdin=subprocess.DEVNULL,
            stdout=log, stderr=log, env=dict(env), cwd=cwd, start_new_session=True,
        )
    return WorkerProcess(files, popen)


class Spare:
    """A worker process started before its assignment, waiting for it on its stdin.

    Started exactly like a worker (own session, `WorkerEnv.SUPERVISOR_PID` so it dies with
    the launching process, `subprocess.Popen`), with `--spare`: it imports everything, then
    blocks reading one line. `take` writes that line (the flags of `worker_flags`) and the
    spare becomes the assignment's worker; closing its stdin without a line (`stop`, or the
    launching process dying) makes it exit. Must be started from a thread that lives as long
    as the launcher (the event loop's): the parent-death signal follows the creating thread.
    """

    def __init__(self, popen: subprocess.Popen[bytes], env: Mapping[str, str],
                 python: str, replies: Replies | None = None) -> None:
        self.popen = popen
        self.env = dict(env)
        self.python = python
        self.replies = replies

    @classmethod
    def start(cls, workdir: Path, env: Mapping[str, str], *, python: str = sys.executable,
              cwd: Path | None = None, zygote: bool = True, idle: bool = True) -> Spare:
        """Start a spare; its output goes to `workdir/spare.log` until it takes a job.

        `zygote`: once warm it forks each assignment's worker and stays (`fork`), instead of
        becoming the one worker it is handed (`take`, still what a spare not yet warm does).
        `idle`: it imports at idle priority (beside a training worker); otherwise at ours.
        """
        restore = spareprio.restorable_niceness() if idle else None
        argv = [python, "-m", "agent.worker", "--spare",
                *([] if restore is None else [spareprio.RESTORE_NICE_FLAG, str(restore)])]
        read_fd, write_fd = os.pipe() if zygote else (-1, -1)
        try:
            with open_private_append(workdir / SPARE_LOG) as log:
                popen = subprocess.Popen(
                    [*argv, "--reply-fd", str(write_fd)] if zygote else argv,
                    stdin=subprocess.PIPE, stdout=log, stderr=log, env=dict(env), cwd=cwd,
                    start_new_session=True, pass_fds=(write_fd,) if zygote else (),
                )
        except BaseException:
            for fd in (read_fd, write_fd):
                if fd >= 0:
                    os.close(fd)
            raise
        if restore is not None:  # here, not in the spare: dtfm/core/spareprio.py says why
            spareprio.lower_to_idle(popen.pid, restore)
        replies = None
        if zygote:
            os.close(write_fd)
            replies = Replies(read_fd)
            replies.start()
        return cls(popen, env, python, replies)

    @property
    def ready(self) -> bool:
        """Warm, alive and forking: `fork` hands it an assignment without a wait."""
        return (self.replies is not None and self.replies.is_ready and not self.replies.ended
                and self.popen.poll() is None)

    def fork(self, assignment: common_pb2.Assignment, files: WorkerFiles,
             assigned_at: float | None = None,
             timeout_s: float = FORK_TIMEOUT_S) -> WorkerProcess | None:
        """A worker for `assignment` forked from this warm spare, which stays for the next;
        None if it is not ready or did not answer within `timeout_s` (the caller then stops
        it and launches a fresh worker)."""
        if not self.ready or self.replies is None or self.popen.stdin is None:
            return None
        _write_files(assignment, files)
        flags = worker_flags(files, assigned_at=assigned_at, log=True)
        try:
            self.popen.stdin.write((json.dumps({"fork": flags}) + "\n").encode())
            self.popen.stdin.flush()
        except OSError:  # BrokenPipeError: it died since `ready`
            return None
        pid = self.replies.next_pid(timeout_s)
        if pid is None:
            return None
        return WorkerProcess(files, ForkedChild(pid, self.replies))

    @property
    def pid(self) -> int:
        return self.popen.pid

    def fits(self, env: Mapping[str, str], python: str) -> bool:
        """Started as a fresh worker would be now (same interpreter and environment: torch
        reads some variables at import, so a differing one cannot be applied afterwards).
        Whether it is still alive is `take`'s to find out."""
        return self.python == python and self.env == dict(env)

    def take(self, assignment: common_pb2.Assignment, files: WorkerFiles,
             assigned_at: float | None = None) -> WorkerProcess | None:
        """Hand `assignment` to the spare, which becomes its worker; None if the spare is
        gone (the caller then launches a fresh worker)."""
        if self.popen.poll() is not None or self.popen.stdin is None:
            return None
        _write_files(assignment, files)
        line = json.dumps(worker_flags(files, assigned_at=assigned_at, log=True)) + "\n"
        try:  # a few hundred bytes: the pipe takes them at once
            self.popen.stdin.write(line.encode())
            self.popen.stdin.flush()
            self.popen.stdin.close()
        except OSError:  # BrokenPipeError: it died since poll()
            return None
        spareprio.raise_to_mine(self.popen.pid)  # not left to the spare: spareprio says why
        return WorkerProcess(files, self.popen)

    def _close_stdin(self) -> None:
        if self.popen.stdin is not None:
            with contextlib.suppress(OSError):
                self.popen.stdin.close()

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """End the spare (end of input, SIGTERM, then SIGKILL after `grace_s`); reaps it."""
        self._close_stdin()
        terminate_all([self.popen], grace_s, group=True)

    async def stop_async(self, grace_s: float = STOP_GRACE_S) -> None:
        """`stop` without blocking the event loop."""
        self._close_stdin()
        await terminate_all_async([self.popen], grace_s, group=True)


def start_zygote(workdir: Path, env: Mapping[str, str], *, timeout_s: float = 300.0,
                 python: str = sys.executable) -> Spare | None:
    """A warm zygote for workers that all get `env`, started at our priority and waited for
    (its import is what each worker would have paid); None, with its log's tail printed, if
    it did not get warm within `timeout_s` (the caller spawns the workers instead)."""
    spare = Spare.start(workdir, env, python=python, idle=False)
    deadline = time.monotonic() + timeout_s
    while not spare.ready and spare.popen.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if spare.ready:
        return spare
    spare.stop(grace_s=0.0)
    tail = (workdir / SPARE_LOG).read_text(errors="replace").strip().splitlines()[-3:]
    print(f"the warm spare did not start ({' | '.join(tail) or 'no output'}); starting each "
          f"worker on its own", file=sys.stderr)
    return None


class ProgressTail:
    """The complete lines appended to a progress file since the last read, parsed.

    A line the worker is still writing stays in the file until its newline arrives, so an
    event is never parsed from half a line.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def read(self) -> list[ProgressEvent]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._offset += end
        return [ev for line in data[:end].splitlines() if (ev := parse_event(line)) is not None]


class WorkerProcess:
    """A started worker: its files, its process (spawned, or forked by a zygote), its
    progress so far."""

    def __init__(self, files: WorkerFiles,
                 popen: subprocess.Popen[bytes] | ForkedChild) -> None:
        self.files = files
        self.popen = popen
        self._tail = ProgressTail(files.progress)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        """The exit status, or None while the worker runs."""
        return self.popen.poll()

    def read_events(self) -> list[ProgressEvent]:
        """Events written since the last call (never blocks): for polling loops."""
        return self._tail.read()

    async def follow(self, poll_s: float = FOLLOW_POLL_S) -> AsyncIterator[ProgressEvent]:
        """Every event until the worker exits, including the last ones written before it did."""
        while True:
            exited = self.poll() is not None  # checked before reading: nothing is missed
            for event in self.read_events():
                yield event
            if exited:
                return
            await asyncio.sleep(poll_s)

    def log_tail(self, lines: int = 5, sep: str = " | ") -> str:
        """The last `lines` lines of the worker's log: what explains an unexplained exit."""
        try:
            text = self.files.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return sep.join(deque(text, maxlen=lines)) or "(empty log)"

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the worker's process group, SIGKILL it after `grace_s`; reaps it."""
        terminate_all([self.popen], grace_s, group=True)

    async def stop_async(self, grace_s: float = STOP_GRACE_S) -> None:
        """`stop` without blocking the event loop."""
        await terminate_all_async([self.popen], grace_s, group=True)


def stop_all(workers: Iterable[WorkerProcess], grace_s: float = STOP_GRACE_S) -> None:
    """Stop several workers sharing one grace period (SIGTERM all first, then wait)."""
    terminate_all([w.popen for w in workers], grace_s, group=True)


MERGE_MODULE = "agent.worker.loramerge"  # run as `python -m`, never imported by a daemon


def run_merge(request: MergeRequest, workdir: Path, progress: Callable[[str], None],
              python: str = sys.executable) -> Path:
    """Write a merged LoRA export in a child process (`python -m agent.worker.loramerge`):
    the torch-free coordinator's way to fold adapters into their base. Its stdout lines are
    passed to `progress`; an ExportError there is one here, with the child's message. Blocks:
    call it from a thread (spawned with Popen, as every worker is: see `launch`)."""
    req, log = workdir / "merge-request.json", workdir / "merge.log"
    write_private(req, request.dumps().encode())
    with open_private_append(log) as err:
        proc = subprocess.Popen([python, "-m", MERGE_MODULE, str(req)], stdout=subprocess.PIPE,
                                stderr=err, text=True, start_new_session=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            progress(line.rstrip("\n"))
        rc = proc.wait()
    if rc == 0:
        return request.out.absolute()
    tail = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    if rc == EXPORT_ERROR_EXIT and tail:
        raise ExportError(tail[-1])
    raise ExportError(f"the merge process exited with status {rc}"
                      f"{': ' + tail[-1] if tail else ''} (its log: {log}, kept only until "
                      f"the export ends): check the base model named by --init-from")
