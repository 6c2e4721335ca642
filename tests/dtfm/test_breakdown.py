"""The step breakdown's arithmetic (`dtfm.core.breakdown`): a worker's nested timers become
disjoint parts that add up to the measured step, each second counted once."""

from __future__ import annotations

import math

import pytest

from dtfm.core.breakdown import Breakdown, line, mean, measured


def test_a_synchronous_steps_parts_add_up_and_the_codec_counts_once() -> None:
    # 0.30 s compute holds 0.02 s of data-parallel codec work done in backward's hooks; the
    # 0.05 s of dp_s holds 0.01 s more; the pipeline's own codec took 0.03 s
    ev = {"step_s": 1.0, "compute_s": 0.30, "recv_wait_s": 0.25, "send_wait_s": 0.05,
          "pp_wait_s": 0.30, "dp_s": 0.05, "sync_s": 0.10, "codec_s": 0.06,
          "pp_codec_s": 0.03, "codec_hidden_s": 0.02, "outer_s": 0.0}
    b = measured(ev)
    assert b.compute == pytest.approx(0.28)
    assert b.codec == pytest.approx(0.06)
    assert b.sync_wait == pytest.approx(0.04)
    assert b.pipeline_wait == pytest.approx(0.30)
    assert b.norm_wait == pytest.approx(0.10)
    assert b.other == pytest.approx(1.0 - 0.28 - 0.06 - 0.04 - 0.30 - 0.10)
    assert b.total() == pytest.approx(b.step_s)


def test_a_sync_point_counts_the_whole_outer_sync_once() -> None:
    # local steps: dp_s (0.5 s) and the sync point's codec (0.1 s) lie inside outer_s (0.7 s)
    ev = {"step_s": 2.0, "compute_s": 0.5, "recv_wait_s": 0.3, "send_wait_s": 0.0,
          "dp_s": 0.5, "sync_s": 0.1, "codec_s": 0.15, "pp_codec_s": 0.05,
          "codec_hidden_s": 0.0, "outer_s": 0.7}
    b = measured(ev)
    assert b.sync_wait == pytest.approx(0.6)
    assert b.codec == pytest.approx(0.15)
    assert b.other == pytest.approx(2.0 - 0.5 - 0.3 - 0.1 - 0.6 - 0.15)
    assert b.total() == pytest.approx(2.0)


def test_an_older_workers_event_still_adds_up() -> None:
    nan = math.nan
    b = measured({"step_s": 0.5, "compute_s": 0.2, "pp_wait_s": 0.1, "dp_s": 0.05,
                  "sync_s": nan, "codec_s": nan})
    assert (b.compute, b.pipeline_wait, b.sync_wait, b.norm_wait, b.codec) == (
        0.2, 0.1, 0.05, 0.0, 0.0)
    assert b.total() == pytest.approx(0.5)


def test_the_lost_time_is_the_part_by_part_difference() -> None:
    wan = Breakdown(step_s=1.0, compute=0.4, pipeline_wait=0.4, sync_wait=0.1, other=0.1)
    free = Breakdown(step_s=0.7, compute=0.4, pipeline_wait=0.2, other=0.1)
    lost = wan.minus(free)
    assert lost.total() == pytest.approx(lost.step_s) == pytest.approx(0.3)
    assert lost.pipeline_wait == pytest.approx(0.2)
    assert lost.compute == 0.0


def test_mean_and_line() -> None:
    a = Breakdown(step_s=1.0, compute=0.5, pipeline_wait=0.5)
    b = Breakdown(step_s=2.0, compute=1.0, other=1.0)
    m = mean([a, b])
    assert (m.step_s, m.compute, m.pipeline_wait, m.other) == (1.5, 0.75, 0.25, 0.5)
    assert m.total() == pytest.approx(m.step_s)
    assert mean([]) == Breakdown()
    assert line(m) == "1.50 s = compute 0.75 + pipeline wait 0.25 + other 0.50"
    assert line(Breakdown(step_s=1.0, compute=0.5, transfer=0.5), predicted=True) == \
        "1.00 s = compute 0.50 + transfer 0.50"
