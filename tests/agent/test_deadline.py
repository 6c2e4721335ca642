"""The policy that decides how long a worker's wait may block (`agent/worker/deadline.py`).

Pure arithmetic on a fake clock: the start-up budget scales with the model and the device,
the steady value follows the slowest recent step, both are clamped between the floor and the
operator's ceiling, and the steps after a checkpoint get room for the save without inflating
the steady value. The real processes (a frozen peer found in seconds) are in
`test_deadline_frozen_peer.py`.
"""

from __future__ import annotations

import pytest

from agent.worker.deadline import (
    DEFAULT_CEILING_S,
    SLOWER_REPLICA,
    Deadline,
    Policy,
    Startup,
    ceiling,
    for_stages,
    operator_ceiling,
    startup,
)
from agent.worker.transport import resume, sockio
from dtfm.core.layout import layer_ranges
from dtfm.core.presets import get_preset

GFLOPS = 1e9


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _run_steps(dl: Deadline, clock: Clock, seconds: list[float]) -> None:
    for s in seconds:
        clock.now += s
        dl.step_finished()


def _tracker(policy: Policy | None = None, budget: Startup | None = None) -> tuple[Deadline, Clock]:
    clock = Clock()
    dl = Deadline(policy or Policy(ceiling_s=300.0), budget, clock=clock)
    dl.start()
    return dl, clock


def _budget(name: str, flops: float, stages: int = 2, replicas: int = 1) -> Startup:
    spec = get_preset(name)
    largest = max(spec.stage_params(b, e) for b, e in layer_ranges(spec.n_layers, stages))
    return startup(Policy(), params=spec.param_count(), largest_stage_params=largest,
                   tokens=8 // replicas * spec.seq_len, flops=flops)


# ---- start-up ----
def test_startup_budget_scales_with_the_model_and_the_device() -> None:
    tiny, big = _budget("gpt-tiny", 50 * GFLOPS), _budget("gpt-1.3b", 50 * GFLOPS)
    assert big.seconds > 100 * tiny.seconds
    # compute: 6 FLOPs per parameter and token, on this device alone
    spec = get_preset("gpt-1.3b")
    assert big.compute_s == pytest.approx(6 * spec.param_count() * 8 * spec.seq_len / 50e9)
    # the largest stage's weights + AdamW moments, 12 bytes a parameter
    half = max(spec.stage_params(b, e) for b, e in layer_ranges(spec.n_layers, 2))
    assert big.state_gb == pytest.approx(half * 12 / 1e9)
    # a device ten times slower gets ten times the compute allowance
    slow = _budget("gpt-1.3b", 5 * GFLOPS)
    assert slow.compute_s == pytest.approx(10 * big.compute_s)
    assert slow.seconds > big.seconds
    # a tiny model's budget is about its floor
    assert tiny.seconds == pytest.approx(Policy().startup_base_s, abs=1.0)


def test_before_steps_are_measured_the_start_up_budget_applies() -> None:
    budget = _budget("gpt-small", 20 * GFLOPS)
    dl, clock = _tracker(budget=budget)
    assert dl.current().seconds == pytest.approx(budget.seconds)
    assert "start-up budget" in dl.current().why and "GFLOP/s" in dl.current().why
    # the first step (one-off costs) and fewer than warm_steps more are not enough
    _run_steps(dl, clock, [30.0] + [0.5] * (Policy().warm_steps - 1))
    assert not dl.measured
    assert dl.current().seconds == pytest.approx(budget.seconds)
    _run_steps(dl, clock, [0.5])
    assert dl.measured


def test_a_start_up_budget_above_the_ceiling_is_capped_and_says_so() -> None:
    budget = _budget("gpt-1.3b", 1 * GFLOPS)
    dl, _ = _tracker(Policy(ceiling_s=300.0), budget)
    wait = dl.current()
    assert wait.seconds == 300.0
    assert "the ceiling DTFM_TIMEOUT_S" in wait.why and "start-up budget" in wait.why


def test_without_an_operator_ceiling_a_big_model_raises_the_default() -> None:
    tiny, big = _budget("gpt-tiny", 1 * GFLOPS), _budget("gpt-1.3b", 1 * GFLOPS)
    assert ceiling(None, tiny) == DEFAULT_CEILING_S
    assert ceiling(None, big) >= big.seconds > DEFAULT_CEILING_S
    assert ceiling(120.0, big) == 120.0  # the operator's word is final


def test_for_stages_builds_the_worker_deadline() -> None:
    spec = get_preset("gpt-1.3b")
    ranges = layer_ranges(spec.n_layers, 4)
    dl = for_stages(spec, ranges, 4 * spec.seq_len, 2 * GFLOPS, operator_s=None)
    assert dl.policy.ceiling_s >= dl.current().seconds > DEFAULT_CEILING_S
    capped = for_stages(spec, ranges, 4 * spec.seq_len, 2 * GFLOPS, operator_s=60.0)
    assert capped.current().seconds == 60.0
    # an operator ceiling below the floor pins every wait to it
    low = for_stages(get_preset("gpt-tiny"), [(0, 2), (2, 4)], 256, 2 * GFLOPS, operator_s=4.0)
    assert low.current().seconds == 4.0 and "ceiling" in low.current().why
    # on the dtfm transport the floor covers a pair elsewhere moving to its relay
    assert for_stages(spec, ranges, 4, GFLOPS, None).policy.floor_s == 10.0
    moving = for_stages(spec, ranges, 4, GFLOPS, None, floor_s=resume.MEND_S)
    assert moving.policy.floor_s == resume.MEND_S > resume.FALLBACK_S + sockio.UNACKED_S
    assert moving.policy.clamp(1.0, "a fast step").seconds == resume.MEND_S
    assert for_stages(spec, ranges, 4, GFLOPS, 12.0, floor_s=resume.MEND_S).policy.floor_s == 12


# ---- steady ----
def test_steady_value_follows_the_slowest_recent_step() -> None:
    dl, clock = _tracker()
    _run_steps(dl, clock, [9.0, 1.5, 1.2, 1.4])  # the first (9 s) is not counted
    wait = dl.current()
    assert wait.seconds == pytest.approx(8 * 1.5)
    assert wait.why == "12 s = 8 x the slowest of the last 3 steps (1.5 s)"
    _run_steps(dl, clock, [3.0])  # slower steps raise it at once
    assert dl.current().seconds == pytest.approx(24.0)
    _run_steps(dl, clock, [2.0] * Policy().window)  # and it falls once they leave the window
    assert dl.current().seconds == pytest.approx(16.0)


def test_steady_value_is_clamped_to_floor_and_ceiling() -> None:
    dl, clock = _tracker(Policy(ceiling_s=60.0, floor_s=10.0))
    _run_steps(dl, clock, [1.0, 0.03, 0.03, 0.03])
    wait = dl.current()
    assert wait.seconds == 10.0
    assert "the floor" in wait.why and "0.24 s is less" in wait.why
    _run_steps(dl, clock, [20.0])
    wait = dl.current()
    assert wait.seconds == 60.0
    assert "the ceiling DTFM_TIMEOUT_S" in wait.why and "160 s is more" in wait.why


def test_fixed_deadline_never_moves() -> None:
    dl = Deadline.fixed(30.0)
    dl.start()
    for _ in range(10):
        dl.step_finished()
    assert dl.current().seconds == 30.0 and dl.current().why == "30 s, fixed"


# ---- checkpoints ----
def test_waits_after_a_checkpoint_allow_this_ranks_save() -> None:
    dl, clock = _tracker()
    _run_steps(dl, clock, [5.0, 2.0, 2.0, 2.0])
    dl.checkpoint(saved_s=7.0)  # this rank wrote for 7 s
    wait = dl.current()
    assert wait.seconds == pytest.approx(8 * 2.0 + 8 * 7.0)
    assert "checkpoint save (7 s)" in wait.why
    # the step after the save (the save + peers' saves + a step) is not a steady step
    _run_steps(dl, clock, [20.0])
    assert dl.current().seconds == pytest.approx(16.0)
    # the next checkpoint's waits use the measured step that followed the last one
    _run_steps(dl, clock, [2.0])
    dl.checkpoint(saved_s=0.1)
    wait = dl.current()
    assert wait.seconds == pytest.approx(8 * 20.0)
    assert "followed a checkpoint (20 s)" in wait.why


def test_a_rank_that_writes_nothing_still_allows_for_its_peers_save() -> None:
    budget = _budget("gpt-1.3b", 50 * GFLOPS)  # about 10 GB of stage state
    dl, clock = _tracker(Policy(ceiling_s=3600.0), budget)
    _run_steps(dl, clock, [5.0, 2.0, 2.0, 2.0])
    dl.checkpoint(saved_s=None)  # another replica writes this stage
    wait = dl.current()
    assert wait.seconds == pytest.approx(16.0 + Policy().per_gb_s * budget.state_gb)
    assert "GB of stage state" in wait.why


def test_a_sync_point_of_local_steps_gets_the_allowance_of_a_heavy_step() -> None:
    budget = _budget("gpt-1.3b", 50 * GFLOPS)  # about 10 GB of stage state to exchange
    dl, clock = _tracker(Policy(ceiling_s=3600.0), budget)
    _run_steps(dl, clock, [5.0, 2.0, 2.0, 2.0])
    assert dl.current().seconds == pytest.approx(16.0)  # an inner step's waits
    dl.sync_point()  # the round's exchange starts within this step
    assert dl.current().seconds > 16.0 + 100.0
    _run_steps(dl, clock, [40.0])  # the sync step, measured apart from the inner steps
    assert dl.current().seconds == pytest.approx(16.0)
    dl.sync_point()
    assert dl.current().seconds == pytest.approx(8 * 40.0)


def test_a_sync_point_waits_for_a_replica_that_fell_behind_over_the_round() -> None:
    """Replicas run a round of H local steps apart: at its end a peer on slower links may
    arrive H x the difference later. bench/sync.py's H = 64 job failed when a replica 20+ s
    behind was taken for frozen under 8 x a 2.9 s step."""
    dl, clock = _tracker(Policy(ceiling_s=3600.0))
    _run_steps(dl, clock, [5.0, 2.9, 2.9, 2.9])
    dl.sync_point(64)
    wait = dl.current()
    assert wait.seconds == pytest.approx(8 * 2.9 + (SLOWER_REPLICA - 1) * 64 * 2.9)
    assert "3x slower over this round of 64 steps" in wait.why
    _run_steps(dl, clock, [30.0])  # the sync step; the next round starts together
    assert dl.current().seconds == pytest.approx(8 * 2.9)
    dl.sync_point()  # a checkpoint's moment averaging right after a sync: no round apart
    assert dl.current().seconds == pytest.approx(8 * 30.0)
    dl, clock = _tracker()  # the default ceiling still bounds it
    _run_steps(dl, clock, [5.0, 2.9, 2.9, 2.9])
    dl.sync_point(64)
    assert dl.current().seconds == DEFAULT_CEILING_S


def test_a_checkpoint_after_every_step_still_adapts() -> None:
    dl, clock = _tracker()
    for dt in (5.0, 2.0, 2.5, 2.0):
        clock.now += dt
        dl.step_finished()
        dl.checkpoint(saved_s=0.5)
    assert dl.measured
    wait = dl.current()
    assert wait.seconds == pytest.approx(8 * 2.5)
    assert "followed a checkpoint (2.5 s)" in wait.why


# ---- the operator's ceiling ----
@pytest.mark.parametrize("raw", ["abc", "0", "-5", "nan", "inf"])
def test_a_bad_ceiling_is_refused_with_the_variable_named(raw: str) -> None:
    with pytest.raises(ValueError, match="DTFM_TIMEOUT_S"):
        operator_ceiling(raw)


def test_ceiling_unset_or_given() -> None:
    assert operator_ceiling(None) is None and operator_ceiling(" ") is None
    assert operator_ceiling("42.5") == 42.5
