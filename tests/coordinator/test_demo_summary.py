"""`coordinator demo`'s last word: where the loss went, how long it took, what to try next."""

from __future__ import annotations

from coordinator.commands.demo import summary, summary_text
from protos.dtfm.v1 import common_pb2, coordinator_pb2


def _status() -> coordinator_pb2.ClusterStatus:
    return coordinator_pb2.ClusterStatus(
        agents=[coordinator_pb2.AgentStatus() for _ in range(4)],
        job=coordinator_pb2.JobStatus(model="gpt-tiny", step=80, total_steps=80),
        plan=common_pb2.Plan(stages=2, replicas=2, cost=0.0249))


def test_the_summary_says_where_the_loss_went_how_long_and_what_next() -> None:
    history = coordinator_pb2.JobHistory(points=[
        coordinator_pb2.HistoryPoint(step=1, loss=0.0, step_s=0.0),  # not the last stage's
        coordinator_pb2.HistoryPoint(step=2, loss=5.61, step_s=0.30),
        coordinator_pb2.HistoryPoint(step=40, loss=3.20, step_s=0.50),
        coordinator_pb2.HistoryPoint(step=80, loss=2.43, step_s=0.40)])
    s = summary(history, _status(), seconds=95.04)
    assert (s["first_step"], s["first_loss"], s["last_step"], s["last_loss"]) == (
        2, 5.61, 80, 2.43)
    assert s["steps"] == 80 and s["seconds"] == 95.0 and s["step_s"] == 0.4
    text = summary_text(s)
    first, *rest = text.splitlines()
    assert first == ("demo: trained 80 steps of gpt-tiny on 4 agents (2 stages x 2 replicas) in "
                     "95 s (0.40 s a step); loss 5.610 at step 2 -> 2.430 at step 80; plan cost "
                     "0.0249 s")
    assert any("sudo .venv/bin/coordinator demo --wan world" in line for line in rest)
    assert any('README.md, "Running a real cluster"' in line for line in rest)


def test_a_summary_without_a_reported_loss_says_so() -> None:
    s = summary(coordinator_pb2.JobHistory(), _status(), seconds=10.0)
    assert "no loss reported" in summary_text(s) and s["step_s"] == 0.0
