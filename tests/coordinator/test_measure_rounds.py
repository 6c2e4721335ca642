"""The coordinator's measurement schedule: who probes whom, and what may run side by side.

Agents here are coroutines that answer the real `LinkMeasurer` through the real `Registry`
command queues after a random delay; the network itself is tested in test_link_measurement.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from coordinator.daemon.registry import Registry
from coordinator.links.measure import PING_RATE, LinkMeasurer, Pings
from coordinator.links.store import LinkStore
from dtfm.core.limits import MAX_PING_SPREAD_S
from protos.dtfm.v1 import common_pb2, coordinator_pb2

LATENCY = coordinator_pb2.MEASURE_KIND_LATENCY
BANDWIDTH = coordinator_pb2.MEASURE_KIND_BANDWIDTH


class FakeAgents:
    """Answers measure commands after a random pause, and records what ran concurrently."""

    def __init__(self, registry: Registry, ids: list[str], silent: frozenset[str] = frozenset(),
                 seed: int = 0) -> None:
        self.registry = registry
        self.ids = ids
        self.silent = silent
        self.rng = random.Random(seed)
        self.measurer: LinkMeasurer | None = None
        self.running: set[tuple[str, str]] = set()  # bandwidth transfers in progress
        self.overlaps: list[str] = []
        self.max_concurrent = 0
        self.commands: list[tuple[str, int, tuple[str, ...]]] = []
        self.pings: set[tuple[int, float]] = set()  # (count, spread) of the latency commands
        self.delay_of: dict[tuple[str, str], float] = {}  # reported delays other than 10 ms

    async def serve(self, agent_id: str) -> None:
        record = self.registry.get(agent_id)
        assert record is not None
        while True:
            command = await record.commands.get()
            cmd = command.measure
            peers = tuple(p.agent_id for p in cmd.peers)
            self.commands.append((agent_id, cmd.kind, peers))
            if cmd.kind == LATENCY:
                self.pings.add((cmd.ping_count, cmd.ping_spread_s))
            if agent_id in self.silent:
                continue
            asyncio.get_running_loop().create_task(self._answer(agent_id, cmd, peers))

    async def _answer(self, agent_id: str, cmd: coordinator_pb2.MeasureLinksCommand,
                      peers: tuple[str, ...]) -> None:
        if cmd.kind == BANDWIDTH:
            (peer,) = peers
            for a, b in self.running:
                if a == agent_id or b == peer or {a, b} == {agent_id, peer}:
                    self.overlaps.append(f"{agent_id}->{peer} ran beside {a}->{b}")
            self.running.add((agent_id, peer))
            self.max_concurrent = max(self.max_concurrent, len(self.running))
        await asyncio.sleep(self.rng.uniform(0.005, 0.03))
        if cmd.kind == BANDWIDTH:
            self.running.discard((agent_id, peers[0]))
        samples = [common_pb2.LinkSample(
            peer_id=p, reachable=p not in self.silent,
            delay_ms=self.delay_of.get((agent_id, p), 10.0),
            bandwidth_gbps=0.0 if p in self.silent else 1.0,
            error=f"{p} did not answer" if p in self.silent else "") for p in peers]
        assert self.measurer is not None
        error = self.measurer.on_report(coordinator_pb2.LinkReport(
            agent_id=agent_id, round_id=cmd.round_id, samples=samples))
        assert error is None, error


def _joined(n: int) -> tuple[Registry, list[str]]:
    """A registry with agents a0..a{n-1} joined."""
    registry = Registry(liveness_timeout_s=60)
    ids = [f"a{i}" for i in range(n)]
    for i, agent_id in enumerate(ids):
        registry.join(common_pb2.AgentInfo(agent_id=agent_id, host="127.0.0.1", port=1000 + i))
    return registry, ids


async def _measure(n: int, silent: frozenset[str] = frozenset(), seed: int = 0,
                   kind: type[FakeAgents] = FakeAgents, probe_timeout_s: float = 0.5,
                   delay_of: dict[tuple[str, str], float] | None = None,
                   sampled: bool = False, **measure_args: Any,
                   ) -> tuple[FakeAgents, common_pb2.LinkMatrix, LinkStore]:
    registry, ids = _joined(n)
    store = LinkStore()
    measurer = LinkMeasurer(registry, store, probe_timeout_s=probe_timeout_s)
    agents = kind(registry, ids, silent, seed)
    agents.measurer = measurer
    agents.delay_of = delay_of or {}
    servers = [asyncio.create_task(agents.serve(i)) for i in ids]
    try:
        matrix = await asyncio.wait_for(measurer.measure(registry.alive(), sampled=sampled,
                                                         **measure_args), 30)
    finally:
        for task in servers:
            task.cancel()
    return agents, matrix, store


def test_transfers_never_share_a_sender_a_receiver_or_a_link_with_its_reverse() -> None:
    for n, seed in ((2, 0), (5, 1), (8, 2), (8, 3)):
        agents, _, store = asyncio.run(_measure(n, seed=seed))
        assert agents.overlaps == []
        directed = {(a, b) for a in agents.ids for b in agents.ids if a != b}
        assert set(store.entries) == directed
        assert all(e.reachable and e.bandwidth_gbps == 1.0 and e.delay_ms == 10.0
                   for e in store.entries.values())
        bandwidth = sorted((a, p) for a, kind, peers in agents.commands if kind == BANDWIDTH
                           for p in peers)
        assert bandwidth == sorted(directed), "every directed link is probed exactly once"
        if n == 8:  # no barrier, but transfers do run side by side
            assert agents.max_concurrent >= 4


def test_a_measurement_beside_training_runs_at_most_max_probes_transfers_at_once() -> None:
    async def body() -> tuple[FakeAgents, int]:
        registry, ids = _joined(8)
        measurer = LinkMeasurer(registry, LinkStore(), probe_timeout_s=0.5)
        agents = FakeAgents(registry, ids)
        agents.measurer = measurer
        servers = [asyncio.create_task(agents.serve(i)) for i in ids]
        links = {(a, b) for a in ids for b in ids if a != b}
        try:
            matrix = await asyncio.wait_for(measurer.measure(
                registry.alive(), bandwidth_links=links, max_probes=2, pings=Pings(10, 3.0)), 30)
        finally:
            for task in servers:
                task.cancel()
        return agents, sum(x == x for x in matrix.bandwidth_gbps)

    agents, measured = asyncio.run(body())
    assert agents.max_concurrent == 2 and agents.overlaps == []
    assert measured == 8 * 7  # every directed link still measured
    # the pings as asked, ten, but over 3.85 s where 3 s would send more than PING_RATE a
    # second: 7 peers x (10 + a warm-up) / 20
    assert agents.pings == {(10, 11 * 7 / PING_RATE)}


def test_every_agent_pings_all_its_peers_in_one_command() -> None:
    agents, _, _ = asyncio.run(_measure(6))
    latency = [(a, set(peers)) for a, kind, peers in agents.commands if kind == LATENCY]
    assert sorted(a for a, _ in latency) == agents.ids
    assert all(peers == set(agents.ids) - {a} for a, peers in latency)
    # before a job: five each, paced to PING_RATE a second: 5 peers x (5 + a warm-up) / 20
    assert agents.pings == {(5, 6 * 5 / PING_RATE)}


def test_pings_keep_under_the_ping_rate_however_many_peers() -> None:
    """Pings are the load that made them read high (16 agents on 2 cores): a latency pass
    spreads each agent's pings so it sends at most PING_RATE a second, whatever was asked."""
    assert Pings().spread_for(5, 1) == 0.0  # 2 agents: the agents' own spacing keeps under it
    assert Pings().spread_for(5, 15) == 6 * 15 / PING_RATE  # 16 agents: 4.5 s, not 0.5 s
    assert Pings(5, 10.0).spread_for(5, 15) == 10.0  # asked for longer: as asked
    assert Pings(5, 1.0).spread_for(5, 2) == 1.0
    assert Pings().spread_for(5, 5000) == MAX_PING_SPREAD_S  # never past the agents' bound
    for count, peers in ((1, 3), (5, 15), (10, 63), (3, 200)):
        spread = Pings().spread_for(count, peers)
        rate = (count + 1) * peers / spread if spread else peers * 10.0
        assert rate <= PING_RATE * 1.0001 or spread == MAX_PING_SPREAD_S


def test_a_silent_agent_costs_one_deadline_and_is_not_probed_again() -> None:
    agents, matrix, store = asyncio.run(_measure(4, silent=frozenset({"a2"})))
    assert [a for a, _, _ in agents.commands].count("a2") == 1, "asked once, then skipped"
    assert not [a for a, kind, peers in agents.commands if kind == BANDWIDTH and "a2" in peers], \
        "no transfer to a peer that did not answer its pings"
    for other in ("a0", "a1", "a3"):
        assert not store.entries[("a2", other)].reachable
        assert not store.entries[(other, "a2")].reachable
        assert "a2" in store.entries[(other, "a2")].error
    assert store.entries[("a0", "a1")].reachable
    assert matrix is not None


class SpreadingAgents(FakeAgents):
    """Agents that spend a latency command's spread on its pings before they report."""

    async def _answer(self, agent_id: str, cmd: coordinator_pb2.MeasureLinksCommand,
                      peers: tuple[str, ...]) -> None:
        if cmd.kind == LATENCY:
            await asyncio.sleep(cmd.ping_spread_s)
        await super()._answer(agent_id, cmd, peers)


def test_a_latency_pass_waits_out_its_pings_spread_before_its_deadline() -> None:
    """Pings spread over 1 s report after it: the 0.5 s deadline counts from then, so no
    agent that did its pings as asked is taken for silent."""
    agents, _, store = asyncio.run(_measure(4, kind=SpreadingAgents,
                                            pings=Pings(spread_s=1.0)))
    assert agents.pings == {(5, 1.0)}  # the measurer's count, spread as asked
    assert len(store.entries) == 12 and all(e.reachable for e in store.entries.values()), \
        [e.error for e in store.entries.values() if not e.reachable]


class LyingAgents(FakeAgents):
    """a1 claims links it was not asked about, and 5000 Gbit/s on the one it was."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refusals: list[str] = []

    async def _answer(self, agent_id: str, cmd: coordinator_pb2.MeasureLinksCommand,
                      peers: tuple[str, ...]) -> None:
        if agent_id != "a1" or cmd.kind != BANDWIDTH:
            return await super()._answer(agent_id, cmd, peers)
        assert self.measurer is not None
        others = [p for p in self.ids if p not in peers and p != agent_id]
        forged = [common_pb2.LinkSample(peer_id=p, reachable=True, delay_ms=0.1,
                                        bandwidth_gbps=100.0) for p in [*peers, *others]]
        self.refusals.append(self.measurer.on_report(coordinator_pb2.LinkReport(
            agent_id=agent_id, round_id=cmd.round_id, samples=forged)) or "")
        huge = [common_pb2.LinkSample(peer_id=peers[0], reachable=True, delay_ms=1.0,
                                      bandwidth_gbps=5000.0)]
        assert self.measurer.on_report(coordinator_pb2.LinkReport(
            agent_id=agent_id, round_id=cmd.round_id, samples=huge)) is None


def test_reports_only_for_asked_peers_and_physical_rates() -> None:
    async def main() -> LinkStore:
        agents, _, store = await _measure(3, kind=LyingAgents, probe_timeout_s=2)
        assert isinstance(agents, LyingAgents)
        assert len(agents.refusals) == 2 and all("asked a1 to probe" in r
                                                 for r in agents.refusals)
        return store

    store = asyncio.run(main())
    for peer in ("a0", "a2"):
        entry = store.entries[("a1", peer)]
        assert not entry.reachable and "5000 Gbit/s" in entry.error
    assert store.entries[("a0", "a1")].reachable and store.entries[("a0", "a1")].bandwidth_gbps == 1


def test_delays_the_two_ends_contradict_are_dropped() -> None:
    async def main() -> tuple[FakeAgents, LinkStore]:
        jitter_and_lie = {("a1", "a2"): 400.0, ("a0", "a1"): 30.0}  # the second is jitter
        agents, _, store = await _measure(3, probe_timeout_s=2, delay_of=jitter_and_lie)
        return agents, store

    agents, store = asyncio.run(main())
    for pair in (("a1", "a2"), ("a2", "a1")):
        assert not store.entries[pair].reachable
        assert "one round trip" in store.entries[pair].error
    assert store.entries[("a0", "a1")].reachable and store.entries[("a1", "a0")].reachable
    # the liar was given a second look, the pair alone, both ways, before it was dropped
    latency = [(a, peers) for a, kind, peers in agents.commands if kind == LATENCY]
    assert sorted(latency[3:]) == [("a1", ("a2",)), ("a2", ("a1",))]


class OnceLoudAgents(FakeAgents):
    """a1 reads its link to a2 100 ms long in the first latency pass only, as a burst of pings
    on busy cores makes one end do."""

    async def _answer(self, agent_id: str, cmd: coordinator_pb2.MeasureLinksCommand,
                      peers: tuple[str, ...]) -> None:
        passes = sum(1 for a, kind, _ in self.commands if a == "a1" and kind == LATENCY)
        self.delay_of = {("a1", "a2"): 110.0} if passes == 1 else {}
        await super()._answer(agent_id, cmd, peers)


def test_a_pair_whose_ends_disagree_once_is_pinged_again_and_kept() -> None:
    """Before a job, a 16-agent world lost 7 agents to pairs whose ends disagreed by 100 ms
    in one burst of pings: a second, quiet look at those pairs alone keeps them."""
    agents, matrix, store = asyncio.run(_measure(4, kind=OnceLoudAgents))
    assert all(e.reachable for e in store.entries.values()), \
        [e.error for e in store.entries.values() if not e.reachable]
    assert store.entries[("a1", "a2")].delay_ms == 10.0  # the second look's figure
    latency = [(a, peers) for a, kind, peers in agents.commands if kind == LATENCY]
    assert len(latency) == 6 and sorted(latency[4:]) == [("a1", ("a2",)), ("a2", ("a1",))]


def test_only_missing_probes_just_a_newcomers_links() -> None:
    """A grow-back measures the new agent to and from everyone, not the n^2 links measured
    before; a link that failed last time is tried again."""
    async def main() -> tuple[FakeAgents, LinkStore]:
        registry, ids = _joined(5)
        store = LinkStore()
        for a in ids[:4]:  # measured in an earlier epoch, one of them failed since
            for b in ids[:4]:
                if a != b:
                    store.record(a, common_pb2.LinkSample(peer_id=b, reachable=True,
                                                          delay_ms=3.0, bandwidth_gbps=2.0))
        store.mark_unreachable("a0", "a1", "timed out")
        measurer = LinkMeasurer(registry, store, probe_timeout_s=0.5)
        agents = FakeAgents(registry, ids)
        agents.measurer = measurer
        servers = [asyncio.create_task(agents.serve(i)) for i in ids]
        try:
            await asyncio.wait_for(measurer.measure(registry.alive(), only_missing=True), 30)
        finally:
            for task in servers:
                task.cancel()
        return agents, store

    agents, store = asyncio.run(main())
    probed = {(a, p) for a, _, peers in agents.commands for p in peers}
    newcomer = {(a, b) for a in agents.ids for b in agents.ids
                if a != b and "a4" in (a, b)}
    assert probed == newcomer | {("a0", "a1")}
    assert store.entries[("a0", "a1")].reachable and store.entries[("a0", "a1")].delay_ms == 10.0
    assert store.entries[("a1", "a0")].delay_ms == 3.0, "a link measured before is kept"
