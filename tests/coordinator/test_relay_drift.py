"""A relay that slows is drift (issue 32): what the re-planner and the data plane price a
relayed pair at once a relay's hops have been re-measured.

The store's figure for a relayed link is its cheapest relay's; the running epoch's pairs
meet at the relay its data plane chose. Pinned here: the running plan is priced through the
relay its pairs use (the slowed one), a new plan through the cheapest now, and the data plane
prices the coordinator's relay from its own hops, not from the cheapest relay's figure.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from coordinator.daemon.registry import AgentRecord, Registry
from coordinator.job.dataplane import COORDINATOR, pair_relays
from coordinator.job.weigh import through_relays, with_links
from coordinator.links import relayed
from coordinator.links.measure import LinkMeasurer
from coordinator.links.store import RELAYED, REVERSE, LinkEntry, LinkStore
from coordinator.scheduler.network import Network
from coordinator.scheduler.relaychoice import Path
from dtfm.core.layout import Layout
from dtfm.net import reach
from protos.dtfm.v1 import common_pb2
from tests.coordinator.test_job import Cluster, config
from tests.coordinator.test_relayed_links import SITE, Agents

SLOW_HOP, FAST_HOP = (100.0, 0.01), (5.0, 0.1)  # ms, Gbit/s


def _entry(figures: tuple[float, float], path: str = "") -> LinkEntry:
    return LinkEntry(figures[0], figures[1], True, "", 0.0, "", path)


def _slowed_coordinator() -> LinkStore:
    """n1 and n2 dial only; their hops to the coordinator slowed, those to relay agent r
    are fast; the pair priced (cheapest: through r)."""
    store = LinkStore()
    for x in ("n1", "n2"):
        store.entries[x, relayed.RELAY] = _entry(SLOW_HOP)
        store.entries[x, "r"] = _entry(FAST_HOP)
        store.entries["r", x] = _entry(FAST_HOP, REVERSE)
    relayed.price(store, [("n1", "n2")], ["r"])
    return store


def test_relayed_figures_go_through_the_pairs_own_relay_or_the_cheapest() -> None:
    store = _slowed_coordinator()
    links = [("n1", "n2"), ("n2", "n1")]
    cheapest = relayed.relayed_figures(store, links)
    assert cheapest == {k: Path(10.0, 0.1) for k in links}
    assert store.entries["n1", "n2"].path == RELAYED
    routed = relayed.relayed_figures(store, links, {("n2", "n1"): relayed.RELAY})
    assert routed == {k: Path(200.0, 0.01) for k in links}  # either order of the pair
    assert relayed.relayed_figures(store, links, {("n1", "n2"): "r"}) == cheapest
    assert relayed.relayed_figures(store, links, {}) == {}  # no route: no figure
    assert relayed.coordinator_hop(store, "n1") == Path(*SLOW_HOP)
    assert relayed.coordinator_hop(store, "r") is None


def test_with_links_sets_only_the_named_links_of_known_agents() -> None:
    net = Network.measured(np.full((3, 3), 7.0), np.full((3, 3), 1.0))
    out = with_links(net, ["a", "b", "c"], {("a", "c"): (99.0, 0.5), ("a", "zz"): (1.0, 1.0)})
    assert out.delay_ms[0, 2] == 99.0 and out.bandwidth_gbps[0, 2] == 0.5
    assert out.delay_ms[2, 0] == 7.0 and out.delay_ms[0, 0] == 0.0


def test_the_running_plan_pays_the_relay_its_pairs_meet_at_a_new_one_the_cheapest() -> None:
    job = Cluster(config()).job
    ids = ["r", "x", "n1", "n2"]
    job.links.entries.update(_slowed_coordinator().entries)
    job.planner.relayed = ["n1->n2", "n2->n1"]
    job.planner.relays = {("n1", "n2"): relayed.RELAY}  # the epoch chose the coordinator
    net = Network.measured(np.full((4, 4), 10.0), np.full((4, 4), 0.1))
    grid = [[2, 0], [3, 1]]  # n1 - n2 pipeline neighbours: two relayed flows
    running, cheapest = job.replan.as_routed(net, ids, grid)
    assert cheapest.delay_ms[2, 3] == 10.0 and cheapest.bandwidth_gbps[2, 3] == 0.1
    assert running.delay_ms[2, 3] == running.delay_ms[3, 2] == 200.0
    assert running.bandwidth_gbps[2, 3] == pytest.approx(0.01 / 2)  # two flows share it
    assert running.delay_ms[0, 1] == 10.0  # direct links as measured
    job.planner.relays = {("n1", "n2"): "r"}
    assert job.replan.as_routed(net, ids, grid)[0].delay_ms[2, 3] == 10.0


def _rec(i: int, verdict: int) -> AgentRecord:
    info = common_pb2.AgentInfo(agent_id=f"a{i}", host=f"10.0.0.{i}", port=7071,
                                data_port=7072, relay_port=7171 if i == 0 else 0)
    return AgentRecord(info, 0.0, 0.0, reach=common_pb2.ReachStatus(verdict=verdict))


def test_the_coordinators_relay_is_priced_from_its_own_hops_not_the_cheapest_relays() -> None:
    """Rank 0 a relay agent, ranks 1-3 dial only; every direct hop 10 ms. The relayed links
    in the net carry the cheapest relay's price (rank 0's, 20 ms): the coordinator's slowed
    hops (100 ms, 100 Mbit/s each) must not borrow it, so both talking pairs meet at rank 0."""
    recs = [_rec(0, reach.EVERYWHERE)] + [_rec(i, reach.NOWHERE) for i in (1, 2, 3)]
    delay = np.full((4, 4), 20.0)
    delay[0, :] = delay[:, 0] = 10.0
    links = (Network.measured(delay, np.ones((4, 4))), [0, 1, 2, 3], Layout(2, 2), None)
    dial_only = [(1, 2), (1, 3), (2, 3)]
    slow = [None, *[Path(100.0, 0.1)] * 3]
    chosen = pair_relays(recs, dial_only, links, True, slow)
    assert set(chosen.values()) == {"10.0.0.0:7171"}, chosen
    # a coordinator whose own hops are fast takes the pairs the agent's shared uplink loses
    fast = [None, *[Path(1.0, 1.0)] * 3]
    assert COORDINATOR in pair_relays(recs, dial_only, links, True, fast).values()


def test_a_re_measurement_probes_a_relayed_pairs_hops_to_its_relay_agent_not_the_pair() -> None:
    links = {("n1", "n2"), ("n2", "n1"), ("x", "n1")}
    relayed_links = {("n1", "n2"), ("n2", "n1"), ("n3", "n4")}
    assert through_relays(links, relayed_links, {("n2", "n1"): "r"}, relayed.RELAY) == {
        ("x", "n1"), ("n1", "r"), ("n2", "r")}
    # at the coordinator's relay: the sweep measures those hops anyway
    assert through_relays(links, relayed_links, {("n1", "n2"): relayed.RELAY},
                          relayed.RELAY) == {("x", "n1")}


@pytest.mark.timeout(60)
def test_a_relay_agent_whose_hops_slowed_stops_being_the_pairs_price(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """n2 and n3 dial only and meet at relay agent a0 (nearer than the coordinator). Its
    hops lose rate; a re-measurement probes just those hops (n2->a0, n3->a0: the re-plan's
    bandwidth pass, no latency pass, no probe of the pair itself), and the pair is priced
    again from them: through the coordinator now. Before, a pair already priced kept its
    relay agent's figure, and a0->n3 kept the figure taken the other way at the start."""
    monkeypatch.setitem(SITE, "a0", (0.0, 10.0))
    monkeypatch.setitem(SITE, relayed.RELAY, (5.0, 10.0))

    async def run() -> LinkStore:
        registry = Registry(liveness_timeout_s=60)
        for i, agent_id in enumerate(["a0", "a1", "n2", "n3"]):
            info = common_pb2.AgentInfo(agent_id=agent_id, host="192.168.1.2", port=7000 + i,
                                        relay_port=7300 if agent_id == "a0" else 0)
            record = registry.get(registry.join(info).agent_id)
            assert record is not None
            record.reach.verdict = reach.NOWHERE if agent_id in ("n2", "n3") else reach.EVERYWHERE
        store = LinkStore()
        measurer = LinkMeasurer(registry, store, probe_timeout_s=2.0)
        agents = Agents(registry, {"n2", "n3"})
        agents.measurer = measurer
        servers = [asyncio.create_task(agents.serve(i)) for i in ("a0", "a1", "n2", "n3")]
        try:
            await measurer.measure(registry.alive())
            assert "relay agent a0" in store.entries["n2", "n3"].estimate
            monkeypatch.setitem(SITE, "a0", (0.0, 0.01))  # a0's uplink slows
            agents.asked.clear()
            await measurer.measure(registry.alive(), latency=False,
                                   bandwidth_links={("n2", "a0"), ("n3", "a0")})
            assert {(a, p) for a, _, p, _ in agents.asked} == {("n2", "a0"), ("n3", "a0")}
        finally:
            for s in servers:
                s.cancel()
            await asyncio.gather(*servers, return_exceptions=True)
        return store

    store = asyncio.run(run())
    assert store.entries["a0", "n3"].bandwidth_gbps == 0.01  # taken the other way again
    for x, y in (("n2", "n3"), ("n3", "n2")):
        entry = store.entries[x, y]
        assert entry.path == RELAYED and "via the coordinator" in entry.estimate, entry
        assert entry.delay_ms == pytest.approx(30.0 + 40.0 + 2 * 5.0)
