"""`dtfm.core.workerstate.WorkerState` and the wire's `dtfm.v1.WorkerState` list the same states.

Conversions go by name, so a state added to one enum and not the other would only fail when
some agent first reports it; this pins the two together instead.
"""

from __future__ import annotations

import pytest

from dtfm.core.workerstate import WorkerState
from protos.dtfm.v1 import common_pb2


def test_every_state_has_one_wire_value_and_back() -> None:
    wire = {n.removeprefix("WORKER_STATE_") for n in common_pb2.WorkerState.keys()}
    assert wire - {"UNSPECIFIED"} == {s.name for s in WorkerState}
    for state in WorkerState:
        number = state.to_wire()
        assert common_pb2.WorkerState.Name(number) == f"WORKER_STATE_{state.name}"
        assert WorkerState.from_wire(number) is state
        assert state.value == state.name.lower()  # what status and metrics print
    assert len({s.to_wire() for s in WorkerState}) == len(WorkerState)


def test_unset_reads_as_idle_and_unknown_numbers_are_refused() -> None:
    assert WorkerState.from_wire(common_pb2.WORKER_STATE_UNSPECIFIED) is WorkerState.IDLE
    unknown = max(common_pb2.WorkerState.values()) + 1
    with pytest.raises(ValueError):
        WorkerState.from_wire(unknown)
    assert WorkerState.label(unknown) == f"unknown ({unknown})"
    assert WorkerState.label(common_pb2.WORKER_STATE_TRAINING) == "training"
