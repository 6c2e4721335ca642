"""One progress line: redrawn in place on a terminal, a line now and then into a file.

A line redrawn with `\\r` for every update reads well on a terminal and badly in a file or a
pipe: written as a new line each time, a demo's 80 steps left about 100 near-identical lines
in its log. `ProgressLine` redraws on a terminal (at most every `tty_every_s`), and elsewhere
writes a line only for an event (the caller's `key` changed: a new state) or when `every_s`
has passed since the last one it wrote, then the last line on `finish`. Used by
`agent prepare`'s progress (agent/commands/prepare.py) and the demos' (coordinator/commands/demo.py,
demo_wan.py).
"""

from __future__ import annotations

import time
from typing import IO


class ProgressLine:
    """Progress lines on `out`: in place on a terminal, sparse into a file."""

    def __init__(self, out: IO[str], every_s: float = 10.0, tty_every_s: float = 0.0) -> None:
        self.out = out
        self.tty = hasattr(out, "isatty") and out.isatty()
        self.every_s = tty_every_s if self.tty else every_s
        self.last_at = -float("inf")
        self.key: object = None
        self.shown = ""  # the newest line written
        self.pending = ""  # the newest line given, written or not

    def show(self, line: str, key: object = None, now: float | None = None) -> bool:
        """Offer `line`; write it if `key` differs from the last one's or it is time. Returns
        whether it was written."""
        now = time.monotonic() if now is None else now
        self.pending = line
        if line == self.shown or (key == self.key and now - self.last_at < self.every_s):
            return False
        self.key, self.last_at = key, now
        self._write(line)
        return True

    def finish(self) -> None:
        """Write the newest line if it was held back, and end the line on a terminal."""
        if self.pending and self.pending != self.shown:
            self._write(self.pending)
        if self.tty and self.shown:
            self.out.write("\n")
            self.out.flush()
        self.shown = self.pending = ""

    def _write(self, line: str) -> None:
        self.shown = line
        self.out.write(f"\r{line}\033[K" if self.tty else line + "\n")
        self.out.flush()
