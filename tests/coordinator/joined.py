"""Helpers for link-measurement tests that drive a real LinkMeasurer with fake agents: a
registry of joined agents with given reachability verdicts, and a report that must be
accepted."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from coordinator.daemon.registry import Registry
from coordinator.links.measure import LinkMeasurer
from protos.dtfm.v1 import common_pb2, coordinator_pb2


def registry_with(verdicts: Mapping[str, int]) -> Registry:
    """Agents joined in order, every one at the same private address (192.168.1.2, as agents
    behind different NATs are: told apart by id only), each with its verdict."""
    registry = Registry(liveness_timeout_s=60)
    for i, (agent_id, verdict) in enumerate(verdicts.items()):
        registry.join(common_pb2.AgentInfo(agent_id=agent_id, host="192.168.1.2",
                                           port=7000 + i))
        record = registry.get(agent_id)
        assert record is not None
        record.reach.verdict = verdict
    return registry


def report(measurer: LinkMeasurer | None, agent_id: str, round_id: str,
           samples: Sequence[common_pb2.LinkSample]) -> None:
    """Hand `agent_id`'s samples for `round_id` to the measurer, which must take them."""
    assert measurer is not None
    error = measurer.on_report(coordinator_pb2.LinkReport(agent_id=agent_id, round_id=round_id,
                                                          samples=samples))
    assert error is None, error


async def measured(measurer: LinkMeasurer, registry: Registry,
                   agents: Sequence[Coroutine[Any, Any, None]]) -> common_pb2.LinkMatrix:
    """Run `measurer.measure` over every live agent while the fake agents' loops (`agents`)
    answer its commands; the loops are cancelled after."""
    servers = [asyncio.create_task(a) for a in agents]
    try:
        return await asyncio.wait_for(measurer.measure(registry.alive()), 30)
    finally:
        for s in servers:
            s.cancel()
        await asyncio.gather(*servers, return_exceptions=True)
