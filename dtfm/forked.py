"""The launcher's side of a zygote (agent/worker/zygote.py): its replies, and its children.

A zygote's workers are its children, not the agent's, so the agent cannot `waitpid` them.
The zygote reports each fork's pid and each child's exit status on a pipe; `Replies` reads
that pipe on a thread and `ForkedChild` answers the questions a `subprocess.Popen` answers
(`pid`, `poll`, `wait`, `returncode`, signals), so `dtfm.launcher.WorkerProcess` and
`dtfm.procs` treat a forked worker exactly as a spawned one.

If the zygote dies, its children die with it (their parent-death signal): each child not yet
reported is then given -SIGKILL once it is gone (bounded by `GONE_WAIT_S`).

No torch and no grpc here: the daemons import this.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

GONE_WAIT_S = 5.0  # after the zygote's end, how long its children may take to be gone


class Replies(threading.Thread):
    """Reads a zygote's reply lines: `ready`, `pid N`, `exit N CODE`."""

    def __init__(self, fd: int) -> None:
        super().__init__(name=f"zygote-replies-{fd}", daemon=True)
        self._file = os.fdopen(fd, "rb", buffering=0)
        self._cond = threading.Condition()
        self._pids: list[int | None] = []  # forks (None: refused) not yet taken
        self.refusal = ""  # the zygote's last reason for refusing a fork
        self._codes: dict[int, int] = {}
        self._forked: set[int] = set()
        self.is_ready = False
        self.ended = False

    def run(self) -> None:
        try:
            for raw in self._file:
                self._take(raw.decode(errors="replace").split())
        except OSError:
            pass
        finally:
            self._file.close()
            self._zygote_gone()

    def _take(self, words: list[str]) -> None:
        with self._cond:
            if words == ["ready"]:
                self.is_ready = True
            elif len(words) == 2 and words[0] == "pid" and words[1].isdigit():
                self._pids.append(int(words[1]))
                self._forked.add(int(words[1]))
            elif words[:1] == ["refused"]:
                self._pids.append(None)
                self.refusal = " ".join(words[1:])[:500]
            elif len(words) == 3 and words[0] == "exit" and words[1].isdigit():
                self._codes[int(words[1])] = int(words[2])
            self._cond.notify_all()

    def _zygote_gone(self) -> None:
        with self._cond:
            self.ended = True
            waiting = self._forked - set(self._codes)
            self._cond.notify_all()
        deadline = time.monotonic() + GONE_WAIT_S
        for pid in waiting:
            while _exists(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
        with self._cond:
            for pid in waiting:
                self._codes.setdefault(pid, -signal.SIGKILL)
            self._cond.notify_all()

    def next_pid(self, timeout: float) -> int | None:
        """The next fork's pid; None if it was refused (`refusal` says why), none came
        within `timeout`, or the zygote ended."""
        with self._cond:
            self._cond.wait_for(lambda: self._pids or self.ended, timeout)
            return self._pids.pop(0) if self._pids else None

    def code(self, pid: int, timeout: float | None = 0.0) -> int | None:
        """`pid`'s exit status once reported (waiting up to `timeout`; None: forever)."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._codes, timeout)
            return self._codes.get(pid)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ForkedChild:
    """A worker a zygote forked, with the part of `subprocess.Popen`'s interface the
    launcher and `dtfm.procs` use."""

    def __init__(self, pid: int, replies: Replies) -> None:
        self.pid = pid
        self.replies = replies
        self.returncode: int | None = None
        self.args = ["zygote child", str(pid)]

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.replies.code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.replies.code(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
