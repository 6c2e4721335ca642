"""What a worker reports doing: `dtfm.v1.WorkerState`, one schema for every reader."""

from __future__ import annotations

import enum


class WorkerState(enum.StrEnum):
    """What an agent's worker is doing, as the agent reports it to the coordinator.

    One schema for producer and consumers (supervisor, heartbeat, registry, job, status,
    metrics), so a misspelt state is an AttributeError here instead of a report nobody reads.
    A StrEnum, so logs, `coordinator status` and metric labels keep printing the lowercase
    names the wire's free-text field used to carry. `to_wire`/`from_wire` map it to the
    wire's enum by name (a test pins that the two list the same states), so no module
    hard-codes the other's numbers.
    """

    IDLE = "idle"  # no worker, and the agent is not measuring
    MEASURING = "measuring"  # no worker; the agent measures its links (a session state)
    STARTING = "starting"  # worker spawned, no step finished yet
    TRAINING = "training"
    DONE = "done"  # finished every step and exited cleanly
    FAILED = "failed"  # see the report's error and error_kind
    STOPPED = "stopped"  # being stopped (a stop command, a new assignment, shutdown)

    def to_wire(self) -> int:
        """This state's `dtfm.v1.WorkerState` number."""
        from protos.dtfm.v1 import common_pb2

        return int(common_pb2.WorkerState.Value(f"WORKER_STATE_{self.name}"))

    @classmethod
    def from_wire(cls, value: int) -> WorkerState:
        """The state a `dtfm.v1.WorkerState` number names; unset (UNSPECIFIED) reads as idle.

        Raises ValueError for a number the wire enum does not define (a newer or broken
        peer): validate a report before reading its state.
        """
        from protos.dtfm.v1 import common_pb2

        if value == common_pb2.WORKER_STATE_UNSPECIFIED:
            return cls.IDLE
        return cls[common_pb2.WorkerState.Name(value).removeprefix("WORKER_STATE_")]

    @classmethod
    def label(cls, value: int) -> str:
        """The lowercase name people and scripts see for a wire number, never raising: a
        status printer may talk to a newer peer whose states this one does not know."""
        try:
            return cls.from_wire(value).value
        except ValueError:
            return f"unknown ({value})"
