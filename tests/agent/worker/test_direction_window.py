"""R >= 3: a copy's direction is judged on its window's median cosine, so an honest copy's
stray negative step is no evidence and a flipped copy still is (agent/worker/directionwindow.py)."""

from __future__ import annotations

from agent.worker import gradscore
from agent.worker.directionwindow import DIRECTION_WINDOW, WINDOW_COSINE_MIN, DirectionWindow
from agent.worker.gradscore import CopyScore


def step(cosines: list[float]) -> list[CopyScore]:
    return [CopyScore(k, 1.0, c) for k, c in enumerate(cosines)]


def kinds(window: DirectionWindow, cosines: list[float]) -> list[tuple[int, str]]:
    found = gradscore.judge(window.smooth(step(cosines)), WINDOW_COSINE_MIN)
    return [(f.replica, f.kind) for f in found]


def test_an_honest_copys_stray_negative_steps_are_no_evidence() -> None:
    """The one-step rule named each of these (bench/honest.py: ~2 records a step)."""
    w = DirectionWindow()
    honest = [[0.3, 0.2, -0.4], [0.2, 0.1, 0.2], [0.1, -0.3, 0.3], [0.2, 0.3, -0.2],
              [0.3, 0.2, 0.1], [-0.5, 0.2, 0.3], [0.2, 0.2, 0.2]]
    for cosines in honest:
        assert kinds(w, cosines) == [], cosines
    assert gradscore.judge(step(honest[0]))  # what the one-step rule said


def test_a_flipped_copy_is_named_from_its_third_step_once_the_window_is_full() -> None:
    w = DirectionWindow()
    verdicts = [kinds(w, [0.2, 0.3, 0.25]) for _ in range(DIRECTION_WINDOW)]
    assert verdicts == [[]] * DIRECTION_WINDOW  # honest: nothing
    flipped = [kinds(w, [0.2, 0.3, -0.3]) for _ in range(3)]
    assert flipped[:2] == [[], []] and flipped[2] == [(2, "grad_cosine")]


def test_no_verdict_before_the_window_is_full() -> None:
    w = DirectionWindow()
    assert [kinds(w, [0.2, 0.3, -0.9]) for _ in range(DIRECTION_WINDOW - 1)] == \
        [[]] * (DIRECTION_WINDOW - 1)
    assert kinds(w, [0.2, 0.3, -0.9]) == [(2, "grad_cosine")]
