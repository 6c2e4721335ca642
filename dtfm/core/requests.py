"""What the agent asks of a worker that is already training: a file the agent replaces.

The assignment is fixed when a worker starts and its progress flows one way, worker to agent
(`dtfm.core.events`). A re-plan that decided to move wants one thing more from the running
workers: a checkpoint at a step it names (`CheckpointCommand`), so that the move need not
wait for the next `--checkpoint-every`. The agent writes the step into the worker's requests
file (`WorkerFiles.requests`, replaced atomically, so a reader sees one whole line); a
worker that checkpoints at all looks after each step not already due for one, with one
`stat`, and reads only when the file changed.

Every rank of the epoch gets the same step, and a rank writes only when it learns of it by
the end of that very step (never later, at another step than its peers): a late rank writes
nothing extra, its report (`checkpoint_step`) says so, and the move waits for the regular
checkpoint instead. No torch here.
"""

from __future__ import annotations

import os
from pathlib import Path

from dtfm.core.files import write_private


def ask_checkpoint(path: Path, step: int) -> None:
    """Ask the worker whose requests file is `path` for a checkpoint after step `step`."""
    write_private(path, f"{int(step)}\n".encode())


class CheckpointRequests:
    """The worker's side: the step the agent last asked a checkpoint after (0: none)."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self._seen: tuple[int, int] | None = None  # (inode, mtime_ns) last read
        self._step = 0

    def step(self) -> int:
        if self.path is None:
            return 0
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return self._step
        key = (st.st_ino, st.st_mtime_ns)
        if key != self._seen:
            self._seen = key
            try:
                self._step = int(self.path.read_text().strip() or 0)
            except (OSError, ValueError):  # not ours to fail a step over: ask again
                self._seen = None
        return self._step
