"""The agent's state directory is private: directories 0700, files 0600.

It holds the agent's id, every assignment (with the rendezvous address and the training
config) and the worker logs; other users of the machine have no business reading them. The
modes are set explicitly, whatever the process umask (systemd units add `UMask=0077` for what
the worker writes itself).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600


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


def write_private(path: Path, data: bytes) -> None:
    """Replace `path` atomically with `data`, readable by this user only."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), FILE_MODE)  # an old tmp file may have had another mode
        f.write(data)
    os.replace(tmp, path)


def open_private_append(path: Path) -> BinaryIO:
    """`path` opened for appending, created 0600 (an existing file is made 0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    return os.fdopen(fd, "ab")
