"""Where rounds of local steps end, and so where checkpoints fall (`--sync-every H`).

The worker (`agent/worker/outer.py`) ends a round after every H-th step, counted from step 0
of the job, and after the job's last step; it writes a checkpoint that fell due inside a
round (`--checkpoint-every`) only when the round ends. The coordinator must know which steps
that leaves on disk (to count progress and re-cut splits at the right checkpoint), so both
read the rule here. Pure Python: no torch.
"""

from __future__ import annotations


def sync_due(step: int, every: int, last: int) -> bool:
    """Whether step `step` (1-based) ends a round: a multiple of `every`, or the last step."""
    return step % every == 0 or step == last


def round_of(step: int, every: int) -> int:
    """The round step `step` belongs to: 1 for steps 1..every."""
    return -(-step // every)


def round_end(step: int, every: int) -> int:
    """The step that ends step `step`'s round (short of the job's last step): where a
    checkpoint that fell due at `step` is written."""
    return round_of(step, every) * every


def newest_checkpoint(step: int, checkpoint_every: int, sync_every: int = 1) -> int:
    """The newest step a checkpoint was written after, once step `step` is done (0: none),
    short of the job's last step: each multiple of `checkpoint_every` is written at the end of
    its round (`sync_every` 1: at once)."""
    if checkpoint_every <= 0:
        return 0
    due = step // checkpoint_every * checkpoint_every
    while due > 0:
        written = round_end(due, sync_every)
        if written <= step:
            return written
        due -= checkpoint_every
    return 0


def requested_checkpoint(known: int, last: int, lead: int, checkpoint_every: int,
                         sync_every: int, total: int) -> int:
    """The step to ask an extra checkpoint after (`dtfm.core.requests`), `lead` steps past
    `last` (the newest step a worker reported) and at the end of its round; 0 when the next
    regular checkpoint after `known` (the newest every member passed) comes no later, or the
    job ends first."""
    if checkpoint_every <= 0 or lead < 1:
        return 0
    step = round_end(last + lead, sync_every)
    regular = round_end((known // checkpoint_every + 1) * checkpoint_every, sync_every)
    return step if step < min(regular, total) else 0
