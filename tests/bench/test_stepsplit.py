"""bench/stepsplit.py without the emulator: a job's measured split from its step events, the
step model's network-free split from their compute, the cores bound, and the lost time."""

from __future__ import annotations

import pytest

from bench import stepsplit


def events() -> list[dict[str, object]]:
    """Two steady steps of a 2 x 1 job (step 1, the start-up, is left out)."""
    out: list[dict[str, object]] = []
    for step in (1, 2, 3):
        for stage in (0, 1):
            out.append({"event": "step", "step": step, "stage": stage, "replica": 0,
                        "step_s": 9.0 if step == 1 else 1.0, "compute_s": 0.4,
                        "recv_wait_s": 0.3, "send_wait_s": 0.0, "dp_s": 0.0, "sync_s": 0.1,
                        "codec_s": 0.0, "cpu_s": 0.5})
    return out


def test_the_measured_split_leaves_out_the_first_step_and_adds_up() -> None:
    b = stepsplit.measured_split(events())
    assert (b.step_s, b.compute, b.pipeline_wait, b.norm_wait) == (1.0, 0.4, 0.3, 0.1)
    assert b.other == pytest.approx(0.2)
    assert stepsplit.cores_bound(events(), 2) == pytest.approx(0.5)  # 2 x 0.5 s over 2 cores


def test_the_network_free_prediction_and_the_lost_time() -> None:
    free = stepsplit.free_prediction(events(), "gpt-tiny", 2, 1, 8, 2, 1)
    # GPipe, 2 stages, 2 micro-batches of 0.2 s: 3 slots a step, 2 busy
    assert free.step_s == pytest.approx(0.6, rel=1e-3)
    assert free.compute == pytest.approx(0.4)
    wan = stepsplit.measured_split(events())
    out = stepsplit.report(wan, None, stepsplit.measured_split(events()), free)
    assert out["lost"]["step_s"] == 0.0 and out["ratio"] == 1.0
    assert "lost to the network, measured" in out["table"]


def test_each_replicas_pipeline_is_split_apart() -> None:
    """A second replica whose ranks wait 0.5 s more at the sync point: its own split shows
    it, the job's mean halves it, and the report lists both replicas."""
    two = events() + [{**e, "replica": 1, "dp_s": 0.5, "step_s": e["step_s"] + 0.5}
                      for e in events()]
    split = stepsplit.by_replica(two)
    assert sorted(split) == [0, 1]
    assert (split[0].sync_wait, split[1].sync_wait) == (0.0, pytest.approx(0.5))
    assert stepsplit.measured_split(two).sync_wait == pytest.approx(0.25)
    out = stepsplit.report(split[0], None, split[0], split[0], split, split)
    assert "WAN, replica 1" in out["table"] and "network removed, replica 0" in out["table"]


def test_the_latency_floor_is_the_slowest_pipeline_both_ways_and_stage_0s_exchange() -> None:
    """2 stages x 2 replicas: pipeline 0 is a-b (10 ms one way, 12 back), pipeline 1 c-d
    (30 ms each way); stage 0's replicas a and c are 40 ms apart one way, 45 the other:
    60 ms of pipeline plus twice 45 ms."""
    agents = ["a", "b", "c", "d"]
    delay = [[0, 10, 40, 0], [12, 0, 0, 0], [45, 0, 0, 30], [0, 0, 30, 0]]
    floor = stepsplit.latency_floor([["a", "c"], ["b", "d"]],
                                    {"agents": agents, "delay_ms": delay})
    assert floor == pytest.approx(0.060 + 0.090)
    links = {"agents": agents, "delay_ms": delay}
    grid = [["a", "c"], ["b", "d"]]
    # local steps: the exchange once a round; one round late, hidden by the next round
    assert stepsplit.latency_floor(grid, links, 3) == pytest.approx(0.060 + 0.030)
    assert stepsplit.latency_floor(grid, links, 3, 1) == pytest.approx(0.060)
    assert stepsplit.latency_floor(grid, links, 1, 1) == pytest.approx(0.060 + 0.090)


def test_the_checks_share_is_their_seconds_over_the_steps_and_the_worst_rank() -> None:
    evs = events()
    for e in evs:
        e["verify_s"] = 0.1 if e["stage"] == 0 else 0.02
        e["rank"] = e["stage"]
    evs.append({"event": "step", "step": 4, "rank": 2, "step_s": 1.0})  # an older worker's
    got = stepsplit.checks_share(evs)
    assert got is not None
    assert got["share"] == pytest.approx(0.24 / 4.0)  # steps 2 and 3 of ranks 0 and 1
    assert got["worst_rank_share"] == pytest.approx(0.1)
    assert got["verify_s_per_step"] == pytest.approx(0.06)
    assert stepsplit.checks_share(events()) is None  # no step says
