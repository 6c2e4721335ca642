"""What kind of failure ended a worker, so the coordinator can decide what to do about it.

The worker's `error` progress event carries `kind` and `phase`:

- `config`: the assignment or the local configuration is invalid (validation raised
  `ValueError`, a `--bind-interface` that names no interface, a data or checkpoint path that
  does not exist or cannot be read). Retrying the same assignment fails the same way; the
  coordinator (or the operator) must change something.
- `rendezvous`: the worker could not join the world (`init_process_group`, the store, gloo's
  connectFullMesh, group creation, or a timeout while joining). Usually transient or a
  reachability problem of the rendezvous address.
- `peer`: a peer died or stopped answering during training (a pipeline receive or send, a
  data-parallel collective or the norm exchange failed or timed out).
- `internal`: anything else (a bug).

`phase` is `join` until the world and its groups exist, then `train`.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

CONFIG, RENDEZVOUS, PEER, INTERNAL = "config", "rendezvous", "peer", "internal"
JOIN, TRAIN = "join", "train"


class PeerError(RuntimeError):
    """A pipeline neighbour, data-parallel peer or pipeline peer failed or timed out."""


def classify(exc: BaseException, phase: str) -> str:
    """The `kind` of a failure raised in `phase` ("join" or "train")."""
    if isinstance(exc, PeerError):
        return PEER
    if isinstance(exc, (ValueError, FileNotFoundError, NotADirectoryError, PermissionError)):
        return CONFIG
    comm = isinstance(exc, (dist.DistError, TimeoutError, ConnectionError, socket.gaierror))
    comm |= isinstance(exc, RuntimeError) and _looks_like_comm(str(exc))
    if phase == JOIN and (comm or isinstance(exc, RuntimeError)):
        return RENDEZVOUS
    if phase == TRAIN and comm:
        return PEER
    return INTERNAL


_COMM_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "socket", "peer", "store")


def _looks_like_comm(message: str) -> bool:
    low = message.lower()
    return any(word in low for word in _COMM_WORDS)


def wait_all(works: list[dist.Work], timeout: timedelta, what: str) -> None:
    """Wait for `works`; a failure or timeout is a `PeerError` saying `what` was under way."""
    try:
        for w in works:
            w.wait(timeout)
    except RuntimeError as e:
        raise PeerError(f"{what} failed (timeout {timeout.total_seconds():g}s, or a peer "
                        f"died): {e}") from e
