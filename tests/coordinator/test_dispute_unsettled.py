"""An epoch that cannot settle a dispute says so when it starts (coordinator/integrity/
dispute.py, `unsettled`): an operator who chose rank order without a spare agent, or a pinned
plan, learned it before only when a fault stayed unexcluded (issue 43)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from coordinator.integrity.dispute import unsettled
from coordinator.integrity.exclusion import JobIntegrity
from protos.dtfm.v1 import common_pb2
from tests.coordinator.test_job_states import FakeRegistry, Harness, config, run


def test_scheduled_placement_of_several_stages_settles_with_or_without_a_spare() -> None:
    assert unsettled("scheduled", 3, pinned=False, spare_free=False) == ""
    assert unsettled("scheduled", 3, pinned=False, spare_free=True) == ""


@pytest.mark.parametrize("kind,stages", [("rank-order", 3), ("random", 2), ("scheduled", 1)])
def test_a_placement_that_swaps_nobody_settles_only_with_a_spare(kind: str, stages: int) -> None:
    assert unsettled(kind, stages, pinned=False, spare_free=True) == ""
    said = unsettled(kind, stages, pinned=False, spare_free=False)
    assert "cannot be settled" in said and "no spare agent is free" in said
    assert "Start one agent more" in said
    assert ("--placement scheduled" in said) == (stages > 1)


def test_a_pinned_plan_settles_nothing_even_with_a_spare() -> None:
    said = unsettled("file", 3, pinned=True, spare_free=True)
    assert "pinned placement" in said and "coordinator plan" in said


def plan(integrity: JobIntegrity, replicas: int, why: str) -> None:
    integrity.plan_epoch([common_pb2.Assignment(epoch=1, stages=2, replicas=replicas, rank=r)
                          for r in range(2 * replicas)], 1, unsettled=why)


def test_the_job_warns_once_while_it_lasts_and_not_without_replicas(
        caplog: pytest.LogCaptureFixture) -> None:
    integrity = JobIntegrity(FakeRegistry(), SimpleNamespace(step=0))  # type: ignore[arg-type]
    why = unsettled("rank-order", 2, pinned=False, spare_free=False)
    with caplog.at_level(logging.WARNING, logger="coordinator.integrity.exclusion"):
        plan(integrity, 1, why)  # one replica: nothing to dispute, nothing said
        assert integrity.unsettled == "" and not caplog.records
        plan(integrity, 2, why)
        plan(integrity, 2, why)  # the next epoch, as unsettled: said once
        assert integrity.unsettled == why
        assert [r.getMessage() for r in caplog.records] == [f"integrity: {why}"]
        plan(integrity, 2, "")  # a spare joined
        plan(integrity, 2, why)  # and left again: said again
    assert len(caplog.records) == 2 and integrity.unsettled == why


@pytest.mark.parametrize("agents,verify,said", [(4, "auto", True), (5, "auto", False),
                                                (4, "off", False)])
def test_the_running_jobs_message_says_it(agents: int, verify: str, said: bool) -> None:
    """Rank order, 2 x 2: no spare among 4 agents (said), one among 5; nothing to settle
    without checks."""
    cfg = config()
    cfg.train.verify = verify  # type: ignore[assignment]

    async def body(h: Harness) -> None:
        await h.running_epoch(1)
        assert ("cannot be settled: no spare agent is free" in h.job.message) == said, (
            h.job.message)
    run(cfg, body, agents=agents)
