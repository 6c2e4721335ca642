"""Checkpoint tracking: the newest step every member has a checkpoint of, the layer split
those checkpoints hold, and the oldest step an agent must keep for a mirror.

The job's state machine (`coordinator/job/machine.py`) hands it the members' reports as its
follow loop turns (`note`); a fresh checkpoint is what refills the restart budget and where a
grow-back or a re-plan's move may stop the members.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

from coordinator.daemon.config import JobConfig
from dtfm.core.assignment import mirror_stages
from dtfm.core.layout import Layout
from dtfm.core.rounds import newest_checkpoint
from dtfm.core.spec import TrainConfig
from dtfm.core.workerstate import WorkerState
from protos.dtfm.v1 import coordinator_pb2

log = logging.getLogger(__name__)


class CheckpointTracker:
    """What the members' checkpoints hold."""

    def __init__(self, config: JobConfig) -> None:
        self.config = config
        self.job_id = ""  # for the log; the job sets it
        self.step = 0  # the newest step every member has passed a checkpoint at
        # the split the newest checkpoint holds, and this epoch's: they differ after the job
        # re-planned on another stage count, until this epoch writes a checkpoint of its own
        self.trained_splits: list[int] | None = None
        self.epoch_splits: list[int] = []

    def floor(self, running: bool, train: TrainConfig, layout: Layout | None,
              grid: list[list[str]],
              progress: Mapping[str, coordinator_pb2.ProgressReport]) -> int:
        """The oldest checkpoint step every agent must keep (0: no floor, `write_floor`).

        Only a layout of one-replica stages has mirrors (`mirror_stages`). Losing a stage's
        agent leaves its mirror's newest step as the newest that stage has, so the recovery
        resumes there, and every other stage must still hold it. Before a mirror has reported
        a copy, the floor is 1: keep everything (up to MAX_HELD), since whatever it copies
        first must stay matched."""
        mirrors = mirror_stages(layout) if layout else {}
        if (train.checkpoint_dir or train.checkpoint_every <= 0 or not mirrors
                or not running):
            return 0
        held = []
        for stage, by in mirrors.items():
            report = progress.get(grid[by][0])
            held.append(report.mirrored_steps.get(stage, 0) if report else 0)
        return max(1, min(held))

    def note(self, members: list[str], progress: Mapping[str, coordinator_pb2.ProgressReport],
             first_steps: Mapping[str, int], sync_every: int) -> tuple[bool, bool]:
        """(changed, fresh): whether what the checkpoints hold changed (the job saves its
        state then), and whether every member has just passed a new checkpoint step this
        epoch wrote. Progress refills the restart budget: faults days apart on a long job are
        not a failing job."""
        every = self.config.train.checkpoint_every
        if every <= 0 or not members:
            return False, False
        steps = [p.step for a in members if (p := progress.get(a)) is not None]
        if len(steps) < len(members) or min(steps) < 1:
            return False, False
        # a worker reports step s before it has written s's checkpoint; s + 1 proves it
        passed = newest_checkpoint(min(steps) - 1, every, sync_every or 1)
        # and a requested one (the re-plan's, `dtfm.core.requests`) once every member wrote it
        passed = max(passed, min(progress[a].checkpoint_step for a in members))
        done = all(WorkerState.from_wire(progress[a].worker_state) is WorkerState.DONE
                   for a in members)
        if done:
            passed = min(steps)  # the final checkpoint is written before a worker says done
        resplit = self._note_split(passed, first_steps)
        if passed <= self.step:
            return resplit, False
        self.step = passed
        # one this epoch wrote (not the one it resumed from) is progress
        fresh = passed >= max(first_steps.values(), default=passed)
        return True, fresh

    def _note_split(self, passed: int, first_steps: Mapping[str, int]) -> bool:
        """Once every member has passed a checkpoint this epoch wrote (even one that rewrote
        an older step), the checkpoints hold this epoch's layer split: the next epoch re-cuts
        from it, not from the one this epoch resumed from."""
        wrote = passed > 0 and passed >= max(first_steps.values(), default=math.inf)
        if not wrote or not self.epoch_splits or self.trained_splits in (None,
                                                                          self.epoch_splits):
            return False
        log.info("job %s: the checkpoint of step %d holds layers %s per stage (was %s)",
                 self.job_id, passed, ",".join(map(str, self.epoch_splits)),
                 ",".join(map(str, self.trained_splits or [])))
        self.trained_splits = list(self.epoch_splits)
        return True
