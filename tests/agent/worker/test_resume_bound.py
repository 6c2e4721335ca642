"""An integrity rollback's bound on resuming (`Assignment.resume_before`, issue 43): every rank
agrees on the newest step below the first one proven bad, never at or after it."""

from __future__ import annotations

import pytest

from agent.worker import checkpoint


class Held(checkpoint.Finder):
    """A stage folder holding `steps` intact (no files: only the questions `agree` asks)."""

    def __init__(self, steps: list[int]) -> None:
        self.good = steps

    def newest_intact(self, at_most: int | None = None) -> int:
        return max([s for s in self.good if at_most is None or s <= at_most], default=0)


@pytest.mark.parametrize("held, below, agreed", [
    ([4, 8, 12], 0, 12),  # no bound: the newest
    ([4, 8, 12], 10, 8),  # proven bad from step 10: step 12 was trained with it
    ([4, 8, 12], 8, 4),  # bad from the step of a checkpoint: not that one either
    ([8, 12], 6, 0),  # nothing older kept: from step 0, slow but never wrong
    ([4, 8], 1, 0),
])
def test_ranks_resume_below_the_first_step_proven_bad(held: list[int], below: int,
                                                      agreed: int) -> None:
    assert checkpoint.agree(Held(held), lambda v: v, below) == agreed
