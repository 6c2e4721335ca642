"""Which failure explains the others: the one order every launcher and the coordinator use.

When one worker fails, its pipeline and data-parallel neighbours fail a moment later with a
`peer` error ("Connection closed by peer"), or a `rendezvous` error when the world never
formed. Whoever is heard first is an accident of timing; acting on it hid the real cause (a
worker that refused its own input showed as its neighbour's gloo error). So failures are
ranked, most telling first:

- `config`: the worker refused its own input; retrying the same assignment fails the same way;
- `lost`: an agent stopped answering (only the coordinator sees this one);
- `internal`: the worker's own failure that is none of the others (a bug, an unknown kind);
- `tampered`: a frame failed its per-pair MAC on its way through a relay, which the report
  names (dtfm/net/framemac.py): acted on at once (the relay's own failure explains nothing of
  it), the relay is used no more (coordinator/links/relaytrust.py);
- `bad_value`: a peer sent a value no honest worker computes (a negative squared gradient
  norm), and the worker that received it names the sender: more telling than the sender's
  own `peer` error when it fell over next, less than the sender's `config` error where it
  diverged itself (it is held for the others' reports as `peer` is);
- `rendezvous`, `peer`: failures that another's failure usually explains.

The kinds are the worker's `ErrorEvent.kind` (agent/worker/errors.py). Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

CONFIG, LOST, INTERNAL, RENDEZVOUS, PEER = "config", "lost", "internal", "rendezvous", "peer"
BAD_VALUE = "bad_value"
TAMPERED = "tampered"
CAUSES = (CONFIG, LOST, INTERNAL, TAMPERED, BAD_VALUE, RENDEZVOUS, PEER)  # most telling first
EXPLAINED_BY_OTHERS = (BAD_VALUE, RENDEZVOUS, PEER)

T = TypeVar("T")


def rank(kind: str) -> int:
    """Lower is more telling; an unknown kind (or "") ranks with `internal`."""
    return CAUSES.index(kind) if kind in CAUSES else CAUSES.index(INTERNAL)


def outranks(kind: str, current: str) -> bool:
    """Whether a failure of `kind` should replace the `current` one."""
    return rank(kind) < rank(current)


def most_telling(failures: Iterable[T], kind: Callable[[T], str]) -> T:
    """The failure to report among several: the most telling kind, the earliest listed among
    equals (callers list them in the order that breaks ties, e.g. rank order)."""
    items = list(failures)
    if not items:
        raise ValueError("most_telling needs at least one failure")
    return min(items, key=lambda f: rank(kind(f)))
