"""The contract between a worker process and whoever launched it: progress events and env.

A worker (`python -m agent.worker`) reports by appending one JSON object per line to its
progress file: `{"event": "step", "step": 3, "loss": 5.1, ...}`. The worker writes these lines
with `encode_event` and every reader (the agent's supervisor, `agent local`, benchmarks) reads
them with `parse_event`, so the event names and their fields are written down once, here,
instead of as bare strings in each reader. The launcher passes a few settings to the worker
through the environment; their names (`WorkerEnv`) live here for the same reason: the worker
may import only `dtfm.core`, and `dtfm.launcher` sets what the worker reads.

The parser is tolerant on purpose: a progress file is tailed while it is written and may hold
a partial or corrupt line (a worker killed mid-write); a reader must keep following the job,
so a bad line is logged and skipped, never raised. Unknown fields are ignored and missing or
ill-typed ones take their defaults, so readers and workers of neighbouring versions still agree.
Pure Python: no torch, no grpc.
"""

from __future__ import annotations

import json
import logging
import math
import typing
from dataclasses import MISSING, asdict, dataclass, fields
from enum import StrEnum
from typing import Any, ClassVar

log = logging.getLogger(__name__)


class EventName(StrEnum):
    """The value of a progress line's `"event"` key."""

    STEP = "step"  # one optimizer step finished
    EVAL = "eval"  # a validation evaluation finished (--eval-every, and after the last step)
    DONE = "done"  # training and evaluation finished; the worker exits 0 next
    ERROR = "error"  # the worker failed; it exits non-zero next
    INTEGRITY = "integrity"  # a replica check failed (--verify): evidence against a peer


class WorkerEnv(StrEnum):
    """Environment variables the launcher sets and the worker reads."""

    SUPERVISOR_PID = "DTFM_SUPERVISOR_PID"  # die with this pid (PR_SET_PDEATHSIG)
    THREADS = "DTFM_NUM_THREADS"  # torch intra-op threads per worker
    TIMEOUT = "DTFM_TIMEOUT_S"  # seconds any collective or p2p receive may block
    BIND_INTERFACE = "DTFM_BIND_INTERFACE"  # the agent's --bind-interface
    # the agent's own checkpoint dir, used when the assignment names none (not the flag
    # --checkpoint-dir's DTFM_CHECKPOINT_DIR: that one may name shared storage)
    AGENT_CHECKPOINT_DIR = "DTFM_AGENT_CHECKPOINT_DIR"


# The exit status of a worker the fault-injection seam (`DTFM_FAULT`) killed: a launcher that
# sees several workers fail names this one, since the others died of losing it.
FAULT_EXIT_CODE = 17


NAN = math.nan


@dataclass(frozen=True)
class StepEvent:
    """One optimizer step of one rank. Times are seconds; NaN means "not reported"."""

    NAME: ClassVar[EventName] = EventName.STEP

    step: int = 0
    loss: float = NAN  # the global mean loss of the step (NaN if it diverged; local steps: below)
    tokens_per_s: float = 0.0
    total_steps: int = 0
    rank: int = -1
    stage: int = -1
    replica: int = -1
    lr: float = NAN
    grad_norm: float = NAN
    step_s: float = NAN  # the whole step; the next four split it
    compute_s: float = NAN
    pp_wait_s: float = NAN  # pipeline receive + send waits
    dp_s: float = NAN  # data-parallel averaging not hidden behind the backward pass
    sync_s: float = NAN  # the norm exchange along the pipeline
    recv_wait_s: float = NAN
    send_wait_s: float = NAN
    stored_peak: int = 0  # most activations a stage held at once
    pp_bytes: int = 0  # bytes this rank sent on its pipeline links in the step
    dp_bytes: int = 0  # bytes this rank sent to its data-parallel peers in the step
    codec_s: float = NAN  # compressing and decompressing messages (agent/worker/compress.py)
    resumed_step: int = -1  # the checkpoint step this run resumed after (0: none; -1: unknown)
    checkpoint_step: int = 0  # the newest step this run has checkpointed (0: none yet)
    # Local steps (--sync-every H > 1, agent/worker/outer.py): `loss` and `grad_norm` are then
    # this replica's, dp_* count only the sync point that ends each round of H steps.
    sync_every: int = 1
    sync_round: int = 0  # the round this step belongs to: 1 for steps 1..H
    drift: float = NAN  # at a sync point: the norm of this stage's pseudo-gradient, this replica
    param_checksum: float = NAN  # at a sync point: a sum of the synced parameters (replicas agree)
    # The timers `dtfm.core.breakdown.measured` needs to split the step into disjoint parts:
    pp_codec_s: float = NAN  # the pipeline's part of codec_s
    codec_hidden_s: float = NAN  # data-parallel codec work in backward's hooks (inside compute_s)
    outer_s: float = NAN  # local steps: the whole sync point (its dp_s inside); 0 off them
    # CPU seconds the step used, every thread of the worker's process: on a machine whose
    # cores several workers share, their sum over the cores bounds the step from below
    cpu_s: float = NAN
    # At a step that ends a window of pipeline-link figures (agent/worker/linkstats.py): the
    # median over the window of the root mean square of what this rank sent and received on
    # its pipeline links, activations forward and their gradients back (NaN: no such link,
    # or no window ends here), for the coordinator's check of both ends
    # (coordinator/integrity/linkwitness.py)
    link_act_out: float = NAN
    link_act_in: float = NAN
    link_grad_out: float = NAN
    link_grad_in: float = NAN
    # The step's replica checks (--verify, agent/worker/replicacheck.py): scoring copies,
    # checking and auditing averages, tallying pipeline links, and the weights digest with
    # its wait for the stage's replicas; inside the timers above, not a part of the split:
    # what the checks cost, read within one run (bench/integrity_world.py)
    verify_s: float = NAN
    # The newest step whose integrity records are all emitted (-1: this one's): a weights
    # digest judged a step after it was taken leaves the steps it covers open until then
    # (agent/daemon/supervisor.py, `evidence_through`)
    judged_through: int = -1


@dataclass(frozen=True)
class EvalEvent:
    """The validation loss of the weights after `step` (every rank: the last stage computes
    it and the ranks share it), every `--eval-every` steps and once after the last step (then
    also the DoneEvent's `val_loss`). A reader older than this event skips it."""

    NAME: ClassVar[EventName] = EventName.EVAL

    step: int = 0
    val_loss: float = NAN
    rank: int = -1


@dataclass(frozen=True)
class DoneEvent:
    """Training finished; `val_loss` is None when no evaluation ran. `step` is the step the
    weights are at (0: not reported): a run that resumed from the last step's checkpoint
    trains nothing and writes no step event, and without it would read as done at step 0."""

    NAME: ClassVar[EventName] = EventName.DONE

    val_loss: float | None = None
    rank: int = -1
    step: int = 0
    resumed_step: int = -1  # as in StepEvent


@dataclass(frozen=True)
class ErrorEvent:
    """The worker failed. `kind` says whether a retry can help (config, rendezvous, peer,
    internal; see agent/worker/errors.py) and `phase` where it failed (join, train).

    `step` is the step it was at: the one it was training (its last step event is the one
    before), or the one whose weights it was checkpointing or evaluating; 0 before its first.
    A peer or relay lost in a step's last exchange can let the peers finish that step and
    checkpoint it while this rank does not: the recovery resumes after it, and no run of this
    rank ever reports that step's loss (its peers' step events carry it)."""

    NAME: ClassVar[EventName] = EventName.ERROR

    message: str = ""
    rank: int = -1
    kind: str = "internal"
    phase: str = ""
    step: int = 0


def failed_at(step: int) -> str:
    """Where a worker whose error event holds `step` failed, for the log lines of the worker
    and its supervisor: "in step 6", or "before its first step"."""
    return f"in step {step}" if step > 0 else "before its first step"


@dataclass(frozen=True)
class IntegrityEvent:
    """A replica check (`agent/worker/replicacheck.py`) that failed at `step`: `kind` says
    which, `suspect_rank` whom it names (-1: undecided, R = 2), `score` its number, `rank`
    the reporting rank. Carried to the coordinator as `dtfm.v1.IntegrityEvidence`."""

    NAME: ClassVar[EventName] = EventName.INTEGRITY

    step: int = 0
    kind: str = ""
    suspect_rank: int = -1
    score: float = NAN
    detail: str = ""
    rank: int = -1


ProgressEvent = StepEvent | EvalEvent | DoneEvent | ErrorEvent | IntegrityEvent

_CLASSES: dict[EventName, type[ProgressEvent]] = {
    cls.NAME: cls for cls in (StepEvent, EvalEvent, DoneEvent, ErrorEvent, IntegrityEvent)
}
# field name -> (type, default) per class, resolved once: the parser's whole schema
_SCHEMA: dict[type, list[tuple[str, object, object]]] = {
    cls: [(f.name, typing.get_type_hints(cls)[f.name], f.default) for f in fields(cls)
          if f.default is not MISSING]
    for cls in _CLASSES.values()
}


def encode_event(event: ProgressEvent) -> str:
    """The one JSON line (no newline) a worker writes for `event`: `"event"` first."""
    return json.dumps({"event": event.NAME.value, **asdict(event)})


def parse_event(line: str | bytes) -> ProgressEvent | None:
    """The event on one progress line, or None for a blank, garbled or unknown line.

    Never raises: the caller is following a live job and must not die of one bad line.
    """
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
        log.warning("skipping a progress line that is not JSON: %.200r", line)
        return None
    if not isinstance(obj, dict):
        log.warning("skipping a progress line that is not an object: %.200r", line)
        return None
    try:
        name = EventName(obj.get("event"))
    except ValueError:
        # a newer worker's event: not an error, just nothing this reader understands
        log.debug("skipping progress event %.50r", obj.get("event"))
        return None
    cls = _CLASSES[name]
    values = {key: _coerce(obj.get(key), kind, default)
              for key, kind, default in _SCHEMA[cls]}
    return cls(**values)  # type: ignore[arg-type]


def _coerce(value: object, kind: object, default: object) -> Any:
    """`value` as `kind`, or `default` when it is missing or of the wrong type."""
    if value is None or isinstance(value, bool):
        return default
    if kind is int:
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return default
    if kind is float or kind == (float | None):
        return float(value) if isinstance(value, int | float) else default
    if kind is str:
        return value if isinstance(value, str) else str(value)
    return default
