"""An owner's averaged shard, checked by its receivers (agent/worker/avgcheck.py): a zeroed
or replayed average named by two receivers confirms the fault; its norm, cosine or shape
never does, because a bad contributor's copy moves an honest owner's mean the same way
(coordinator/integrity/corroborate.py)."""

from __future__ import annotations

import pytest

from coordinator.integrity.corroborate import Corroboration
from tests.coordinator.test_corroborate import rec


@pytest.mark.parametrize("kind", ["avg_zero", "avg_stale"])
def test_an_average_no_input_can_cause_confirms(kind: str) -> None:
    c = Corroboration()
    assert c.weigh(rec("owner", "a", 7, kind=kind)) == (False, 7)
    assert c.weigh(rec("owner", "b", 8, kind=kind)) == (True, 7)


@pytest.mark.parametrize("kind", ["avg_norm", "avg_cosine", "avg_noise"])
def test_an_averages_statistics_stay_evidence(kind: str) -> None:
    c = Corroboration()
    for step in range(5, 9):
        assert not c.weigh(rec("owner", "a", step, kind=kind))[0]
        assert not c.weigh(rec("owner", "b", step, kind=kind))[0]
