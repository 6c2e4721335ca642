"""Sampled link measurement: latency clusters, which links stand for which, and the measurer
probing only the samples' bandwidth and marking every other link as inferred."""

from __future__ import annotations

import asyncio

from coordinator.links.infer import latency_clusters, representatives, sampled_links, to_measure
from tests.coordinator.test_measure_rounds import BANDWIDTH, _measure

# three places: a0-a2 in one, a3-a5 in another, a6-a7 in a third (one-way ms between places)
PLACE = {f"a{i}": p for i, p in enumerate([0, 0, 0, 1, 1, 1, 2, 2])}
BETWEEN = {(0, 1): 40.0, (0, 2): 90.0, (1, 2): 70.0}


def one_way(a: str, b: str) -> float:
    pa, pb = PLACE[a], PLACE[b]
    return 1.0 if pa == pb else BETWEEN[min(pa, pb), max(pa, pb)]


def test_agents_in_one_place_form_one_cluster() -> None:
    clusters = latency_clusters(list(PLACE), one_way)
    assert clusters == [["a0", "a1", "a2"], ["a3", "a4", "a5"], ["a6", "a7"]]


def test_an_agent_with_its_own_path_is_not_clustered_with_its_neighbours() -> None:
    def delay(a: str, b: str) -> float:  # a1 is in place 0 but 30 ms further from place 1
        extra = 30.0 if {a, b} & {"a1"} and {PLACE[a], PLACE[b]} == {0, 1} else 0.0
        return one_way(a, b) + extra
    clusters = latency_clusters(list(PLACE), delay)
    assert ["a1"] in clusters and ["a0", "a2"] in clusters


def test_every_link_has_a_sample_and_samples_spread_over_members() -> None:
    clusters = latency_clusters(list(PLACE), one_way)
    stands_for = sampled_links(clusters)
    assert len(stands_for) == 8 * 7  # every ordered pair
    probed = to_measure(stands_for)
    assert len(probed) == 3 * 2 + 3 * 2  # one per ordered cluster pair, two inside each
    for (a, b), (c, d) in stands_for.items():
        assert (PLACE[a], PLACE[b]) == (PLACE[c], PLACE[d])
    senders = {c for c, _ in probed}
    assert len(senders) > 3  # not only each cluster's first member


def test_a_sampled_measurement_probes_only_samples_and_infers_the_rest() -> None:
    delays = {(a, b): one_way(a, b) for a in PLACE for b in PLACE if a != b}
    agents, _, store = asyncio.run(_measure(len(PLACE), delay_of=delays, sampled=True))
    probed = {(a, peers[0]) for a, kind, peers in agents.commands if kind == BANDWIDTH}
    assert len(probed) == 12
    assert not agents.overlaps
    inferred = {k: e for k, e in store.entries.items() if e.estimate.startswith("inferred")}
    assert len(inferred) == 8 * 7 - 12
    assert all(e.reachable and e.bandwidth_gbps == 1.0 for e in store.entries.values())
    (a, b), entry = next(iter(inferred.items()))
    assert "latency clusters" in entry.estimate and (a, b) not in probed


def test_clusters_hold_when_every_delay_reads_a_few_ms_high() -> None:
    # a loaded host: every measured delay 1.5-4 ms above the truth, 5 ms inside a place
    def delay(a: str, b: str) -> float:
        noise = 1.5 + (int(a[1]) * 7 + int(b[1]) * 3) % 5 * 0.6
        return (5.0 if PLACE[a] == PLACE[b] else one_way(a, b)) + noise
    assert latency_clusters(list(PLACE), delay) == [["a0", "a1", "a2"], ["a3", "a4", "a5"],
                                                   ["a6", "a7"]]


def test_places_a_few_ms_apart_stay_apart() -> None:
    # place 1 is 11 ms from place 0 (Virginia and Ohio), 5 ms inside each
    def delay(a: str, b: str) -> float:
        if PLACE[a] == PLACE[b]:
            return 5.0
        if {PLACE[a], PLACE[b]} == {0, 1}:
            return 11.0
        return one_way(a, b) + (15.0 if PLACE[a] == 1 or PLACE[b] == 1 else 0.0)
    clusters = latency_clusters(list(PLACE), delay)
    assert ["a0", "a1", "a2"] in clusters and ["a3", "a4", "a5"] in clusters


def test_links_that_moved_alike_between_two_places_share_one_probe() -> None:
    """A re-measurement probes one link for each group that moved alike between the same two
    places; a link between them that moved otherwise, or between other places, gets its own."""
    def delay(a: str, b: str) -> float:  # places 0 and 1 degraded: +100 ms, a2 -> a3 +300 ms
        extra = 100.0 if {PLACE[a], PLACE[b]} == {0, 1} else 0.0
        return one_way(a, b) + extra + (200.0 if (a, b) == ("a2", "a3") else 0.0)
    clusters = latency_clusters(list(PLACE), one_way)  # the places, as before the change
    moved = {(a, b) for a in PLACE for b in PLACE if {PLACE[a], PLACE[b]} == {0, 1}}
    moved.add(("a6", "a0"))
    stands_for = representatives(moved, clusters, delay)
    assert set(stands_for) == moved
    probed = to_measure(stands_for)
    assert probed == {("a0", "a3"), ("a2", "a3"), ("a3", "a0"), ("a6", "a0")}
    for (a, b), (c, d) in stands_for.items():
        assert (PLACE[a], PLACE[b]) == (PLACE[c], PLACE[d])
        assert abs(delay(a, b) - delay(c, d)) < 10.0
        assert stands_for[c, d] == (c, d)  # a probed link stands for itself


def test_a_re_measurement_probes_representatives_and_marks_the_rest_inferred() -> None:
    stands_for = {("a0", "a2"): ("a0", "a2"), ("a1", "a2"): ("a0", "a2"),
                  ("a1", "a3"): ("a0", "a2"), ("a3", "a0"): ("a3", "a0")}
    agents, _, store = asyncio.run(_measure(4, bandwidth_links=to_measure(stands_for),
                                            max_probes=2, infer=stands_for))
    probed = {(a, peers[0]) for a, kind, peers in agents.commands if kind == BANDWIDTH}
    assert probed == {("a0", "a2"), ("a3", "a0")}
    for link in (("a1", "a2"), ("a1", "a3")):
        assert store.entries[link].estimate == "inferred from a0->a2 (same latency clusters)"
        assert store.entries[link].bandwidth_gbps == 1.0
    assert store.entries["a0", "a2"].estimate == ""
