"""The registry owns every change of an agent's state: each is logged with its reason and
fires the same callbacks, whether heartbeats stopped, the job found the agent unreachable,
or the agent said goodbye."""

from __future__ import annotations

import logging

import pytest

from coordinator.daemon.registry import ALIVE, LEFT, LOST, AgentRecord, Registry
from protos.dtfm.v1 import common_pb2, coordinator_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _registry(clock: Clock) -> tuple[Registry, list[str], list[list[str]]]:
    changes: list[str] = []
    lost: list[list[str]] = []

    def on_lost(records: list[AgentRecord]) -> None:
        lost.append([r.agent_id for r in records])

    registry = Registry(5.0, clock=clock, on_change=lambda: changes.append("change"),
                        on_lost=on_lost)
    for name in ("a", "b"):
        registry.join(common_pb2.AgentInfo(agent_id=name, host="127.0.0.1", port=9,
                                           device=common_pb2.DeviceInfo(kind="cpu")))
    changes.clear()
    return registry, changes, lost


def _beat(registry: Registry, agent_id: str) -> None:
    registry.heartbeat(coordinator_pb2.ProgressReport(
        agent_id=agent_id, worker_state=common_pb2.WORKER_STATE_IDLE))


def test_mark_lost_is_logged_and_fires_what_silence_fires(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    registry, changes, lost = _registry(clock)
    with caplog.at_level(logging.WARNING, "coordinator.daemon.registry"):
        rec = registry.mark_lost("b", "unreachable from its peers")
    assert rec is not None and rec.state == LOST
    assert "agent b lost: unreachable from its peers" in caplog.text
    assert changes == ["change"] and lost == [["b"]]
    assert registry.mark_lost("b", "again") is None and lost == [["b"]]  # no change, no call
    assert registry.mark_lost("nobody", "x") is None
    clock.now += 6.0  # a falls silent
    assert [r.agent_id for r in registry.sweep()] == ["a"]
    assert lost == [["b"], ["a"]] and changes == ["change", "change"]


def test_a_heartbeat_after_mark_lost_brings_the_agent_back_and_says_why_it_was_out(
        caplog: pytest.LogCaptureFixture) -> None:
    registry, changes, _ = _registry(Clock())
    registry.mark_lost("b", "unreachable from its peers")
    changes.clear()
    with caplog.at_level(logging.WARNING, "coordinator.daemon.registry"):
        _beat(registry, "b")
    rec = registry.get("b")
    assert rec is not None and rec.state == ALIVE and changes == ["change"]
    assert "agent b is alive again" in caplog.text
    assert "marked lost (unreachable from its peers)" in caplog.text


def test_leave_marks_left_without_calling_it_lost(caplog: pytest.LogCaptureFixture) -> None:
    registry, changes, lost = _registry(Clock())
    with caplog.at_level(logging.INFO, "coordinator.daemon.registry"):
        rec = registry.leave("a", "agent shutting down")
    assert rec is not None and rec.state == LEFT
    assert "agent a left: agent shutting down" in caplog.text
    assert changes == ["change"] and lost == []
    assert registry.leave("a", "twice") is rec and changes == ["change"]
    assert registry.leave("nobody", "x") is None
    assert [r.agent_id for r in registry.alive()] == ["b"]


def test_a_heartbeat_keeps_no_secret() -> None:
    """The row feeds every status answer: the report's secret, already checked, is not kept
    (issue 41 item 1; the whole path with real agents: test_secrets_stay.py)."""
    registry, _, _ = _registry(Clock())
    secret = registry.get("a").secret  # type: ignore[union-attr]
    rec = registry.heartbeat(coordinator_pb2.ProgressReport(agent_id="a", agent_secret=secret,
                                                            step=3))
    assert rec is not None and rec.progress.step == 3 and rec.progress.agent_secret == ""
    assert secret not in str(rec.to_proto())
