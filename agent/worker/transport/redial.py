"""When a direct data-plane connection that died before its first frame is dialled again, and
how long each try may take (issue 40).

A dialled connection can die between the TCP connect and its first frame without either
worker being gone:

- the listener's worker has not claimed its epoch at its agent yet (still importing torch,
  fetching a checkpoint): the agent's front parks the connection (dtfm/net/handoff.py), and a
  dialer whose handshake gives up first leaves the listener a dead connection ("dropped a
  connection before reading any frame: peer closed the connection mid-message") while it
  failed its own receives ("receive from rank 6 failed: timed out", 10 s after the dial);
- the agent has not been told of the epoch yet and closes the hello at once, or its parking
  bounds close it;
- the handshake completes at one end and not the other (the last proof lost or late), so the
  other end closes a connection its peer already counts as up.

None of these says the peer is gone, so the dialer dials again until the receive's deadline
(the mesh's `TransportConfig.timeout`, which is the worker's ceiling on any wait): a short
backoff between tries (`FIRST_BACKOFF_S`, doubling to `MAX_BACKOFF_S`), and a handshake that
may take longer at each try (`FIRST_HANDSHAKE_S`, doubling to `MAX_HANDSHAKE_S`) so a slow
listener on a loaded machine gets its time without a dead one holding a try for long. What
is never redialled: a peer that failed the job-key proof or answered as another rank (a
verdict, not an accident). The listener takes the new connection in place of the dead one
(`peer.Peer.attach`), and where frames had crossed it the two ends resume (`resume.py`).
Each redial is logged with the pair and the reason.
"""

from __future__ import annotations

import logging
import time

from dtfm.core.staleentry import StaleEntry
from dtfm.net import dataplane as dp

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0
FIRST_HANDSHAKE_S = 10.0  # a live listener answers in milliseconds; 10 s covers a busy one
MAX_HANDSHAKE_S = 60.0  # the agent's hand-off parks a connection 60 s for a starting worker


def retryable(exc: BaseException) -> bool:
    """Whether a connection that failed with `exc` before its first frame may be dialled
    again: it was closed, reset or timed out, not refused by a verdict of the peer."""
    return isinstance(exc, OSError) and not isinstance(exc, dp.AuthError | StaleEntry)


class Attempts:
    """The tries at one pair's direct connection, until `deadline_s` from now."""

    def __init__(self, me: int, peer: int, addr: str, deadline_s: float) -> None:
        self.me, self.peer, self.addr = me, peer, addr
        self.end = time.monotonic() + deadline_s
        self.tries = 0
        self._backoff = FIRST_BACKOFF_S

    def left(self) -> float:
        return self.end - time.monotonic()

    def handshake_timeout(self) -> float:
        """How long this try's handshake may take: longer each try, never past the end."""
        grown = min(FIRST_HANDSHAKE_S * 2 ** self.tries, MAX_HANDSHAKE_S)
        return max(0.1, min(grown, self.left()))

    def again(self, exc: BaseException) -> bool:
        """After a try that failed with `exc`: log it and back off, True to dial again; False
        when `exc` is final or the deadline has passed (the caller raises)."""
        self.tries += 1
        if not retryable(exc) or self.left() <= self._backoff:
            return False
        log.warning("rank %d: the connection to rank %d at %s died before its first frame "
                    "(try %d: %s); dialling again in %.2g s, until %.0f s from now", self.me,
                    self.peer, self.addr, self.tries, exc or type(exc).__name__,
                    self._backoff, self.left())
        time.sleep(self._backoff)
        self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)
        return True
