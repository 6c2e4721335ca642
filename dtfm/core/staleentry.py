"""The dtfm transport's "the peer table is stale" failure, written by a worker and read by the
coordinator (issue 41): one module, so the words one side writes are the words the other
parses.

A worker that dials rank W at the address the peer table gives for it, and is answered (with
the epoch's key) by rank A instead, fails: its own connection is fine, rank W's entry is
wrong. Rank W's agent advertised an address another agent holds (a false `--data-port` or
`AgentInfo.data_port`). The worker that saw it is not at fault, so the coordinator blames
rank W (coordinator/job/rootcause.py), never the reporter. Pure Python.
"""

from __future__ import annotations

import re

PHRASE = "the peer table is stale"
_RE = re.compile(r"answered as rank (\d+), not rank (\d+): " + re.escape(PHRASE))


class StaleEntry(ConnectionError):
    """Rank `wanted`'s entry in the peer table (`address`) is answered by rank `answered`."""

    def __init__(self, address: str, answered: int, wanted: int) -> None:
        self.address, self.answered, self.wanted = address, answered, wanted
        super().__init__(message(address, answered, wanted))


def message(address: str, answered: int, wanted: int) -> str:
    return (f"{address} answered as rank {answered}, not rank {wanted}: {PHRASE} (rank "
            f"{wanted}'s agent advertises an address another agent holds)")


def ranks(text: str) -> tuple[int, int] | None:
    """(the rank whose entry was wrong, the rank that answered at it) named in a worker's
    error `text`; None when it names no stale entry."""
    found = _RE.search(text)
    return (int(found.group(2)), int(found.group(1))) if found else None
