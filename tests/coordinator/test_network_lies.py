"""Lies about the network (issue 43, item 6): nobody honest is downgraded or blamed, and the
liar's dissent is recorded as evidence against it.

The seams are those the reachability and measurement tests use: the real `ReachChecker`
dials a real agent gRPC server (or a closed port) itself, and peers answer its dial commands
through `on_report` (tests/coordinator/test_reachability.py); the real `LinkMeasurer` drives
fake agents that answer its commands through the real registry's queues
(tests/coordinator/test_measure_rounds.py). Evidence goes to a real `IntegrityLedger`.
"""

from __future__ import annotations

import asyncio

import pytest

from agent.daemon.server import AgentService, registrar
from coordinator.daemon.registry import AgentRecord, Registry
from coordinator.integrity.ledger import IntegrityLedger
from coordinator.job.epochlinks import NoLinks, avoid_dead_links
from coordinator.links import dialvotes, figures
from coordinator.links import failure as lf
from coordinator.links.measure import LinkMeasurer
from coordinator.links.reachability import ReachChecker
from coordinator.links.relayed import direct_dials
from coordinator.links.store import LinkStore, blame
from coordinator.scheduler.placement import Placement
from dtfm import rpc
from dtfm.net import reach
from dtfm.rpc import free_port
from protos.dtfm.v1 import common_pb2, coordinator_pb2
from tests.coordinator.test_measure_rounds import BANDWIDTH, FakeAgents, _measure

pytestmark = pytest.mark.timeout(30)
SECURITY = rpc.Security(token="test-token-0123456789")


def _sink(ledger: IntegrityLedger):  # type: ignore[no-untyped-def]
    return lambda agent, kind, detail: ledger.record(agent, kind, 0, detail)


async def _dialled(answers: dict[str, bool], target_listens: bool,
                   hosts: dict[str, str] | None = None
                   ) -> tuple[AgentRecord, IntegrityLedger]:
    """The verdict on "target" when the coordinator dials it itself (a real agent server
    answers there, or nothing listens) and each peer of `answers` reports its dial as told."""
    honest = AgentService(common_pb2.AgentInfo(agent_id="target"))
    server, port, _ = await rpc.start_server("127.0.0.1:0", SECURITY, registrar(honest), "t")
    try:
        registry = Registry(liveness_timeout_s=10)
        target = registry.join(common_pb2.AgentInfo(
            agent_id="target", host="127.0.0.1", port=port if target_listens else free_port()))
        peers = {name: registry.join(common_pb2.AgentInfo(
            agent_id=name, host=(hosts or {}).get(name, "127.0.0.1"), port=1))
            for name in answers}
        ledger = IntegrityLedger()
        checker = ReachChecker(registry, SECURITY, dial_timeout_s=1.0, peers=len(answers))
        checker.evidence = _sink(ledger)
        task = asyncio.create_task(checker.check(target, target.stream_generation))
        for name, ok in answers.items():
            dial = (await asyncio.wait_for(peers[name].commands.get(), 5)).dial
            assert checker.on_report(coordinator_pb2.DialReport(
                agent_id=name, round_id=dial.round_id, peer_id="target", ok=ok,
                error="" if ok else "connection refused")) is None
        await task
        return target, ledger
    finally:
        await server.stop(None)


@pytest.mark.parametrize("answers", [{"liar": False}, {"honest": True, "liar": False}])
def test_one_peers_false_refusal_never_downgrades_an_agent_others_reached(
        answers: dict[str, bool]) -> None:
    """The coordinator's own dial got through (and an honest peer's, where one was asked):
    the liar's "refused" alone does not make the target "some peers"."""
    target, ledger = asyncio.run(_dialled(answers, target_listens=True))
    assert target.reach.verdict == reach.EVERYWHERE, target.reach.summary
    assert {d.dialer for d in target.reach.dials if d.outvoted} == {"liar"}
    assert "outvoted" in target.reach.summary
    assert [e.kind for e in ledger.evidence("liar")] == [dialvotes.DIAL_VOTE]
    assert ledger.evidence("honest") == [] and ledger.evidence("target") == []


def test_a_false_answer_never_vouches_alone_for_an_agent_nobody_else_can_dial() -> None:
    target, ledger = asyncio.run(_dialled({"honest": False, "liar": True},
                                          target_listens=False))
    assert target.reach.verdict == reach.NOWHERE, target.reach.summary
    assert ("liar", "target") not in direct_dials([target])  # nobody is told to dial it
    assert [e.kind for e in ledger.evidence("liar")] == [dialvotes.DIAL_VOTE]
    assert ledger.evidence("honest") == []


def test_a_lone_vouch_counts_from_the_agents_own_lan() -> None:
    """The first agent of a NAT'd site is reached by its neighbour only: both advertise one
    private /24, which loopback never is."""
    ok, no = reach.result("n", ""), reach.result("x", "refused")
    coord = reach.result(reach.COORDINATOR, "timed out")
    hosts = {"n": "192.168.1.3", "x": "203.0.113.9"}
    assert dialvotes.outvoted([coord, no, ok], "192.168.1.2", hosts.__getitem__) == set()
    assert dialvotes.outvoted([coord, no, ok], "203.0.113.7", hosts.__getitem__) == {"n"}
    assert not dialvotes.one_lan("127.0.0.1", "127.0.0.1")
    assert dialvotes.one_lan("fd00::1", "fd00::2") and not dialvotes.one_lan("10.0.0.1", "h")
    # two dialers in all: no majority, the coordinator's failure and a peer's success stay
    assert dialvotes.outvoted([coord, ok], "203.0.113.7", hosts.__getitem__) == set()


class FiguresAgents(FakeAgents):
    """Agents whose reports come from `delay_of` and `gbps_of` (default 1 ms, 0.3 Gbit/s):
    a loopback link, as measured."""

    gbps_of: dict[tuple[str, str], float] = {}
    failed: set[tuple[str, str]] = set()

    async def _answer(self, agent_id: str, cmd: coordinator_pb2.MeasureLinksCommand,
                      peers: tuple[str, ...]) -> None:
        await asyncio.sleep(self.rng.uniform(0.001, 0.01))
        samples = [common_pb2.LinkSample(
            peer_id=p, reachable=(agent_id, p) not in self.failed,
            delay_ms=self.delay_of.get((agent_id, p), 1.0),
            bandwidth_gbps=self.gbps_of.get((agent_id, p), 0.3) if cmd.kind == BANDWIDTH
            else 0.0, error="connection refused" if (agent_id, p) in self.failed else "")
            for p in peers]
        assert self.measurer is not None
        error = self.measurer.on_report(coordinator_pb2.LinkReport(
            agent_id=agent_id, round_id=cmd.round_id, samples=samples))
        assert error is None, error


def _measured(delay_of: dict[tuple[str, str], float], gbps_of: dict[tuple[str, str], float],
              failed: frozenset[tuple[str, str]] = frozenset()
              ) -> tuple[LinkStore, IntegrityLedger]:
    """Measure four agents (a0..a3) whose reports say `delay_of`, `gbps_of` and `failed`;
    the store, and the ledger the measurer's evidence went to."""
    ledger = IntegrityLedger()

    class Agents(FiguresAgents):
        @property  # type: ignore[override]
        def measurer(self) -> LinkMeasurer | None:
            return self._measurer

        @measurer.setter
        def measurer(self, m: LinkMeasurer | None) -> None:  # the test's measurer, wired
            self._measurer = m                                  # to the ledger as the server
            self.gbps_of, self.failed = gbps_of, set(failed)   # wires it
            if m is not None:
                m.evidence = _sink(ledger)

    _, _, store = asyncio.run(_measure(4, kind=Agents, probe_timeout_s=2, delay_of=delay_of))
    return store, ledger


def test_false_link_figures_are_discarded_and_recorded_against_their_reporter() -> None:
    """a1 reports 0.01 ms and 900 Gbit/s to everyone on loopback links that measure 1 ms and
    0.3 Gbit/s from the other end: its figures are replaced by the other direction's."""
    others = ("a0", "a2", "a3")
    store, ledger = _measured({("a1", p): 0.01 for p in others},
                              {("a1", p): 900.0 for p in others})
    for p in others:
        lie = store.entries[("a1", p)]
        assert lie.reachable and lie.delay_ms == 1.0 and lie.bandwidth_gbps == 0.3, lie
        assert "taken from" in lie.estimate
    kinds = [e.kind for e in ledger.evidence("a1")]
    assert kinds.count(figures.LINK_FIGURE) == 6  # three delays, three bandwidths
    assert all(ledger.evidence(p) == [] for p in others)


def test_an_honest_asymmetric_link_is_kept_as_measured_and_blames_nobody() -> None:
    """a0 sits behind a home uplink 30x slower than its downlink (DOCSIS-like), on a host
    whose pings read a little high: nothing is discarded, nobody is recorded."""
    store, ledger = _measured({("a0", p): 2.5 for p in ("a1", "a2", "a3")},
                              {("a0", p): 0.01 for p in ("a1", "a2", "a3")})
    assert store.entries[("a0", "a1")].bandwidth_gbps == 0.01
    assert store.entries[("a1", "a0")].bandwidth_gbps == 0.3
    assert store.entries[("a0", "a1")].delay_ms == 2.5 and not store.entries[
        ("a0", "a1")].estimate
    assert ledger.suspects() == []


def test_a_faked_dead_link_is_never_blamed_on_the_end_that_did_not_report_it() -> None:
    """a3 (last in the job's order, so the old tie rule spared it) reports its link to a0
    failed; a0 reached a3 and everyone else."""
    store, ledger = _measured({}, {}, failed=frozenset({("a3", "a0")}))
    ids = ["a0", "a1", "a2", "a3"]
    failed = lf.failed_links(store, ids)
    assert failed == [("a3", "a0")]
    assert blame(ids, failed) == ["a3"]  # before: a0, the end that did not report it
    failures = lf.partition(ids, failed)
    assert failures.dead == {frozenset(("a0", "a3"))} and failures.leave_out == []
    # a fixed placement that needs the pair: the end left out is the one that reported it
    out = avoid_dead_links({"grid": [[0], [1], [2], [3]]}, failures, ids,
                           Placement.parse("rank-order"))
    assert isinstance(out, NoLinks) and out.hold_out == ["a3"], out
    assert [e.kind for e in ledger.evidence("a3")] == [figures.DEAD_LINK]
    assert all(ledger.evidence(p) == [] for p in ("a0", "a1", "a2"))
    # a link both ends report failed: the tie is resolved as before, the later end out
    both = lf.partition(ids, [("a0", "a3"), ("a3", "a0")])
    assert both.reported_way("a0", "a3") == ("a3", "a0")
