"""What the coordinator keeps and shows of a link whose bandwidth is only an estimate, and of
an agent whose host is not tuned for long links: the link store, `coordinator links` and
`coordinator status` (text and JSON) say so, so a person sees it."""

from __future__ import annotations

import asyncio
import logging

import pytest

from coordinator.cli import _links_text
from coordinator.commands.status import status_to_json, status_to_text
from coordinator.daemon.registry import Registry
from coordinator.links.measure import LinkMeasurer, _Pending
from coordinator.links.store import LinkStore, matrix_to_json
from protos.dtfm.v1 import common_pb2, coordinator_pb2

NOTE = "no steady rate: its 20 windows never agreed (3 of 20 moved no data); took the median"
SLOW = common_pb2.LinkSample(peer_id="b", delay_ms=171.0, bandwidth_gbps=0.0021,
                             reachable=True, estimated=True, estimate_note=NOTE)
SETTLED = common_pb2.LinkSample(peer_id="b", delay_ms=171.0, bandwidth_gbps=0.0021,
                                reachable=True)
SLOW_START = common_pb2.TuningAdvice(setting="net.ipv4.tcp_slow_start_after_idle",
                                     current="1", wanted="0", why="steps took 17 % longer")


def test_the_store_keeps_the_estimate_mark_until_a_settled_rate_replaces_it() -> None:
    store = LinkStore()
    store.record("a", SLOW, latency=False, bandwidth=True)
    assert store.entries[("a", "b")].estimate == NOTE
    store.record("a", common_pb2.LinkSample(peer_id="b", delay_ms=170.0, reachable=True),
                 latency=True, bandwidth=False)  # a later latency pass keeps the mark
    m = store.matrix(["a", "b"])
    assert list(m.estimated) == ["a->b"] and list(m.estimate_notes) == [NOTE]
    data = matrix_to_json(m)
    assert data["estimated"] == {"a->b": NOTE} and data["unreachable"] == []
    assert f"estimated bandwidth a->b: {NOTE}" in _links_text(data)
    store.record("a", SETTLED, latency=False, bandwidth=True)
    assert store.matrix(["a", "b"]).estimated == []
    assert "estimated" not in _links_text(matrix_to_json(store.matrix(["a", "b"])))


def test_an_estimate_without_a_note_is_still_marked() -> None:
    store = LinkStore()
    store.record("a", common_pb2.LinkSample(peer_id="b", bandwidth_gbps=0.002, reachable=True,
                                            estimated=True))
    assert store.entries[("a", "b")].estimate


def test_the_measurer_takes_an_estimated_sample_as_a_measured_link(
        caplog: pytest.LogCaptureFixture) -> None:
    store = LinkStore()
    measurer = LinkMeasurer(Registry(5.0), store)

    async def report() -> str | None:  # the round the measurer would have sent
        future = asyncio.get_running_loop().create_future()
        measurer._pending[("r1", "a")] = _Pending(future, coordinator_pb2.MEASURE_KIND_BANDWIDTH,
                                                  ("b",))
        return measurer.on_report(coordinator_pb2.LinkReport(agent_id="a", round_id="r1",
                                                             samples=[SLOW]))

    with caplog.at_level(logging.WARNING, logger="coordinator.links.measure"):
        assert asyncio.run(report()) is None
    assert store.entries[("a", "b")].reachable
    assert store.unreachable_agents(["a", "b"]) == []
    assert "a->b: bandwidth 2.10 Mbit/s is an estimate" in caplog.text


def _status() -> coordinator_pb2.ClusterStatus:
    store = LinkStore()
    store.record("a", SLOW)
    store.record("b", common_pb2.LinkSample(peer_id="a", delay_ms=171.0,
                                            bandwidth_gbps=0.0021, reachable=True))
    agents = [coordinator_pb2.AgentStatus(
        info=common_pb2.AgentInfo(agent_id=i, host="10.0.0.1", port=7071),
        state=coordinator_pb2.AGENT_STATE_ALIVE,
        progress=coordinator_pb2.ProgressReport(agent_id=i, tuning=tuning))
        for i, tuning in (("a", [SLOW_START]), ("b", [SLOW_START]), ("c", []))]
    return coordinator_pb2.ClusterStatus(agents=agents, links=store.matrix(["a", "b"]))


def test_status_json_carries_each_agents_tuning_and_the_estimated_links() -> None:
    data = status_to_json(_status())
    a, b, c = data["agents"]
    assert a["tuning"] == [{"setting": "net.ipv4.tcp_slow_start_after_idle", "current": "1",
                            "wanted": "0", "why": "steps took 17 % longer",
                            "line": "net.ipv4.tcp_slow_start_after_idle = 0"}]
    assert c["tuning"] == []
    assert data["links"]["estimated"] == {"a->b": NOTE}


def test_status_text_says_what_to_change_once_for_hosts_that_need_the_same_fix() -> None:
    text = status_to_text(_status())
    assert text.count("net.ipv4.tcp_slow_start_after_idle = 0") == 1
    assert "untuned host(s) a, b: apply deploy/sysctl.d/60-dtfm-wan.conf" in text
    assert "now 1: steps took 17 % longer" in text
    assert "links: 1 bandwidth(s) estimated" in text and "  a->b" in text


def test_the_registry_logs_an_agents_tuning_when_it_changes(
        caplog: pytest.LogCaptureFixture) -> None:
    registry = Registry(5.0)
    registry.join(common_pb2.AgentInfo(agent_id="a", host="h", port=1))
    beat = coordinator_pb2.ProgressReport(agent_id="a", tuning=[SLOW_START])
    with caplog.at_level(logging.WARNING, logger="coordinator.daemon.registry"):
        registry.heartbeat(beat)
        registry.heartbeat(beat)
    assert caplog.text.count("not tuned for long links") == 1
    assert "tcp_slow_start_after_idle is 1, wants 0" in caplog.text
