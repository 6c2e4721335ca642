"""The drift watch: a lasting gap fires and names whom it points at; steady steps, a model that
under-predicts, and blips shorter than the window never fire; an accepted verdict does not
fire again until the job drifts further."""

from __future__ import annotations

import random

import pytest

from coordinator.job.drift import DriftWatch, Sample

MEMBERS = ["a", "b", "c", "d"]


def feed(watch: DriftWatch, steps: range, step_s: float = 1.0, slow: dict | None = None,
         wait: dict | None = None, jitter: float = 0.03, seed: int = 0) -> None:
    """Every member reports every step: compute 0.6 s, the rest waits (pipeline mostly)."""
    rng = random.Random(seed)
    for step in steps:
        for agent in MEMBERS:
            noise = 1.0 + rng.uniform(-jitter, jitter)
            compute = 0.6 * (slow or {}).get(agent, 1.0)
            extra = (wait or {}).get(agent, 0.0)
            total = max(step_s, compute + 0.1) * noise
            w = max(total - compute, 0.0) + extra
            watch.observe(agent, step, Sample(step_s=total + extra, compute_s=compute * noise,
                                              pp_wait_s=0.8 * w, dp_s=0.2 * w))


def test_steady_steps_never_fire() -> None:
    watch = DriftWatch(threshold=0.3, window=6)
    watch.start_epoch(predicted_step_s=0.95)
    for start in range(2, 200, 10):
        feed(watch, range(start, start + 10), jitter=0.1, seed=start)
        assert watch.check() is None
    assert watch.settled_s == pytest.approx(1.0, rel=0.1)


def test_a_model_that_under_predicts_is_not_drift() -> None:
    watch = DriftWatch(threshold=0.3, window=6)
    watch.start_epoch(predicted_step_s=0.5)  # the settled step, 1 s, is what is expected
    feed(watch, range(2, 40))
    assert watch.check() is None
    assert watch.expected_s() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("blip", [1, 3, 5])
def test_a_blip_shorter_than_the_window_never_fires(blip: int) -> None:
    watch = DriftWatch(threshold=0.3, window=6)
    watch.start_epoch(predicted_step_s=1.0)
    feed(watch, range(2, 20))
    for step in range(20, 20 + blip):
        feed(watch, range(step, step + 1), wait={a: 2.0 for a in MEMBERS})
        assert watch.check() is None
    feed(watch, range(20 + blip, 40))
    assert watch.check() is None


def test_a_lasting_link_degradation_fires_and_names_the_waiting_members() -> None:
    watch = DriftWatch(threshold=0.3, window=6)
    watch.start_epoch(predicted_step_s=1.0)
    feed(watch, range(2, 20))
    # the link between a and b degrades: their pipeline waits grow most, c's a little
    grow = {"a": 1.5, "b": 1.4, "c": 0.1}
    feed(watch, range(20, 25), wait=grow)
    assert watch.check() is None  # five slow steps: not yet the window
    feed(watch, range(25, 26), wait=grow)
    drift = watch.check()
    assert drift is not None
    assert drift.links == ["a", "b"] and not drift.devices and drift.pipeline
    assert drift.measured_s > 1.3 * drift.expected_s
    assert "pipeline waits grew on a, b" in drift.describe()


def test_a_slower_device_is_named_and_its_waiting_peers_are_not_blamed() -> None:
    watch = DriftWatch(threshold=0.3, window=6)
    watch.start_epoch(predicted_step_s=1.0)
    feed(watch, range(2, 20))
    # c computes 3x slower: 1.8 s; the others wait for it
    for step in range(20, 30):
        for agent in MEMBERS:
            compute = 1.8 if agent == "c" else 0.6
            watch.observe(agent, step, Sample(step_s=2.0, compute_s=compute,
                                              pp_wait_s=2.0 - compute, dp_s=0.0))
    drift = watch.check()
    assert drift is not None
    assert list(drift.devices) == ["c"] and drift.devices["c"][1] == pytest.approx(1.8)
    assert drift.links == []
    assert drift.suspects == ["c"]


def test_an_accepted_drift_fires_again_only_when_it_grows() -> None:
    watch = DriftWatch(threshold=0.3, window=6)
    watch.start_epoch(predicted_step_s=1.0)
    feed(watch, range(2, 20))
    feed(watch, range(20, 30), wait={a: 1.0 for a in MEMBERS})
    assert watch.check() is not None
    watch.accept(hold_steps=5)
    feed(watch, range(30, 60), wait={a: 1.0 for a in MEMBERS})
    assert watch.check() is None  # the new normal
    feed(watch, range(60, 70), wait={a: 2.5 for a in MEMBERS})
    assert watch.check() is not None


def test_a_new_epoch_settles_again() -> None:
    watch = DriftWatch(threshold=0.3, window=4)
    watch.start_epoch(predicted_step_s=1.0)
    feed(watch, range(2, 20))
    watch.start_epoch(predicted_step_s=2.0)
    assert watch.settled_s == 0.0 and watch.check() is None
    feed(watch, range(20, 30), step_s=2.1)
    assert watch.check() is None
    assert watch.settled_s == pytest.approx(2.1, rel=0.05)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="window >= 2"):
        DriftWatch(threshold=0.3, window=1)
