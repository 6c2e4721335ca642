"""R >= 3: a copy's direction and quiet energy are judged on their window's medians, so an
honest copy's stray step is no evidence and a flipped or noised copy still is
(agent/worker/scorewindow.py)."""

from __future__ import annotations

import pytest
import torch

from agent.worker import gradscore
from agent.worker.badpeer import attack
from agent.worker.gradscore import CopyScore
from agent.worker.scorewindow import WINDOW, WINDOW_COSINE_MIN, ScoreWindow


def step(cosines: list[float]) -> list[CopyScore]:
    return [CopyScore(k, 1.0, c) for k, c in enumerate(cosines)]


def kinds(window: ScoreWindow, cosines: list[float]) -> list[tuple[int, str]]:
    found = gradscore.judge(window.smooth(step(cosines)), WINDOW_COSINE_MIN)
    return [(f.replica, f.kind) for f in found]


def test_an_honest_copys_stray_negative_steps_are_no_evidence() -> None:
    """The one-step rule named each of these (bench/honest.py: ~2 records a step)."""
    w = ScoreWindow()
    honest = [[0.3, 0.2, -0.4], [0.2, 0.1, 0.2], [0.1, -0.3, 0.3], [0.2, 0.3, -0.2],
              [0.3, 0.2, 0.1], [-0.5, 0.2, 0.3], [0.2, 0.2, 0.2]]
    for cosines in honest:
        assert kinds(w, cosines) == [], cosines
    assert gradscore.judge(step(honest[0]))  # what the one-step rule said


def test_a_flipped_copy_is_named_from_its_third_step_once_the_window_is_full() -> None:
    w = ScoreWindow()
    verdicts = [kinds(w, [0.2, 0.3, 0.25]) for _ in range(WINDOW)]
    assert verdicts == [[]] * WINDOW  # honest: nothing
    flipped = [kinds(w, [0.2, 0.3, -0.3]) for _ in range(3)]
    assert flipped[:2] == [[], []] and flipped[2] == [(2, "grad_cosine")]


def test_no_verdict_before_the_window_is_full() -> None:
    w = ScoreWindow()
    assert [kinds(w, [0.2, 0.3, -0.9]) for _ in range(WINDOW - 1)] == \
        [[]] * (WINDOW - 1)
    assert kinds(w, [0.2, 0.3, -0.9]) == [(2, "grad_cosine")]


def dense_step(replicas: int, seed: int, noised: int | None = None) -> list[CopyScore]:
    """One step's scores of `replicas` dense copies whose coordinates are loud and quiet
    alike (a scale per coordinate, shared: the model's, not the batch's), each with its own
    sampling noise of the same size as the shared part; `noised` gets noise of its own sigma
    (the rehearsal's `noise` attack)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(1.0 * torch.randn(4096, generator=torch.Generator().manual_seed(7)))
    common = torch.randn(4096, generator=g)
    copies = [scale * (common + torch.randn(4096, generator=g)) for _ in range(replicas)]
    if noised is not None:
        copies[noised] = attack("noise", copies[noised], gen=g)
    scorer = gradscore.ShardScorer(replicas)
    scorer.add(0, copies)
    return scorer.scores()


@pytest.mark.parametrize("replicas", [3, 4, 5])
def test_noise_in_a_dense_bucket_is_named_by_its_quiet_energy_over_the_window(
        replicas: int) -> None:
    """The shape check alone misses it there (a dense gradient is not sparse enough for
    noise to flatten it past `SHAPE_HIGH`); its quiet energy does not."""
    w = ScoreWindow()
    for seed in range(40):  # honest: nothing, ever
        found = gradscore.judge(w.smooth(dense_step(replicas, seed)), WINDOW_COSINE_MIN)
        assert found == [], (seed, found)
    one = dense_step(replicas, 99, noised=1)
    assert one[1].shape < gradscore.SHAPE_HIGH  # what the worst-bucket shape says
    assert one[1].quiet > 3 * gradscore.QUIET_HIGH
    verdicts = [gradscore.judge(w.smooth(dense_step(replicas, 100 + s, noised=1)),
                                WINDOW_COSINE_MIN) for s in range(3)]
    assert verdicts[:2] == [[], []]  # the window's median moves from the third step
    assert [(f.replica, f.kind) for f in verdicts[2]] == [(1, "grad_noise")]


def test_quiet_energy_is_not_judged_at_r2_nor_before_the_window_is_full() -> None:
    assert [s.quiet for s in dense_step(2, 0, noised=1)] == [1.0, 1.0]
    w = ScoreWindow()
    for seed in range(WINDOW - 1):
        assert gradscore.judge(w.smooth(dense_step(3, seed, noised=1))) == []
