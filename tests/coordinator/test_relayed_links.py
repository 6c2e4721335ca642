"""Links to and between agents nobody can dial (issue 32): taken the other way, or relayed.

Agents here are coroutines answering the real `LinkMeasurer` through the real `Registry`'s
command queues, on a made-up network where each agent sits at a site with a one-way delay to
the "core" and an access bandwidth: a probe to an undialable agent fails (as a dial to a NAT'd
host does), every other probe reports the site figures. The coordinator (the relay) answers
probes too, as the agents see it through `RELAY`.
"""

from __future__ import annotations

import asyncio

import pytest

from coordinator.daemon.registry import Registry
from coordinator.links import relayed
from coordinator.links.measure import LinkMeasurer
from coordinator.links.store import RELAYED, REVERSE, LinkStore, matrix_to_json
from dtfm.net import reach
from protos.dtfm.v1 import common_pb2, coordinator_pb2
from tests.coordinator.joined import measured, registry_with, report

BANDWIDTH = coordinator_pb2.MEASURE_KIND_BANDWIDTH
# one-way ms to the core, access Gbit/s; the relay sits at the core
LAN = (0.5, 1.0)  # one site's LAN: ms one way, Gbit/s
SITE = {"a0": (10.0, 1.0), "a1": (20.0, 0.5), "n2": (30.0, 0.2), "n3": (40.0, 0.1),
        relayed.RELAY: (0.0, 10.0)}


def _figures(a: str, b: str) -> tuple[float, float]:
    return SITE[a][0] + SITE[b][0], min(SITE[a][1], SITE[b][1])


class Agents:
    """Answers measure commands; `hidden` agents cannot be dialled (probes to them fail)."""

    def __init__(self, registry: Registry, hidden: set[str], relay_answers: bool = True,
                 site: frozenset[str] = frozenset()) -> None:
        self.registry, self.hidden, self.relay_answers = registry, hidden, relay_answers
        self.site = site  # hidden agents of one LAN: they dial each other, at LAN figures
        self.measurer: LinkMeasurer | None = None
        self.asked: list[tuple[str, int, str, str]] = []  # (agent, kind, peer, address)

    async def serve(self, agent_id: str) -> None:
        record = self.registry.get(agent_id)
        assert record is not None
        while True:
            cmd = (await record.commands.get()).measure
            for p in cmd.peers:
                self.asked.append((agent_id, cmd.kind, p.agent_id, p.address))
            samples = []
            for p in cmd.peers:
                lan = {agent_id, p.agent_id} <= self.site
                fails = (p.agent_id in self.hidden and not lan) or (
                    p.agent_id == relayed.RELAY and not self.relay_answers)
                delay, gbps = LAN if lan else _figures(agent_id, p.agent_id)
                samples.append(common_pb2.LinkSample(
                    peer_id=p.agent_id, reachable=not fails, delay_ms=0.0 if fails else delay,
                    bandwidth_gbps=0.0 if fails or cmd.kind != BANDWIDTH else gbps,
                    error=f"peer {p.agent_id}: deadline exceeded" if fails else ""))
            report(self.measurer, agent_id, cmd.round_id, samples)


async def _measure(hidden: set[str], relay_answers: bool = True, cut: bool = False,
                   site: frozenset[str] = frozenset()
                   ) -> tuple[Agents, common_pb2.LinkMatrix, LinkStore]:
    """`hidden` agents cannot be dialled; found so (verdict nowhere) unless `cut`: then their
    links fail although the dial-back found them reachable (a path down between them).
    Hidden agents of `site` share one LAN: they reach each other, verdict some peers."""
    ids = ["a0", "a1", "n2", "n3"]
    registry = registry_with({a: (reach.EVERYWHERE if a not in hidden or cut
                                  else reach.SOME_PEERS if a in site else reach.NOWHERE)
                              for a in ids})
    store = LinkStore()
    measurer = LinkMeasurer(registry, store, probe_timeout_s=2.0)
    agents = Agents(registry, hidden, relay_answers, site)
    agents.measurer = measurer
    matrix = await measured(measurer, registry, [agents.serve(i) for i in ids])
    return agents, matrix, store


@pytest.mark.timeout(60)
def test_a_link_into_an_undialable_agent_is_measured_the_other_way() -> None:
    agents, matrix, store = asyncio.run(_measure({"n2"}))
    assert not matrix.unreachable, matrix.unreachable
    for peer in ("a0", "a1", "n3"):
        entry = store.entries[peer, "n2"]
        assert entry.reachable and entry.path == REVERSE
        back = store.entries["n2", peer]
        assert (entry.delay_ms, entry.bandwidth_gbps) == (back.delay_ms, back.bandwidth_gbps)
        assert back.path == ""
        assert entry.estimate.startswith(f"measured the other way (n2->{peer})"), entry.estimate
    table = matrix_to_json(matrix)
    assert "measured the other way" in table["estimated"]["a0->n2"]
    assert not table["relayed"] and not table["excluded"]
    assert not any(peer == relayed.RELAY for _, _, peer, _ in agents.asked), \
        "nobody needs the relay when one end of every pair can be dialled"


@pytest.mark.timeout(60)
def test_a_pair_neither_end_can_dial_is_priced_through_the_relay() -> None:
    agents, matrix, store = asyncio.run(_measure({"n2", "n3"}))
    assert not matrix.unreachable, matrix.unreachable
    assert sorted(matrix.relayed) == ["n2->n3", "n3->n2"]
    entry = store.entries["n2", "n3"]
    assert entry.path == RELAYED
    # both hops' delays; the narrower hop's bandwidth (one flow alone)
    assert entry.delay_ms == pytest.approx(SITE["n2"][0] + SITE["n3"][0])
    assert entry.bandwidth_gbps == pytest.approx(min(SITE["n2"][1], SITE["n3"][1]))
    assert "relayed via the coordinator" in entry.estimate
    # the unreachable ends measured their own link to the relay, dialling the coordinator at
    # the address they joined it by (an empty address in the command)
    hops = {(a, kind) for a, kind, peer, address in agents.asked
            if peer == relayed.RELAY and address == ""}
    assert {a for a, _ in hops} == {"n2", "n3"}
    assert {kind for _, kind in hops} == {coordinator_pb2.MEASURE_KIND_LATENCY, BANDWIDTH}
    assert store.entries["a0", "n3"].path == REVERSE
    assert matrix_to_json(matrix)["relayed"] == list(matrix.relayed)


@pytest.mark.timeout(60)
def test_two_agents_of_one_site_are_priced_direct_as_the_data_plane_connects_them() -> None:
    """n2 and n3 sit behind one NAT (some peers: each other). Their probes of each other got
    through: the pair is priced at its LAN's figures, not through the relay, and a grid with
    them as pipeline neighbours has no relayed flow to share the relay's uplink; the data
    plane dials that pair directly (`direct_dials`, the same probes). Behind NATs of their own
    (the contrast) the pair is relayed in both."""
    from coordinator.job.dataplane import peer_table
    from coordinator.scheduler import relay

    for site, want_relayed in ((frozenset({"n2", "n3"}), False), (frozenset(), True)):
        registry_agents, matrix, store = asyncio.run(_measure({"n2", "n3"}, site=site))
        ids = list(matrix.agent_ids)
        grid = [[ids.index("a0")], [ids.index("n2")], [ids.index("n3")], [ids.index("a1")]]
        flows = relay.relayed_flows(grid, relay.mask(ids, list(matrix.relayed)))
        records = [registry_agents.registry.get(i) for i in ("a0", "n2", "n3", "a1")]
        for r in records:
            assert r is not None
            r.info.data_port = 7100
        table = peer_table(records, relayed.direct_dials(records, store))
        if want_relayed:
            assert sorted(matrix.relayed) == ["n2->n3", "n3->n2"] and flows == 2
            assert table.relayed_pairs() == [(1, 2)]
            continue
        assert not matrix.relayed and not matrix.unreachable and flows == 0
        entry = store.entries["n2", "n3"]
        assert entry.path == "" and (entry.delay_ms, entry.bandwidth_gbps) == LAN
        assert {("n2", "n3"), ("n3", "n2")} <= relayed.direct_dials(records, store)
        assert table.relayed_pairs() == [] and table.can_dial(2, 1)


@pytest.mark.timeout(60)
def test_with_every_agent_undialable_every_pair_is_priced_through_the_relay() -> None:
    """No agent can be dialled, so no probe gets through anywhere: every pair is relayed
    (before, each agent counted as dead for lack of one good link, and a job of NATed
    agents only was left with one agent)."""
    _, matrix, store = asyncio.run(_measure({"a0", "a1", "n2", "n3"}))
    assert not matrix.unreachable, matrix.unreachable
    assert len(matrix.relayed) == 12
    assert store.entries["a0", "n3"].path == RELAYED


@pytest.mark.timeout(60)
def test_a_relayed_pair_whose_hop_to_the_relay_fails_stays_unreachable_and_says_why() -> None:
    _, matrix, store = asyncio.run(_measure({"n2", "n3"}, relay_answers=False))
    assert sorted(matrix.unreachable) == ["n2->n3", "n3->n2"]
    error = store.entries["n2", "n3"].error
    assert "neither n2 nor n3 can dial the other" in error
    assert "link to the relay (the coordinator) was not measured" in error


@pytest.mark.timeout(60)
def test_failed_links_between_agents_everyone_can_dial_are_neither_reversed_nor_relayed(
) -> None:
    """A dead path between two reachable agents (tests/system/test_wan_dead_link.py) must stay
    dead for failure handling to plan around: their job runs on gloo, which no relay
    carries."""
    agents, matrix, store = asyncio.run(_measure({"n2", "n3"}, cut=True))
    assert {"n2->n3", "n3->n2", "a0->n2"} <= set(matrix.unreachable), matrix.unreachable
    assert not matrix.relayed
    assert store.entries["a0", "n2"].path == "" and not store.entries["a0", "n2"].reachable
    assert not any(peer == relayed.RELAY for _, _, peer, _ in agents.asked)


def _entry(delay_ms: float, gbps: float, path: str = "") -> object:
    from coordinator.links.store import LinkEntry

    return LinkEntry(delay_ms, gbps, True, "", 0.0, "", path)


@pytest.mark.parametrize("agent_ms,via,delay", [(10.0, "relay agent a0", 20.0),
                                                (2000.0, "the coordinator", 70.0)])
def test_a_stranded_pair_is_priced_through_the_cheapest_relay(agent_ms: float, via: str,
                                                              delay: float) -> None:
    store = LinkStore()
    store.entries["n2", relayed.RELAY] = _entry(30.0, 0.2)
    store.entries["n3", relayed.RELAY] = _entry(40.0, 0.2)
    for x in ("n2", "n3"):  # a0 is dialable: x->a0 probed, a0->x taken the other way
        store.entries[x, "a0"] = _entry(agent_ms, 1.0)
        store.entries["a0", x] = _entry(agent_ms, 1.0, REVERSE)
    assert relayed.price(store, [("n2", "n3")], ["a0"]) == [("n2", "n3"), ("n3", "n2")]
    link = store.entries["n2", "n3"]
    assert link.path == RELAYED and link.delay_ms == delay and via in link.estimate
    # without relay agents the coordinator is the only relay
    assert relayed.price(store, [("n2", "n3")]) and store.entries["n2", "n3"].delay_ms == 70.0
