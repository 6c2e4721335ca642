"""The job's record of its recoveries, and the rules for when a recovery may shrink or grow it.

Kept apart from the state machine (`coordinator/job/machine.py`) because status, metrics and the
coordinator's state directory all read the same record: when, why, the layout before and
after, the steps lost and the seconds stalled.
"""

from __future__ import annotations

import time
from typing import Any

from google.protobuf import json_format

from protos.dtfm.v1 import coordinator_pb2


def layout_text(stages: int, replicas: int) -> str:
    return f"{stages}x{replicas}" if stages else ""


class Recoveries:
    """Every recovery, oldest first; the newest stays open until the next epoch trains."""

    def __init__(self, saved: list[dict[str, Any]] | None = None) -> None:
        self.items: list[coordinator_pb2.Recovery] = [
            json_format.ParseDict(d, coordinator_pb2.Recovery()) for d in saved or []]
        # A coordinator restarted in mid-recovery (its state directory holds a newest record
        # whose epoch never trained: `trained` sets stalled_s > 0) finishes that record when
        # the new epoch trains, instead of leaving it at resumed 0, lost 0, stalled 0.
        last = self.items[-1] if self.items else None
        self._open: coordinator_pb2.Recovery | None = (
            last if last is not None and last.stalled_s <= 0 else None)

    def begin(self, reason: str, layout_before: str, last_step: int,
              planned: bool = False) -> None:
        rec = coordinator_pb2.Recovery(at_unix_s=time.time(), reason=reason[:500],
                                       layout_before=layout_before, last_step=last_step,
                                       planned=planned)
        self.items.append(rec)
        self._open = rec

    def explain(self, reason: str) -> None:
        """The open recovery's cause, found after it began (an agent lost whose loss made the
        errors it began on: `coordinator/rootcause.py`); a planned one keeps its reason."""
        if self._open is not None and not self._open.planned:
            self._open.reason = reason[:500]

    def placed(self, layout_after: str) -> None:
        if self._open is not None:
            self._open.layout_after = layout_after

    def trained(self, first_step: int) -> None:
        """The new epoch reported its first step: it resumed after `first_step - 1` (the job
        passes the worker's own resumed step + 1 when the heartbeat carries it)."""
        rec, self._open = self._open, None
        if rec is None:
            return
        rec.resumed_step = max(first_step - 1, 0)
        rec.steps_lost = max(rec.last_step - rec.resumed_step, 0)
        rec.stalled_s = max(time.time() - rec.at_unix_s, 0.0)

    @property
    def pending(self) -> bool:
        return self._open is not None

    def to_json(self) -> list[dict[str, Any]]:
        return [json_format.MessageToDict(r, preserving_proto_field_name=True)
                for r in self.items]


def out_of_restarts(failure: str, budget: int) -> str:
    """The job's failure once `failure` needs a restart beyond `--max-restarts` `budget`."""
    if budget == 0:
        return (f"{failure}; not restarted: --max-restarts is 0 (raise it to let the job "
                f"reschedule)")
    return (f"{failure}; gave up after {budget} restart{'s' if budget > 1 else ''} in a row "
            f"without a new checkpoint (--max-restarts {budget}: raise it, or find what keeps "
            f"failing)")


def permanent_failure(failure: str, kind: str, steps: int, last: tuple[str, int]) -> str:
    """Why `failure` will repeat the same way on every retry ('' when a retry may help).

    A rejected assignment or configuration fails identically every time; workers that
    cannot join their world in two epochs running, without training a step in either,
    point at addresses or ports that a retry will not fix (a lost agent would have been
    reported as lost instead). `kind`: the failure's kind (the worker's `error_kind`);
    `steps`: the newest step the epoch trained; `last`: (kind, steps) of the epoch before."""
    if kind == "config":
        return (f"{failure} (the job's configuration is invalid and would fail the same "
                f"way again: fix it and restart the coordinator)")
    if kind == "rendezvous" and steps == 0 and last == ("rendezvous", 0):
        return (f"{failure} (workers could not join their world twice in a row: check that "
                f"every agent's --advertise address is reachable from the others, that TCP "
                f"ports 29500-30499 are open between them, or set the "
                f"agents' --bind-interface)")
    return ""
