"""Stranded pairs punch-probed at link measurement and priced direct (issue 32).

Agents here are coroutines answering the real `LinkMeasurer` through the real `Registry`'s
command queues (as in test_relayed_links.py): probes into the two undialable agents n2 and n3
fail, every other probe reports made-up site figures, and a punch probe
(`MEASURE_KIND_PUNCH`) reports the pair's own direct link, `DIRECT`, or fails where the test
says the punch does not get through. The relay is a real `dtfm.net.relay.Relay` (not serving:
admission is bookkeeping), so what it admits and retires is what a coordinator's would.
The punch itself and the direct measurement run across emulated NATs in
tests/system/test_wan_punch_links.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from coordinator.daemon.config import JobConfig
from coordinator.daemon.registry import Registry
from coordinator.job.checkpoints import CheckpointTracker
from coordinator.job.epochplan import EpochPlanner
from coordinator.links import punchprobe, relayed
from coordinator.links.measure import LinkMeasurer
from coordinator.links.store import PUNCHED, RELAYED, LinkStore, matrix_arrays, matrix_to_json
from coordinator.scheduler import relay as relay_mask
from dtfm.net import reach
from dtfm.net.relay import Relay
from protos.dtfm.v1 import common_pb2, coordinator_pb2
from tests.coordinator.joined import measured, registry_with, report

PUNCH = coordinator_pb2.MEASURE_KIND_PUNCH
BANDWIDTH = coordinator_pb2.MEASURE_KIND_BANDWIDTH
SITE = {"a0": (10.0, 1.0), "a1": (20.0, 0.5), "n2": (30.0, 0.2), "n3": (40.0, 0.1),
        relayed.RELAY: (0.0, 10.0)}
DIRECT = (3.0, 0.8)  # n2 <-> n3 direct, as their punched connection measures it
HIDDEN = {"n2", "n3"}


@dataclass
class Planes:
    """What the measurer reads the relay and the switch from (the job's DataPlanes)."""

    relay: Relay | None
    hole_punch: bool = True


@dataclass
class Agents:
    registry: Registry
    punch_fails: set[str] = field(default_factory=set)  # agents whose punch does not get through
    direct: tuple[float, float] = DIRECT  # what a punch that got through measures
    measurer: LinkMeasurer | None = None
    punches: list[tuple[str, str, coordinator_pb2.PunchProbe]] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)  # relay epochs held during each punch

    async def serve(self, agent_id: str, relay: Relay | None) -> None:
        record = self.registry.get(agent_id)
        assert record is not None
        while True:
            cmd = (await record.commands.get()).measure
            samples = []
            for p in cmd.peers:
                if cmd.kind == PUNCH:
                    self.punches.append((agent_id, p.agent_id, cmd.punch))
                    self.admitted.append(len(relay.epochs()) if relay is not None else 0)
                    ok = agent_id not in self.punch_fails
                    delay, gbps = self.direct
                else:
                    ok = p.agent_id not in HIDDEN
                    delay = SITE[agent_id][0] + SITE[p.agent_id][0]
                    gbps = min(SITE[agent_id][1], SITE[p.agent_id][1])
                samples.append(common_pb2.LinkSample(
                    peer_id=p.agent_id, reachable=ok, delay_ms=delay if ok else 0.0,
                    bandwidth_gbps=gbps if ok and cmd.kind in (BANDWIDTH, PUNCH) else 0.0,
                    error="" if ok else f"peer {p.agent_id}: no way through"))
            report(self.measurer, agent_id, cmd.round_id, samples)


async def _measure(planes: Planes | None, punch_fails: frozenset[str] = frozenset(),
                   direct: tuple[float, float] = DIRECT
                   ) -> tuple[Agents, common_pb2.LinkMatrix, LinkStore]:
    ids = ["a0", "a1", "n2", "n3"]
    registry = registry_with({a: reach.NOWHERE if a in HIDDEN else reach.EVERYWHERE
                              for a in ids})
    store = LinkStore()
    measurer = LinkMeasurer(registry, store, probe_timeout_s=2.0)
    measurer.punching = planes
    agents = Agents(registry, set(punch_fails), direct, measurer)
    relay = planes.relay if planes is not None else None
    matrix = await measured(measurer, registry, [agents.serve(i, relay) for i in ids])
    return agents, matrix, store


def _relayed_figures() -> tuple[float, float]:
    """n2 -> n3 through the coordinator: both hops' delay, the narrower hop's rate."""
    return SITE["n2"][0] + SITE["n3"][0], min(SITE["n2"][1], SITE["n3"][1])


@pytest.mark.timeout(60)
def test_a_pair_punched_both_ways_is_priced_direct_and_not_a_relay_flow() -> None:
    relay = Relay(None, port=7700)
    agents, matrix, store = asyncio.run(_measure(Planes(relay)))
    assert not matrix.unreachable and not matrix.relayed, matrix
    assert sorted(matrix.punched) == ["n2->n3", "n3->n2"]
    for x, y in (("n2", "n3"), ("n3", "n2")):
        entry = store.entries[x, y]
        assert entry.reachable and entry.path == PUNCHED
        assert (entry.delay_ms, entry.bandwidth_gbps) == DIRECT  # not the two relay hops
        assert entry.estimate.startswith("punched: measured on a direct connection")
    table = matrix_to_json(matrix)
    assert sorted(table["punched"]) == ["n2->n3", "n3->n2"] and not table["relayed"]
    assert table["estimated"]["n2->n3"].startswith("punched")
    # not divided among a grid's relayed flows: the scheduler's relay mask leaves it out
    ids = list(matrix.agent_ids)
    grid = [[ids.index("a0")], [ids.index("n2")], [ids.index("n3")], [ids.index("a1")]]
    assert relay_mask.relayed_flows(grid, relay_mask.mask(ids, list(matrix.relayed))) == 0
    # both ends were asked at once, each with the other as its one peer, for one pseudo-job
    # the relay admitted for two ranks while they punched and retired afterwards
    assert sorted((a, b) for a, b, _ in agents.punches) == [("n2", "n3"), ("n3", "n2")]
    tickets = {a: t for a, _, t in agents.punches}
    assert tickets["n2"].job == tickets["n3"].job and tickets["n2"].job.startswith("linkprobe")
    assert tickets["n2"].secret == tickets["n3"].secret and len(tickets["n2"].secret) == 32
    assert {(tickets["n2"].rank, tickets["n2"].peer_rank),
            (tickets["n3"].rank, tickets["n3"].peer_rank)} == {(0, 1), (1, 0)}
    assert tickets["n2"].relay == ":7700"  # the coordinator's relay, at its host
    assert agents.admitted == [1, 1] and relay.epochs() == []


@pytest.mark.timeout(60)
def test_a_pair_whose_punch_fails_either_way_is_priced_relayed_as_without_punching() -> None:
    relay = Relay(None, port=7700)
    _, matrix, store = asyncio.run(_measure(Planes(relay), punch_fails=frozenset({"n3"})))
    assert sorted(matrix.relayed) == ["n2->n3", "n3->n2"] and not matrix.punched
    for x, y in (("n2", "n3"), ("n3", "n2")):
        entry = store.entries[x, y]
        assert entry.path == RELAYED
        assert (entry.delay_ms, entry.bandwidth_gbps) == pytest.approx(_relayed_figures())
    assert relay.epochs() == []
    _, off, _ = asyncio.run(_measure(Planes(relay, hole_punch=False)))
    for got, want in zip(matrix_arrays(matrix), matrix_arrays(off), strict=True):
        np.testing.assert_array_equal(got, want)  # every figure as without punching


@pytest.mark.timeout(60)
def test_a_punched_pair_the_relay_carries_faster_is_priced_relayed_as_the_data_plane_keeps_it(
) -> None:
    """At each epoch the pair weighs the punched path against the relay and stays on the
    relay where that is faster (dtfm/net/pathweigh.py): priced so, not direct."""
    relay = Relay(None, port=7700)
    agents, matrix, store = asyncio.run(_measure(Planes(relay), direct=(150.0, 0.01)))
    assert len(agents.punches) == 2  # both got through ...
    assert sorted(matrix.relayed) == ["n2->n3", "n3->n2"] and not matrix.punched  # ... slower
    assert (store.entries["n2", "n3"].delay_ms,
            store.entries["n2", "n3"].bandwidth_gbps) == pytest.approx(_relayed_figures())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("planes", ["hole punch off", "no relay", "no data planes"])
def test_without_hole_punching_or_a_relay_nothing_is_punch_probed(planes: str) -> None:
    given = {"hole punch off": Planes(Relay(None, port=7700), hole_punch=False),
             "no relay": Planes(None), "no data planes": None}[planes]
    agents, matrix, store = asyncio.run(_measure(given))
    assert agents.punches == []
    assert sorted(matrix.relayed) == ["n2->n3", "n3->n2"] and not matrix.punched
    assert store.entries["n2", "n3"].path == RELAYED
    assert (store.entries["n2", "n3"].delay_ms,
            store.entries["n2", "n3"].bandwidth_gbps) == pytest.approx(_relayed_figures())


def test_pairs_punch_in_rounds_that_use_each_agent_once() -> None:
    pairs = [("a", "b"), ("a", "c"), ("b", "c"), ("d", "e"), ("f", "g")]
    got = punchprobe.rounds(pairs, at_once=2)
    assert sorted(p for r in got for p in r) == sorted(pairs)
    for r in got:
        assert len(r) <= 2
        members = [x for p in r for x in p]
        assert len(members) == len(set(members)), r


def test_a_failed_punch_sample_is_stored_failed_with_its_reason() -> None:
    store = LinkStore()
    punchprobe.record(store, "n2", common_pb2.LinkSample(
        peer_id="n3", reachable=False, error="no hole punch to n3 through the relay: x"))
    entry = store.entries["n2", "n3"]
    assert not entry.reachable and entry.path == "" and "no hole punch" in entry.error
    assert not entry.judged  # still a failed probe: the pair stays stranded, priced relayed
    punchprobe.record(store, "n2", common_pb2.LinkSample(
        peer_id="n3", reachable=True, delay_ms=2.0, bandwidth_gbps=0.5, estimated=True,
        estimate_note="no steady rate"))
    entry = store.entries["n2", "n3"]
    assert entry.path == PUNCHED and "the probe's estimate: no steady rate" in entry.estimate
    assert punchprobe.punched(store, [("n2", "n3")]) == []  # one way only: not priced direct


def test_a_links_file_with_punched_links_warns_a_job_that_never_punches(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # measured with punching on, the file prices n2-n3 direct; a --hole-punch off job runs
    # that pair through the relay, slower than the plan: it says so, and how to mend it
    path = tmp_path / "links.json"
    path.write_text(json.dumps({
        "agents": ["a0", "n2", "n3"], "delay_ms": [[0, 9, 9], [9, 0, 5], [9, 5, 0]],
        "bandwidth_gbps": [[None, 1, 1], [1, None, 1], [1, 1, None]],
        "punched": ["n2->n3", "n3->n2"]}))
    for hole_punch, warned in ((False, True), (True, False)):
        cfg = JobConfig(links_file=str(path), hole_punch=hole_punch)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="coordinator.job.epochplan"):
            delay, _ = EpochPlanner(cfg, CheckpointTracker(cfg)).known_links(["a0", "n2", "n3"])
        assert delay[1, 2] == 5
        assert ("--hole-punch off: those pairs go through the relay" in caplog.text) == warned
        # a job on members the punched links do not join is not warned
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="coordinator.job.epochplan"):
            EpochPlanner(cfg, CheckpointTracker(cfg)).known_links(["a0", "n2"])
        assert "hole punch" not in caplog.text
