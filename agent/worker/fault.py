"""The worker's fault-injection seam (`DTFM_FAULT`), which tests use to fail a rank on cue.

"RANK:STEP[:MODE[:EPOCH]]": that rank misbehaves from step STEP (1-based), in epoch EPOCH
only where given (a job the coordinator recovers then goes on). RANK `*` is whatever rank the
worker gets: set on one agent's environment, it makes that agent's workers the bad ones,
wherever the coordinator places them (`coordinator demo --bad-peer`). Modes:

- `exit` (the default): the process ends before the step, with `FAULT_EXIT_CODE`;
- `hang`: it stops before the step, sockets open, as a frozen host does;
- `config`: it refuses its own input before the step (a `ValueError`, kind `config`);
- `corrupt`: from that step on, the values it sends in the per-step norm and loss exchange
  are multiplied by `CORRUPT_SCALE` (-4), as a bad peer's would be, while it keeps its own
  values: its honest peers must blame it (`globalnorm.py`), not their configuration;
- `direct`: before the step, where its path to rank RANK - 1 is direct (gloo or NCCL, or the
  dtfm peer table lets one of the two dial the other), it fails with that peer's error
  (`PeerError`: "receive from rank RANK - 1 failed"), as a pair a firewall cuts does; where the
  pair meets at a relay it trains on. So a test sees a recovery move the pair onto the relay
  (coordinator/job/failedpairs.py), whatever the epoch;
- bad-peer modes (`badpeer.py` holds their arithmetic), from step STEP on: `scale` (x10),
  `flip` (x-4), `noise` (+1 sigma), `zero`, `stale` (a copy of the step before STEP's) and
  `nan` (a NaN and an infinity) alter every data-parallel contribution the rank sends
  (`contributions`); `avg_scale`, `avg_flip`, `avg_noise`, `avg_zero`, `avg_stale` and
  `avg_nan` alter, the same way, the averaged shards it sends back as an owner in `sharded`
  mode (`contributions(averages=True)`, caught by the receivers: `avgcheck.py`, and for
  `nan` `nonfinite.py`); `drift` moves one of its own weights after the optimizer step of
  STEP (`drifts`); `act_scale`, `act_noise`, `act_zero`, `actgrad_*` and `act_lie` alter
  the pipeline messages it sends (`activations`; the coordinator's check of both ends of each
  link must name it: coordinator/integrity/linkwitness.py); `avg_one` sends its first
  receiver ten times the averaged shards it owns and steps with the honest mean
  (`equivocation`); `norm_lie` sends its pipeline 100x its squared gradient norm
  (`sent_scale`); `norm_forge` drifts as `drift` does and writes 100x its pipeline's next
  stage's squared norm of that step in its own norm table (`forges_norm`), blaming its
  partner for its weights. The replica checks
  (`replicacheck.py`) must name the rank (`coordinator demo --bad-peer` rehearses it).

Kept out of `train.py` (the main loop) so the seam's modes grow without growing it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from agent.worker.badpeer import (
    ACTIVATION_ATTACKS,
    AVERAGE_ATTACKS,
    CONTRIBUTION_ATTACKS,
    EQUIVOCATION_ATTACKS,
    FORGE_ATTACKS,
    NORM_ATTACKS,
    NORM_LIE_SCALE,
    WEIGHT_ATTACKS,
    Activations,
    Contributions,
    Equivocation,
)
from agent.worker.errors import PeerError
from dtfm.core.events import FAULT_EXIT_CODE
from dtfm.net.dataplane import may_dial

log = logging.getLogger(__name__)

ENV_FAULT = "DTFM_FAULT"
BAD_PEER_MODES = (*CONTRIBUTION_ATTACKS, *AVERAGE_ATTACKS, *WEIGHT_ATTACKS,
                  *ACTIVATION_ATTACKS, *EQUIVOCATION_ATTACKS, *NORM_ATTACKS)
MODES = ("exit", "hang", "config", "corrupt", "direct", *BAD_PEER_MODES)
CORRUPT_SCALE = -4.0
ANY_RANK = -1  # RANK `*`


@dataclass(frozen=True)
class Fault:
    """Where and how this job's one injected fault strikes."""

    rank: int  # ANY_RANK: every rank this process runs as
    step: int
    mode: str = "exit"
    epoch: int | None = None

    def _mine(self, rank: int) -> bool:
        return self.rank in (ANY_RANK, rank)

    @classmethod
    def from_env(cls) -> Fault | None:
        raw = os.environ.get(ENV_FAULT, "")
        if not raw:
            return None
        parts = raw.split(":")
        mode = parts[2] if len(parts) > 2 else "exit"
        if mode not in MODES:
            raise ValueError(f"{ENV_FAULT}={raw!r}: mode must be one of {', '.join(MODES)}")
        rank = ANY_RANK if parts[0] == "*" else int(parts[0])
        if mode == "direct" and rank < 1:
            raise ValueError(f"{ENV_FAULT}={raw!r}: mode direct cuts rank RANK's path to rank "
                             f"RANK - 1, so RANK must be 1 or more")
        return cls(rank, int(parts[1]), mode,
                   int(parts[3]) if len(parts) > 3 else None)

    def maybe_fire(self, rank: int, step: int, epoch: int = 0, assignment: Any = None) -> None:
        """Strike before `step` if this is the rank, step and epoch (`corrupt`: see
        `sent_scale`; `direct`: only where `assignment` gives the pair a direct path)."""
        if not self._mine(rank) or step != self.step or self.epoch not in (None, epoch):
            return
        if self.mode == "direct":
            peer = rank - 1
            if assignment is None or not direct_path(assignment, peer):
                return
            log.error("fault injection: rank %d's direct path to rank %d drops", rank, peer)
            raise PeerError(f"receive from rank {peer} failed: fault injection: the direct "
                            f"path between ranks {peer} and {rank} drops")
        log.error("fault injection: rank %d %ss before step %d", rank, self.mode, step)
        if self.mode == "corrupt" or self.mode in BAD_PEER_MODES:
            return
        if self.mode == "hang":
            while True:
                time.sleep(3600)
        if self.mode == "config":  # fails as a worker that refuses its own input does
            raise ValueError(f"fault injection: rank {rank} refuses its input before step {step}")
        os._exit(FAULT_EXIT_CODE)

    def sent_scale(self, rank: int, step: int, epoch: int = 0) -> tuple[float, float]:
        """What this rank's exchanged (squared norm, loss) are multiplied by on the wire at
        `step`: (1, 1) unless it is a `corrupt` rank (both) or a `norm_lie` one (the
        squared norm) at or after its step."""
        if not (self._mine(rank) and step >= self.step and self.epoch in (None, epoch)):
            return 1.0, 1.0
        if self.mode == "corrupt":
            return CORRUPT_SCALE, CORRUPT_SCALE
        return (NORM_LIE_SCALE, 1.0) if self.mode in NORM_ATTACKS else (1.0, 1.0)


    def contributions(self, rank: int, epoch: int = 0, *,
                      averages: bool = False) -> Contributions | None:
        """This rank's attack on its data-parallel contributions (a bad-peer mode), or with
        `averages` on the averaged shards it sends back as an owner (`avg_` modes), else
        None."""
        modes = AVERAGE_ATTACKS if averages else CONTRIBUTION_ATTACKS
        if self.mode in modes and self._mine(rank) and self.epoch in (None, epoch):
            return Contributions(self.mode, self.step, seed=rank)
        return None

    def equivocation(self, rank: int, epoch: int = 0) -> Equivocation | None:
        """This rank's attack on the averaged shards it sends back as an owner, one receiver
        at a time (`avg_one`), or None."""
        if self.mode in EQUIVOCATION_ATTACKS and self._mine(rank) and self.epoch in (None, epoch):
            return Equivocation(self.step)
        return None

    def activations(self, rank: int, epoch: int = 0) -> Activations | None:
        """This rank's attack on the pipeline messages it sends (`act_*`, `actgrad_*`), or
        None."""
        if self.mode in ACTIVATION_ATTACKS and self._mine(rank) and self.epoch in (None, epoch):
            return Activations(self.mode, self.step, seed=rank)
        return None

    def drifts(self, rank: int, step: int, epoch: int = 0) -> bool:
        """Whether this rank's weights drift after the optimizer step of `step`."""
        return (self.mode in WEIGHT_ATTACKS and self._mine(rank) and step == self.step
                and self.epoch in (None, epoch))

    def forges_norm(self, rank: int, step: int, epoch: int = 0) -> bool:
        """Whether this rank writes another norm of its pipeline's next stage at `step` in
        its own norm table (`norm_forge`: the step it drifts at)."""
        return self.mode in FORGE_ATTACKS and self.drifts(rank, step, epoch)


def direct_path(assignment: Any, peer: int) -> bool:
    """Whether `assignment` gives its rank and `peer` a direct path: always on gloo or NCCL;
    on dtfm where the peer table lets one of the two dial the other (`may_dial`)."""
    if (assignment.backend or "gloo") != "dtfm":
        return True
    plane, me = assignment.data_plane, assignment.rank
    listening = {r for r, addr in enumerate(plane.listen) if addr}
    direct = {(d.dialer, d.listener) for d in plane.direct}
    return any(may_dial(x, y, listening, set(plane.limited), direct)
               for x, y in ((me, peer), (peer, me)))
