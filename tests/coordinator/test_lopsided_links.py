"""A bandwidth that reads far under its reverse gets a second, quiet probe, and keeps the
higher of its two readings (coordinator/links/figures.py `lopsided_bandwidth`,
`LinkMeasurer._second_looks`).

Seen under load: `coordinator demo --wan world --nat 3` read Frankfurt->Seoul at 2.1 Mbit/s
where Seoul->Frankfurt read 8.8 and the emulated link carries 8.9 both ways; rank order,
which put the two in one data-parallel group, was predicted at 8.48 s a step and ran 4.10.

Agents here are coroutines answering the real `LinkMeasurer` through the real `Registry`'s
command queues (as in test_punched_links.py); each bandwidth probe takes a moment, so probes
that overlap can be seen.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import pytest

from coordinator.links import figures
from coordinator.links.measure import LinkMeasurer
from coordinator.links.store import LinkStore
from dtfm.net import reach
from protos.dtfm.v1 import common_pb2, coordinator_pb2
from tests.coordinator.joined import measured, registry_with, report

BANDWIDTH = coordinator_pb2.MEASURE_KIND_BANDWIDTH
IDS = ["a", "b", "c", "d"]
RATE = 0.01  # Gbit/s, every link both ways


@dataclass
class Agents:
    """Every link reads RATE, but for the readings `readings` lists per link, in turn."""

    readings: dict[tuple[str, str], list[float]]
    measurer: LinkMeasurer | None = None
    probes: list[tuple[str, str]] = field(default_factory=list)
    # each bandwidth command: its links, and when it began and ended (the loop's clock)
    spans: list[tuple[tuple[tuple[str, str], ...], float, float]] = field(default_factory=list)

    def alone(self, link: tuple[str, str], nth: int) -> bool:
        """Whether the `nth` probe of `link` ran while no other bandwidth probe did."""
        mine = [s for s in self.spans if link in s[0]][nth]
        return not any(s is not mine and s[1] < mine[2] and mine[1] < s[2]
                       for s in self.spans)

    async def serve(self, agent_id: str) -> None:
        assert self.measurer is not None
        record = self.measurer.registry.get(agent_id)
        assert record is not None
        while True:
            cmd = (await record.commands.get()).measure
            samples = []
            if cmd.kind == BANDWIDTH:
                loop = asyncio.get_running_loop()
                began = loop.time()
                await asyncio.sleep(0.02)
                self.spans.append((tuple((agent_id, p.agent_id) for p in cmd.peers), began,
                                   loop.time()))
            for p in cmd.peers:
                link = (agent_id, p.agent_id)
                gbps = 0.0
                if cmd.kind == BANDWIDTH:
                    self.probes.append(link)
                    queue = self.readings.get(link, [])
                    gbps = queue.pop(0) if queue else RATE
                samples.append(common_pb2.LinkSample(peer_id=p.agent_id, reachable=True,
                                                     delay_ms=20.0, bandwidth_gbps=gbps))
            report(self.measurer, agent_id, cmd.round_id, samples)


async def _measure(readings: dict[tuple[str, str], list[float]]) -> tuple[Agents, LinkStore]:
    registry = registry_with({a: reach.EVERYWHERE for a in IDS})
    store = LinkStore()
    agents = Agents(readings)
    agents.measurer = LinkMeasurer(registry, store, probe_timeout_s=5.0)
    await measured(agents.measurer, registry, [agents.serve(i) for i in IDS])
    return agents, store


@pytest.mark.timeout(60)
def test_a_link_read_low_against_its_reverse_is_probed_again_alone_and_keeps_the_higher(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        agents, store = asyncio.run(_measure({("a", "b"): [0.002, RATE]}))
    assert agents.probes.count(("a", "b")) == 2  # the second look
    assert all(agents.probes.count(link) == 1 for link in agents.probes if link != ("a", "b"))
    assert agents.alone(("a", "b"), 1)  # the second look ran alone
    assert not agents.alone(("a", "b"), 0)  # the first, in the rotation beside others
    assert store.entries["a", "b"].bandwidth_gbps == RATE
    assert "probing 1 links again, one at a time" in caplog.text
    assert "link a->b: 2.0 Mbit/s, then 10.0: keeps 10.0 Mbit/s" in caplog.text


@pytest.mark.timeout(60)
def test_an_asymmetric_link_stays_and_a_lower_second_reading_never_replaces_the_first() -> None:
    # a home uplink: the same low figure twice; and a link whose second look read lower still
    agents, store = asyncio.run(_measure({("a", "b"): [0.001, 0.001],
                                          ("c", "d"): [0.003, 0.002]}))
    assert store.entries["a", "b"].bandwidth_gbps == 0.001
    assert store.entries["c", "d"].bandwidth_gbps == 0.003
    assert store.entries["b", "a"].bandwidth_gbps == RATE  # nothing made symmetric


def test_the_most_lopsided_links_are_looked_at_first_and_their_number_is_bounded() -> None:
    store = LinkStore()
    ids = [f"n{i}" for i in range(12)]
    for i, a in enumerate(ids):
        for b in ids:
            if a != b:
                low = i < 8 and b == ids[i + 1]  # n0->n1 .. n7->n8 read low, n0 the lowest
                gbps = RATE * (0.1 + 0.01 * i) if low else RATE
                store.record(a, common_pb2.LinkSample(peer_id=b, reachable=True, delay_ms=5.0,
                                                      bandwidth_gbps=gbps))
    found = figures.lopsided_bandwidth(store, ids)
    assert found == [(ids[i], ids[i + 1]) for i in range(figures.MAX_SECOND_LOOKS)]
    # within LOPSIDED of the reverse: an honest spread, no second look
    store.record("n0", common_pb2.LinkSample(peer_id="n1", reachable=True, delay_ms=5.0,
                                             bandwidth_gbps=RATE / (figures.LOPSIDED * 0.9)))
    assert ("n0", "n1") not in figures.lopsided_bandwidth(store, ids)
