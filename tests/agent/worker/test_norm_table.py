"""The pipelines' squared norms compared at the digest (agent/worker/normtable.py): the
(step, stage) where one replica's pipeline held another value than a strict majority did,
nothing where they agree, where no majority exists, or where rows do not line up."""

from __future__ import annotations

import pytest

from agent.worker.normtable import MAX_STEPS, NormTable, differing


def rows(values: list[list[list[float]]]) -> list[list[float]]:
    """Every replica's `take()` from its table of per-step squared norms (steps 1..)."""
    out = []
    for pipeline in values:
        t = NormTable(len(pipeline[0]))
        for step, squares in enumerate(pipeline, start=1):
            t.add(step, squares)
        out.append(t.take())
    return out


HONEST = [[1.5, 2.25, 0.5], [1.25, 2.0, 0.75]]  # two steps of a 3-stage pipeline


def test_honest_pipelines_agree_to_the_bit() -> None:
    got = rows([HONEST, HONEST, HONEST])
    assert [differing(got, 3, j) for j in range(3)] == [[], [], []]


def test_the_pipeline_whose_stage_sent_another_norm_is_found_at_that_step_and_stage() -> None:
    lied = [HONEST[0], [1.25, 200.0, 0.75]]
    got = rows([HONEST, lied, HONEST, HONEST])
    assert differing(got, 3, 1) == [(2, 1)]
    assert differing(got, 3, 0) == []  # the honest pipelines hold the majority's values


def test_no_majority_or_rows_that_do_not_line_up_find_nothing() -> None:
    other = [[9.0, 2.25, 0.5], HONEST[1]]
    assert differing(rows([HONEST, other]), 3, 1) == []  # R = 2: one against one
    got = rows([HONEST, HONEST, other])
    assert differing([got[0], got[1], got[2][:-1]], 3, 2) == []  # another length
    shifted = [r[:] for r in got]
    shifted[2][0] = 7.0  # its first row claims another step: not compared (its stage 0
    assert differing(shifted, 3, 2) == []  # differs there), and its second row agrees
    assert differing(got, 3, 5) == []  # no such replica


def test_a_table_keeps_its_last_steps_and_is_spent_by_take() -> None:
    t = NormTable(2)
    for step in range(1, MAX_STEPS + 5):
        t.add(step, [float(step), 1.0])
    flat = t.take()
    assert len(flat) == 3 * MAX_STEPS and flat[0] == 5.0
    assert t.take() == []
    with pytest.raises(ValueError, match="3 squared norms for a pipeline of 2 stages"):
        t.add(1, [1.0, 2.0, 3.0])


def test_a_lying_rows_non_finite_or_huge_values_find_only_that_row() -> None:
    """A peer's row is its own to lie in (dp_gather: point to point, at the receiver's own
    length): NaN, infinity or a huge value in it find that pipeline only, never an honest
    one, and the majority stays the honest value."""
    for bad in (float("nan"), float("inf"), 1e308):
        lied = [[1.5, bad, 0.5], HONEST[1]]
        got = rows([HONEST, lied, HONEST])
        assert differing(got, 3, 1) == [(1, 1)]
        assert differing(got, 3, 0) == [] and differing(got, 3, 2) == []
