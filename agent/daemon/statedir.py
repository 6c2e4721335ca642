"""The agent's state directory is private: directories 0700, files 0600.

It holds the agent's id, every assignment (with the rendezvous address and the training
config), the worker logs and, unless the job names a `--checkpoint-dir`, the workers'
checkpoints (`checkpoint_dir`); other users of the machine have no business reading them. The
modes are set explicitly, whatever the process umask (systemd units add `UMask=0077` for what
the worker writes itself).

Layout: `agent-id`, `agent-secret`, `work/` (assignments, progress, logs) and
`checkpoints/<job id>/stage-<S>/` (`checkpoint_dir`).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)

DIR_MODE = 0o700
CHECKPOINT_DIR = "checkpoints"


def checkpoint_dir(state_dir: str | Path) -> Path:
    """Where this agent's workers checkpoint when the job names no `--checkpoint-dir`.

    Checkpoints are on by default so that a worker that crashes, or a job that is
    rescheduled onto the same agents, resumes instead of starting over; the state
    directory is the one place every agent is sure to own. The supervisor passes it to the
    worker as `DTFM_AGENT_CHECKPOINT_DIR`.
    """
    return Path(state_dir) / CHECKPOINT_DIR


def private_dir(path: Path) -> Path:
    """Create `path` (and parents) and make it 0700 if this process owns it."""
    path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    st = path.stat()
    if stat.S_IMODE(st.st_mode) & 0o077:
        if st.st_uid == os.geteuid():
            path.chmod(DIR_MODE)
        else:
            log.warning("state directory %s is open to other users (mode %04o) and not ours "
                        "to change: make it 0700", path, stat.S_IMODE(st.st_mode))
    return path

