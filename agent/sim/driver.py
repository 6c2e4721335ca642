"""Drives a few swarm processes (agent/sim/swarm.py) from a test or a benchmark.

Spawns them, splits the world's agents between them, reads their event lines on threads and
keeps what they say: when each agent was welcomed, and which agents received an assignment
and trained a first step in each epoch. The coordinator is the caller's to start (a real
`coordinator start` process); this module never imports it.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from dtfm.procs import terminate_all, wait_for


class Swarms:
    def __init__(self, coordinator: str, agents: int, world_seed: int, processes: int = 4,
                 time_scale: float = 1.0, env: dict[str, str] | None = None,
                 log: Path | None = None, nice: int = 0) -> None:
        """`env` must carry the join token ($DTFM_TOKEN); the swarms' logs go to `log`;
        `nice`: their niceness (a benchmark leaves the CPU to the coordinator it measures)."""
        self.agents = agents
        self._lock = threading.Lock()
        self.welcomed: dict[int, float] = {}  # agent -> its latest welcome (unix s)
        self.welcomes = 0
        self.assigned: dict[int, dict[int, float]] = defaultdict(dict)  # epoch -> agent -> t
        self.trained: dict[int, dict[int, float]] = defaultdict(dict)
        self.killed: set[int] = set()
        self.procs: list[subprocess.Popen[str]] = []
        self._log = open(log, "ab") if log is not None else None  # noqa: SIM115 - close()
        processes = max(1, min(processes, agents))
        bounds = [agents * k // processes for k in range(processes + 1)]
        for first, end in itertools.pairwise(bounds):
            proc = subprocess.Popen(
                [sys.executable, "-m", "agent.sim", "--coordinator", coordinator,
                 "--world-seed", str(world_seed), "--world-agents", str(agents),
                 "--first", str(first), "--count", str(end - first),
                 "--time-scale", str(time_scale)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                stderr=self._log if self._log is not None else subprocess.DEVNULL,
                env=env or dict(os.environ), start_new_session=True,
                preexec_fn=(lambda: os.nice(nice)) if nice else None)
            self.procs.append(proc)
            threading.Thread(target=self._read, args=(proc,), daemon=True).start()
        self._owner = [k for k, (a, b) in enumerate(itertools.pairwise(bounds))
                       for _ in range(a, b)]

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                if ev["ev"] == "welcome":
                    self.welcomed[ev["i"]] = ev["t"]
                    self.welcomes += 1
                elif ev["ev"] == "assign":
                    self.assigned[ev["epoch"]][ev["i"]] = ev["t"]
                elif ev["ev"] == "train":
                    self.trained[ev["epoch"]][ev["i"]] = ev["t"]

    def count(self, what: Callable[[Swarms], int]) -> int:
        with self._lock:
            return what(self)

    def wait(self, predicate: Callable[[Swarms], bool], timeout: float, what: str) -> float:
        """Wait until `predicate(self)` holds; the time it took (raises after `timeout`)."""
        start = time.monotonic()
        wait_for(lambda: self.count(lambda s: int(predicate(s))), timeout, what,
                 interval=0.05)
        return time.monotonic() - start

    def kill(self, indices: Sequence[int]) -> None:
        """Those agents vanish at once (no goodbye)."""
        by_proc: dict[int, list[int]] = defaultdict(list)
        for i in indices:
            by_proc[self._owner[i]].append(i)
        for k, those in by_proc.items():
            stdin = self.procs[k].stdin
            assert stdin is not None
            stdin.write("kill " + " ".join(map(str, those)) + "\n")
            stdin.flush()
        self.killed.update(indices)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None and proc.stdin is not None:
                try:
                    proc.stdin.write("quit\n")
                    proc.stdin.flush()
                except OSError:
                    pass
        terminate_all(self.procs, grace_s=5.0)
        if self._log is not None:
            self._log.close()
