"""Files only this user may read: the agent's identity and secret, a worker's assignment.

One routine so the mode is right whatever the umask, and an old temp file of another mode
cannot leak the new contents.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

FILE_MODE = 0o600


def write_private(path: Path, data: bytes) -> None:
    """Replace `path` atomically with `data`, readable by this user only, whatever the umask."""
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
