"""Log lines a peer can cause, at a bounded rate (issue 41).

A daemon logs each connection it refuses, so an operator can see who knocks; but anyone who
can reach the port can then write to the log as fast as they can open connections. A
`RateLog` writes at most one line per kind of event every `every_s` seconds and holds the
rest back, counted: the next line of that kind says how many it stood for. The counters a
daemon keeps (refused, evicted...) still count every event; only the log is thinned.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RateLog:
    """At most one line per kind every `every_s` seconds on `logger`; the rest are counted."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.every_s, self.clock = logger, every_s, clock
        self._last: dict[str, float] = {}  # kind -> when its last line was written
        self._held: dict[str, int] = {}  # kind -> lines held back since

    def log(self, level: int, kind: str, msg: str, *args: object) -> bool:
        """Write `msg % args` unless a line of `kind` was written within `every_s`; whether
        it was written."""
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.every_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return False
        held = self._held.pop(kind, 0)
        self._last[kind] = now
        if held and last is not None:
            msg += f" (and {held} more like it in the last {now - last:.0f} s)"
        self.logger.log(level, msg, *args)
        return True

    def warning(self, kind: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, kind, msg, *args)
