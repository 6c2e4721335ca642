"""What kind of failure ended a worker, so the coordinator can decide what to do about it.

The worker's `error` progress event carries `kind` and `phase`:

- `config`: the assignment or the local configuration is invalid (validation raised
  `ValueError`, a `--bind-interface` that names no interface, a data or checkpoint path that
  does not exist or cannot be read), or the checkpoint storage refused a write (a full disk
  or quota, a read-only file system: `StorageError`, or such an `OSError` anywhere in the
  chain of causes), or a step's loss or gradient norm is not finite (`NonFiniteLoss`: the
  starting weights hold NaN or inf, or training diverged; a retry resumes from the same
  checkpoint and data and diverges the same way). Retrying the same assignment fails the
  same way; the coordinator (or the operator) must change something.
- `rendezvous`: the worker could not join the world (`init_process_group`, the store, gloo's
  connectFullMesh, group creation, or a timeout while joining). Usually transient or a
  reachability problem of the rendezvous address.
- `peer`: a peer died or stopped answering during training (a pipeline receive or send, a
  data-parallel collective or the norm exchange failed, or timed out: `wait_all` bounds each
  wait by the adaptive deadline of `deadline.py`, and says how long it waited and why).
- `bad_value`: a peer sent a value no honest worker computes (`globalnorm.BadPeerValue`,
  naming the sender): a peer fault, retried, whose report names who is at fault.
- `tampered`: a frame from a peer failed its per-pair MAC on its way through a relay
  (dtfm/net/framemac.py): the message names the relay, the coordinator blames it. One that
  failed on a direct connection is the sender's doing: `bad_value`.
- `internal`: anything else (a bug), including arithmetic on a bad number that Python raises
  as a ValueError (`numeric_slip`: "math domain error"); a peer's impossible value is caught
  where it arrives (`bad_value`).

`phase` is `join` until the world and its groups exist, then `train`.

The event's `message` is `describe(exc)`: the exception and every cause chained to it. The
outermost exception alone often hides what happened: torch reports a checkpoint write that
hit a full disk as "enforce fail ... unexpected pos", with the `OSError` (ENOSPC) only in
`__context__`.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist

from agent.worker.deadline import Deadline
from dtfm.core import causes
from dtfm.net import framemac

CONFIG, RENDEZVOUS, PEER, INTERNAL = "config", "rendezvous", "peer", "internal"
BAD_VALUE, TAMPERED = causes.BAD_VALUE, causes.TAMPERED
JOIN, TRAIN = "join", "train"


# errnos of storage that refuses writes until an operator acts, and what to tell them
_STORAGE_ADVICE = {
    errno.ENOSPC: "the disk holding it is full: free space there, point --checkpoint-dir (or "
                  "the agent's --state-dir) at a larger disk, or turn checkpoints off with "
                  "--checkpoint-every 0",
    errno.EDQUOT: "this user's disk quota is used up: free space or raise the quota, point "
                  "--checkpoint-dir elsewhere, or turn checkpoints off with --checkpoint-every 0",
    errno.EROFS: "its file system is read-only: point --checkpoint-dir at a writable one",
    errno.EACCES: "this user may not write there: fix its permissions or point "
                  "--checkpoint-dir elsewhere",
    errno.EPERM: "this user may not write there: fix its permissions or point "
                 "--checkpoint-dir elsewhere",
}
_MAX_PART = 600  # characters of each cause in `describe`


class PeerError(RuntimeError):
    """A pipeline neighbour, data-parallel peer or pipeline peer failed or timed out."""

    kind = PEER  # `globalnorm.BadPeerValue`: BAD_VALUE, a peer fault that names the sender


class StorageError(RuntimeError):
    """Writing a checkpoint failed with an OSError; names the file, the cause and the fix."""

    def __init__(self, path: Path, cause: OSError) -> None:
        self.path, self.errno = path, cause.errno
        what = os.strerror(cause.errno) if cause.errno else str(cause)
        name = errno.errorcode.get(cause.errno or 0, "")
        advice = _STORAGE_ADVICE.get(cause.errno or 0, "check the checkpoint directory")
        super().__init__(f"cannot write checkpoint {path}: {what}"
                         + (f" ({name})" if name else "") + f"; {advice}")


class NonFiniteLoss(ValueError):
    """A step's loss or global gradient norm is NaN or infinite. Raised before the optimizer
    steps, so no checkpoint ever holds the non-finite update; a ValueError, hence kind
    `config`: the coordinator fails the job instead of retrying it forever."""

    def __init__(self, step: int, loss: float, grad_norm: float) -> None:
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        what = (f"the loss of step {step} is {loss}" if not math.isfinite(loss) else
                f"the gradient norm of step {step} is {grad_norm} (loss {loss:.4g})")
        super().__init__(
            f"{what}, not a finite number: stopped before the optimizer step. Either the "
            f"starting weights hold NaN or inf values (check the --init-from model, e.g. "
            f"with `agent generate`), or training diverged: lower --lr, raise "
            f"--warmup-steps, keep --grad-clip on, or train in --dtype fp32")


class CorruptCheckpoint(ValueError):
    """A checkpoint failed its manifest or checksum (or would not load after passing it)."""


def os_error_in(exc: BaseException) -> OSError | None:
    """The first OSError in `exc`'s chain (itself, its causes, the exceptions it was raised
    while handling), or None."""
    for e in _chain(exc):
        if isinstance(e, OSError) and not isinstance(e, StorageError):
            return e
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and all(e is not seen for seen in out) and len(out) < 8:
        out.append(e)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return out


def describe(exc: BaseException) -> str:
    """`Type: message` of `exc`, then `; caused by Type: message` for each exception chained
    to it (first line of each, clipped), so the root cause is never hidden behind the
    wrapper that reported it."""
    parts = [f"{type(exc).__name__}: {exc}"]
    for e in _chain(exc)[1:]:
        lines = str(e).strip().splitlines()
        text = lines[0] if lines else ""
        if len(text) > _MAX_PART:
            text = text[:_MAX_PART] + "..."
        part = f"{type(e).__name__}: {text}"
        if part not in parts:
            parts.append(part)
    return "; caused by ".join(parts)


def _storage_refused(exc: BaseException) -> bool:
    return any(isinstance(e, StorageError)
               or (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT,
                                                          errno.EROFS))
               for e in _chain(exc))


def classify(exc: BaseException, phase: str) -> str:
    """The `kind` of a failure raised in `phase` ("join" or "train")."""
    refused = next((r for e in _chain(exc) if (r := framemac.refusal(str(e)))), None)
    if refused is not None:  # a frame the pair's key does not vouch for
        return TAMPERED if refused.relay else BAD_VALUE
    if isinstance(exc, PeerError):
        return exc.kind
    if numeric_slip(exc):
        return INTERNAL
    if isinstance(exc, (ValueError, FileNotFoundError, NotADirectoryError, PermissionError)):
        return CONFIG
    if _storage_refused(exc):
        return CONFIG
    comm = isinstance(exc, (dist.DistError, TimeoutError, ConnectionError, socket.gaierror))
    comm |= isinstance(exc, RuntimeError) and _looks_like_comm(str(exc))
    if phase == JOIN and (comm or isinstance(exc, RuntimeError)):
        return RENDEZVOUS
    if phase == TRAIN and comm:
        return PEER
    return INTERNAL


# what Python's math and float conversions raise (as ValueError) on a number out of range
_NUMERIC_WORDS = ("math domain error", "cannot convert float nan", "cannot convert float inf")


def numeric_slip(exc: BaseException) -> bool:
    """Whether `exc` is arithmetic gone wrong on a bad number (the square root of a negative,
    NaN to an integer), which Python raises as a ValueError. The number was wrong, not the
    configuration: values from peers are checked where they arrive and blamed on the sender
    (`BAD_VALUE`); one that slips past is `internal` (retried), never `config`
    (which fails the job as one the user must fix)."""
    return type(exc) is ValueError and str(exc).lower().startswith(_NUMERIC_WORDS)


_COMM_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "socket", "peer", "store")


def _looks_like_comm(message: str) -> bool:
    low = message.lower()
    return any(word in low for word in _COMM_WORDS)


def exit_now(exc: PeerError, what: str, code: int = 1) -> NoReturn:
    """Log `exc` with its traceback and end the process at once, skipping interpreter exit.

    After a wait gave up, gloo may still hold the unfinished collective on its own thread:
    the process group's destructor, which runs at interpreter exit, joins that thread, which
    only returns when the group's own timeout (the ceiling, 300 s by default) passes. The
    neighbours of a frozen peer would thus detect it in seconds and then sit for minutes
    before exiting, and the job would recover no sooner. (Aborting the group does not
    interrupt gloo's in-flight work in torch 2.13: measured, the exit still took the group's
    full timeout.) The caller has written its error event already.
    """
    logging.getLogger("agent.worker").error("%s", what, exc_info=exc)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def wait_all(works: list[dist.Work], deadline: Deadline, what: str) -> None:
    """Wait for `works` together for at most the deadline's current value.

    A failure or a timeout is a `PeerError` that says `what` was under way, how long it
    waited and why that long (`deadline.Wait.why`): a timeout means a peer is alive enough to
    keep its sockets open but sends nothing (frozen, swapped out, or far slower than its
    recent steps); a failure before the limit means a peer died or closed its connection.
    The limit covers all of `works` at once, not each of them.
    """
    limit = deadline.current()
    t0 = time.monotonic()
    end = t0 + limit.seconds
    try:
        for w in works:
            # at least 1 ms: c10d reads a zero timeout as "wait forever"
            w.wait(timedelta(seconds=max(0.001, end - time.monotonic())))
            # a dtfm work that sat out its connection being made again: not the peer's pace
            end += getattr(w, "stalled_s", 0.0)
    except RuntimeError as e:
        waited = time.monotonic() - t0
        if waited >= 0.95 * limit.seconds:
            raise PeerError(f"{what}: no answer within {limit.seconds:.3g} s (limit {limit.why}"
                            f"); the peer is frozen, unreachable or far slower than its recent "
                            f"steps: {e}") from e
        raise PeerError(f"{what} failed after {waited:.3g} s (the peer died or closed its "
                        f"connection; limit {limit.seconds:.3g} s): {e}") from e
