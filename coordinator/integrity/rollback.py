"""Rollback after a confirmed fault: which checkpoint the stages may resume from, and which
one every agent must keep so that there is one to roll back to.

A confirmed fault names the first step proven bad (S). Every stage must resume from a
checkpoint of a step before S, never at or after it: those were trained with the bad
agent's numbers in them. The bound travels in the next epoch's assignments
(`Assignment.resume_before`); each worker agrees with the others on the newest step below it
that every rank holds intact (agent/worker/checkpoint.py `agree`).

Agents keep only their newest `KEEP` (2) complete steps per stage (dtfm/core/checkpoints.py),
so by the time a fault is proven the last checkpoint before S may be gone. The nearest
honest thing: keep one known-good copy. A checkpoint is taken as known-good once the job has
trained `VET_ROUNDS` rounds past it (the detection window the checks are built to meet: every
attack caught within 10 steps, 10 outer steps with local steps) and no fault was proven; the
coordinator names it as the agents' keep floor (`Ack.keep_checkpoints_from`), so every
step from it on is kept (up to `MAX_HELD`). The rounds count from the step through which
every member's integrity records have arrived (`vetted_step`), not from the furthest step any
member reported: evidence rides the heartbeats, a heartbeat apart from the steps it covers,
and in a fast job (25 steps a heartbeat in `coordinator demo --bad-peer`) the furthest step
ran past the window while the records that would condemn a checkpoint were still on their
way; that checkpoint was then called good, the older ones were let go, and the rollback had
nothing before the bad step but step 0. A fault caught later than the window, or proven
at a step before the known-good copy, finds nothing older to resume from: the stages start
from step 0 (the workers' agreement finds no step below the bound), which is slow but never
wrong. Pure functions: the job calls them.
"""

from __future__ import annotations

from collections.abc import Iterable

from dtfm.core.rounds import newest_checkpoint

VET_ROUNDS = 10  # rounds a checkpoint must be trained past, unchallenged, to be known-good


def known_good(last_step: int, checkpoint_every: int, sync_every: int = 1) -> int:
    """The newest checkpoint step at least VET_ROUNDS rounds (of `sync_every` steps) behind
    `last_step` (0: none yet, or no checkpoints)."""
    vetted = last_step - VET_ROUNDS * max(sync_every, 1)
    if checkpoint_every <= 0 or vetted <= 0:
        return 0
    return newest_checkpoint(vetted, checkpoint_every, max(sync_every, 1))


def vetted_step(members: Iterable[tuple[int, int] | None], epoch_from: int) -> int:
    """The newest step through which every member's integrity records have arrived.

    `members`: each member's newest report this epoch as (step, integrity_through), None
    before its first; `epoch_from`: the checkpoint step the epoch started from, which is all
    that is known of a member before it reports. A member's own claim counts only within
    [epoch_from, its step]: one that never says (an older agent, or a lying one) holds the
    known-good copy where the epoch began, which costs disk (the agents keep more steps, up
    to their bound), never a checkpoint that evidence could still condemn."""
    return min((epoch_from if m is None else max(epoch_from, min(m)) for m in members),
               default=epoch_from)


def keep_floor(floor: int, vetted: int, checkpoint_every: int, sync_every: int,
               rollback_before: int) -> int:
    """The oldest step every agent must keep: the lower of the job's own `floor` (a mirror's,
    0: none) and the known-good checkpoint (`vetted`: `vetted_step`), or the one a pending
    rollback resumes from. Until a checkpoint is vetted, every step is kept (1), at most
    10 rounds' worth and the agents' own bound (`MAX_HELD`)."""
    good = known_good(vetted, checkpoint_every, sync_every)
    if checkpoint_every > 0 and not good:  # nothing vetted yet: any step may be the one a
        good = 1  # rollback needs (the demo's bad peer struck at step 8, proven at step 20)
    if rollback_before:
        good = newest_before(rollback_before, checkpoint_every, sync_every) or good
    floors = [f for f in (floor, good) if f > 0]
    return min(floors) if floors else 0


def newest_before(bad_step: int, checkpoint_every: int, sync_every: int = 1) -> int:
    """The newest checkpoint step before `bad_step` (0: none)."""
    return newest_checkpoint(bad_step - 1, checkpoint_every, max(sync_every, 1))
