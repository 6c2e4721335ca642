"""The bound on data-plane connections an agent holds for a worker that has not claimed them
yet (issue 41: 1,100 parked hellos used up every file descriptor of an agent).

A peer may dial this agent's port before the worker of their epoch has started; the agent's
hand-off (dtfm/net/handoff.py) keeps such a connection here until the worker claims the
epoch, its wait ends, or its dialer gives up. Nothing is proven before the worker's
handshake, so this lot is what a stranger can make the agent hold open, and it is bounded:

- at most `per_source` connections per source: an IPv4 address, or an IPv6 /64 (one host
  may hold a whole /64, so counting its addresses one by one would bound nothing). Peers
  behind one NAT share an address, so the bound is far above what honest ranks there dial
  in an epoch (one connection per pair, and a redial after a failure);
- at most `total` in all.

Which connection goes when a bound is hit:

- over `per_source`, that source's *oldest*: an honest source's oldest connection is the one
  most likely abandoned already (its dialer timed out and dialled again), and a source that
  floods only ever pushes out its own connections;
- over `total`, the oldest of the source that holds the *most* (the newcomer's own source
  included). Evicting the oldest overall would let anyone with many addresses flush every
  honest peer's waiting connection; refusing the newcomer would let whoever filled the lot
  first keep everyone else out for a whole wait. Taking from the largest holder leaves an
  honest peer with one or two waiting connections alone until the lot is spread over as many
  sources as it has places.

A connection whose dialer has gone (the kernel saw its FIN or RST: the TCP state is no longer
ESTABLISHED) is found by `gone` and freed at once rather than at the end of its wait, so a
departed attacker's connections do not keep their places.
"""

from __future__ import annotations

import socket
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dtfm.net.frontlimits import source_of as source_by_host

Epoch = tuple[bytes, int]  # (job digest, epoch)
_TCP_ESTABLISHED = 1  # tcp_info.tcpi_state (linux/tcp_states.h)


def source_of(sock: socket.socket) -> str:
    """The source a connection counts against: its peer's address, as the front counts it
    (`dtfm.net.frontlimits.source_of`)."""
    try:
        return source_by_host(sock.getpeername()[0])
    except (OSError, IndexError, TypeError):
        return "unknown"


def peer_gone(sock: socket.socket) -> bool:
    """Whether the peer of TCP `sock` has closed or reset it (False when unknown)."""
    try:
        state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
    except OSError:
        return False
    return state != _TCP_ESTABLISHED


@dataclass(eq=False)  # one entry per socket: identity is equality
class Parked:
    """One connection waiting for its epoch's worker."""

    sock: socket.socket
    epoch: Epoch
    source: str
    arrived: float  # monotonic seconds
    deadline: float  # closed then, unless claimed first


class Parking:
    """Connections waiting for their epoch's worker, oldest first, within the bounds above.

    It closes nothing itself: each call returns the entries it let go of, and the caller
    closes, counts and logs them."""

    def __init__(self, total: int = 256, per_source: int = 32) -> None:
        if total < 1 or per_source < 1:
            raise ValueError(f"parking bounds must be positive: total {total}, "
                             f"per source {per_source}")
        self.total, self.per_source = total, per_source
        self._lot: list[Parked] = []  # in arrival order
        self._by_source: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._lot)

    def __iter__(self) -> Iterator[Parked]:
        return iter(list(self._lot))

    def held_by(self, source: str) -> int:
        return self._by_source[source]

    def add(self, entry: Parked) -> list[Parked]:
        """Park `entry`; the entries evicted to keep the bounds (possibly none)."""
        self._lot.append(entry)
        self._by_source[entry.source] += 1
        evicted: list[Parked] = []
        if self._by_source[entry.source] > self.per_source:
            evicted.append(self._remove_oldest_of(entry.source))
        if len(self._lot) > self.total:
            # Counter.most_common keeps first-seen order among equals: the longest-standing
            largest = self._by_source.most_common(1)[0][0]
            evicted.append(self._remove_oldest_of(largest))
        return evicted

    def take(self, keep: Callable[[Parked], bool]) -> list[Parked]:
        """Remove and return every entry for which `keep(entry)` is false."""
        out = [p for p in self._lot if not keep(p)]
        for p in out:
            self.remove(p)
        return out

    def expired(self, now: float) -> list[Parked]:
        """Remove and return the entries whose wait ended by `now`."""
        return self.take(lambda p: p.deadline > now)

    def gone(self) -> list[Parked]:
        """Remove and return the entries whose dialer has closed or reset its connection."""
        return self.take(lambda p: not peer_gone(p.sock))

    def _remove_oldest_of(self, source: str) -> Parked:
        oldest = next(p for p in self._lot if p.source == source)
        self.remove(oldest)
        return oldest

    def remove(self, entry: Parked) -> None:
        """Let `entry` go (it was handed on)."""
        self._lot.remove(entry)
        self._by_source[entry.source] -= 1
        if not self._by_source[entry.source]:
            del self._by_source[entry.source]
