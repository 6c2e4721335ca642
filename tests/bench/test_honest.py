"""bench/honest.py's replay: a rank's integrity events through the coordinator's rule."""

from __future__ import annotations

from bench import honest
from dtfm.core.events import IntegrityEvent


def named(suspect: int, by: int, step: int, kind: str = "grad_norm") -> IntegrityEvent:
    return IntegrityEvent(step=step, kind=kind, suspect_rank=suspect, score=4.0,
                          detail="norm 4x the median", rank=by)


def test_isolated_agreement_is_counted_and_excludes_nobody_a_lasting_one_excludes() -> None:
    isolated = [named(3, by, step) for step in (82, 146) for by in (1, 3, 5)]
    out = honest.replay(sorted(isolated, key=lambda e: (e.step, e.rank)))
    assert out["agreed_on_one_step"] == [{"suspect_rank": 3, "step": 82},
                                         {"suspect_rank": 3, "step": 146}]
    assert out["excluded"] == {} and out["kinds"] == {"grad_norm": 6}
    lasting = [named(2, by, step) for step in (8, 9, 10) for by in (0, 4)]
    out = honest.replay(lasting)
    assert list(out["excluded"]) == ["r2"] and out["excluded"]["r2"]["step"] == 8
