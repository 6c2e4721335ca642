"""The worker's fault-injection seam (`DTFM_FAULT`), which tests use to fail a rank on cue.

"RANK:STEP[:MODE[:EPOCH]]": that rank misbehaves from step STEP (1-based), in epoch EPOCH
only where given (a job the coordinator recovers then goes on). Modes:

- `exit` (the default): the process ends before the step, with `FAULT_EXIT_CODE`;
- `hang`: it stops before the step, sockets open, as a frozen host does;
- `config`: it refuses its own input before the step (a `ValueError`, kind `config`);
- `corrupt`: from that step on, the values it sends in the per-step norm and loss exchange
  are multiplied by `CORRUPT_SCALE` (-4), as a bad peer's would be, while it keeps its own
  values: its honest peers must blame it (`globalnorm.py`), not their configuration.

Kept out of `train.py` (the main loop) so the seam's modes grow without growing it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from dtfm.core.events import FAULT_EXIT_CODE

log = logging.getLogger(__name__)

ENV_FAULT = "DTFM_FAULT"
MODES = ("exit", "hang", "config", "corrupt")
CORRUPT_SCALE = -4.0


@dataclass(frozen=True)
class Fault:
    """Where and how this job's one injected fault strikes."""

    rank: int
    step: int
    mode: str = "exit"
    epoch: int | None = None

    @classmethod
    def from_env(cls) -> Fault | None:
        raw = os.environ.get(ENV_FAULT, "")
        if not raw:
            return None
        parts = raw.split(":")
        mode = parts[2] if len(parts) > 2 else "exit"
        if mode not in MODES:
            raise ValueError(f"{ENV_FAULT}={raw!r}: mode must be one of {', '.join(MODES)}")
        return cls(int(parts[0]), int(parts[1]), mode,
                   int(parts[3]) if len(parts) > 3 else None)

    def maybe_fire(self, rank: int, step: int, epoch: int = 0) -> None:
        """Strike before `step` if this is the rank, step and epoch (`corrupt`: see
        `sent_scale`)."""
        if rank != self.rank or step != self.step or self.epoch not in (None, epoch):
            return
        log.error("fault injection: rank %d %ss before step %d", rank, self.mode, step)
        if self.mode == "corrupt":
            return
        if self.mode == "hang":
            while True:
                time.sleep(3600)
        if self.mode == "config":  # fails as a worker that refuses its own input does
            raise ValueError(f"fault injection: rank {rank} refuses its input before step {step}")
        os._exit(FAULT_EXIT_CODE)

    def sent_scale(self, rank: int, step: int, epoch: int = 0) -> float:
        """What this rank's exchanged values are multiplied by on the wire at `step` (1.0
        unless it is a `corrupt` rank at or after its step)."""
        corrupt = (self.mode == "corrupt" and rank == self.rank and step >= self.step
                   and self.epoch in (None, epoch))
        return CORRUPT_SCALE if corrupt else 1.0
