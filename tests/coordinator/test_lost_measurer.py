"""A measurer the registry loses ends its wait for that agent's report at once.

The real `LinkMeasurer` and `Registry`, with coroutine agents (as in test_punched_links.py): a0
and a1 answer every command; a2 takes its commands and never answers, as a frozen agent does,
and the registry then loses it. Its links are recorded unreachable long
before the probe deadline (300 s here: without the registry's word the round would wait it
out, and `measured`'s 30 s bound fails). The system test with a SIGSTOPped agent is
tests/coordinator/test_link_measurement.py's dead-peer test.
"""

from __future__ import annotations

import asyncio

import pytest

from coordinator.links.measure import LinkMeasurer
from coordinator.links.store import LinkStore
from dtfm.net import reach
from protos.dtfm.v1 import common_pb2
from tests.coordinator.joined import measured, registry_with, report

IDS = ("a0", "a1", "a2")


async def _answer(measurer: LinkMeasurer, agent_id: str) -> None:
    record = measurer.registry.get(agent_id)
    assert record is not None
    while True:
        cmd = (await record.commands.get()).measure
        report(measurer, agent_id, cmd.round_id, [
            common_pb2.LinkSample(peer_id=p.agent_id, reachable=p.agent_id != "a2",
                                  delay_ms=5.0, bandwidth_gbps=0.1) for p in cmd.peers])


async def _frozen(measurer: LinkMeasurer, agent_id: str) -> None:
    record = measurer.registry.get(agent_id)
    assert record is not None
    await record.commands.get()  # the command arrives; the agent never answers it
    measurer.registry.mark_lost(agent_id, "no heartbeat (the test froze it)")
    await asyncio.Event().wait()


async def _measure() -> tuple[common_pb2.LinkMatrix, LinkStore]:
    registry = registry_with(dict.fromkeys(IDS, reach.EVERYWHERE))
    store = LinkStore()
    measurer = LinkMeasurer(registry, store, probe_timeout_s=300.0)
    matrix = await measured(measurer, registry, [_answer(measurer, "a0"),
                                                 _answer(measurer, "a1"),
                                                 _frozen(measurer, "a2")])
    return matrix, store


@pytest.mark.timeout(60)
def test_a_lost_measurer_is_not_waited_for_and_its_links_are_unreachable() -> None:
    matrix, store = asyncio.run(_measure())
    assert {"a2->a0", "a2->a1"} <= set(matrix.unreachable), matrix.unreachable
    for peer in ("a0", "a1"):
        assert not store.entries["a2", peer].reachable
        assert "agent a2 did not answer" in store.entries["a2", peer].error
    assert store.entries["a0", "a1"].reachable and store.entries["a1", "a0"].reachable
