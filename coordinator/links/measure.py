"""Drives link measurement: tells agents whom to probe and collects their reports.

The coordinator never measures anything itself. It has every agent ping every peer at once,
then hands out bandwidth probes in the rotation order of `coordinator.links.store`, starting each as
soon as its sender can send and its receiver can receive, so no device sends (or receives) two
transfers at once and no slow link holds up a whole round. A link whose receiver
cannot be dialled (behind a NAT or firewall) is taken from its other direction's probe, and a
pair that can dial neither way is hole-punched and measured direct where the punch gets
through (`coordinator.links.punchprobe`), else priced as relayed through the coordinator
(`coordinator.links.relayed`). A peer that does
not answer ends up as an unreachable link, never a hang: every probe has a deadline, and an
agent that stays silent past it, or that the registry loses meanwhile, is recorded as a failed
link and not asked again. A sample marked `estimated` (its probe moved data but never settled
on a rate, as a 2 Mbit/s link 171 ms away may not) is a measured link like any other: logged,
and kept with its mark so `coordinator links` and `status` show it; only a peer that moved
nothing is unreachable.

A report counts only from the agent the command went to (the server checked its secret), for
the round it was asked, and only for the peers it was asked to probe; a figure no network can
produce (over MAX_LINK_GBPS), or delays the two ends of a pair contradict each other on (still,
when the pair is pinged a second time on its own), are logged and the link recorded as failed,
so one careless or hostile agent cannot pull the scheduler towards links it made up. A figure
its other direction contradicts beyond what honest asymmetry gives (a bandwidth over 100x its
reverse's, a delay far under its reverse's twice) is discarded and recorded against its
reporter, as is a dead link only one end reports (coordinator/links/figures.py, `evidence`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from coordinator.daemon.registry import ALIVE, AgentRecord, Registry
from coordinator.links import figures, punchprobe, relayed
from coordinator.links.infer import latency_clusters, sampled_links, to_measure
from coordinator.links.store import LinkStore, in_rotation
from dtfm.core.limits import MAX_PING_SPREAD_S, PING_SPACING_S
from protos.dtfm.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)

MAX_LINK_GBPS = 1000.0  # above any NIC sold today: a figure beyond it is a bug or a lie
# the two ends' one-way delays of a pair may differ by 3x + 50 ms (load, jitter) at most
REVERSE_DELAY_SLACK = (3.0, 50.0)
# Timed pings one agent sends a second in a latency pass, at most (its warm-up ping per peer
# counts too). Pings are the load that made them read high: 16 agents sharing 2 cores, each
# pinging its 15 peers 10 times within 2 s (75 a second) beside a training job, read the
# median link 51-76 ms long; 4 times (30 a second) read it 5 ms long. The agents' own default
# (a tenth of a second apart, all peers at once) sent 150 a second and had the two ends of 7
# pairs contradict each other by 100 ms before a 16-agent job, which then left 7 agents out.
PING_RATE = 20.0
# A latency pass of N agents delivers N(N-1) samples at once, as the spread ends, and the
# coordinator records each on its loop: a report's deadline allows this long per sample of
# such a pass on top of the probe timeout (a million samples on a tenth of a busy core
# outlasted the 30 s of slack, and the late reports were refused: bench/scale.py).
INGEST_S_PER_SAMPLE = 50e-6
# how often a wait for a report looks whether the registry still counts its measurer alive
LIVENESS_POLL_S = 0.5


@dataclass(frozen=True)
class Pings:
    """How each agent pings each peer in a latency pass: `count` pings (0: the measurer's)
    spread over `spread_s` seconds (0: a tenth of a second apart), or longer where the agent
    has so many peers that this would send more than PING_RATE pings a second (`spread_for`).
    Spreading them lets the least of them miss a running job's bursts, and keeps many agents
    on few cores from queueing their pings in their own event loops."""

    count: int = 0
    spread_s: float = 0.0

    def spread_for(self, count: int, peers: int) -> float:
        """The spread to command for `count` pings to each of `peers` (0: the agent's default
        spacing, where that keeps under PING_RATE); at most MAX_PING_SPREAD_S."""
        paced = (count + 1) * peers / PING_RATE
        if self.spread_s <= 0 and paced <= count * PING_SPACING_S:
            return 0.0
        return min(MAX_PING_SPREAD_S, max(self.spread_s, paced))


class LinkMeasurer:
    def __init__(
        self,
        registry: Registry,
        store: LinkStore,
        probe_timeout_s: float = 30.0,
        ping_count: int = 5,
        probe_seconds: float = 1.0,
        probe_max_bytes: int = 256 * 1024 * 1024,
    ) -> None:
        self.registry = registry
        self.store = store
        self.probe_timeout_s = probe_timeout_s
        self.ping_count = ping_count
        self.probe_seconds = probe_seconds
        self.probe_max_bytes = probe_max_bytes
        self._pending: dict[tuple[str, str], _Pending] = {}
        # `_target`'s: by agent id, the AgentInfo it was made from and the message
        self._targets: dict[str, tuple[common_pb2.AgentInfo | None,
                                       coordinator_pb2.PeerTarget]] = {}
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self._seq = itertools.count()
        self.last_seconds = 0.0
        self.running = False
        # the coordinator's relay and the hole-punch switch (the job's DataPlanes, set by the
        # server): stranded pairs are punch-probed through it (coordinator/links/punchprobe.py)
        self.punching: punchprobe.RelaySource | None = None
        # (suspect, kind, detail): a figure the other direction contradicts is evidence
        # against its reporter (coordinator/links/figures.py); the server hands it on
        self.evidence: Callable[[str, str, str], None] = lambda agent, kind, detail: None

    def on_report(self, report: coordinator_pb2.LinkReport) -> str | None:
        """Record a report; or say why it cannot be used (stale, forged, or incomplete)."""
        pending = self._pending.get((report.round_id, report.agent_id))
        if pending is None or pending.future.done():
            return f"no measurement round {report.round_id!r} is waiting for {report.agent_id}"
        future, kind = pending.future, pending.kind
        unasked = sorted({s.peer_id for s in report.samples} - set(pending.peers))
        if unasked:
            return (f"round {report.round_id!r} asked {report.agent_id} to probe "
                    f"{list(pending.peers)}, not {unasked[:5]}")
        for sample in report.samples:
            if (sample.reachable and kind != coordinator_pb2.MEASURE_KIND_LATENCY
                    and sample.bandwidth_gbps <= 0):
                return (f"sample for {sample.peer_id}: a bandwidth round needs "
                        f"bandwidth_gbps > 0 for a reachable link, got {sample.bandwidth_gbps}")
        for sample in report.samples:
            if sample.reachable and sample.bandwidth_gbps > MAX_LINK_GBPS:
                self._implausible(report.agent_id, sample)
                continue
            if sample.reachable and sample.estimated:
                log.warning("link %s->%s: bandwidth %.2f Mbit/s is an estimate (%s)",
                            report.agent_id, sample.peer_id, sample.bandwidth_gbps * 1e3,
                            sample.estimate_note or "no note")
            if kind == coordinator_pb2.MEASURE_KIND_PUNCH:
                punchprobe.record(self.store, report.agent_id, sample)
                continue
            self.store.record(report.agent_id, sample,
                              latency=kind != coordinator_pb2.MEASURE_KIND_BANDWIDTH,
                              bandwidth=kind != coordinator_pb2.MEASURE_KIND_LATENCY)
        future.set_result(None)
        return None

    def _implausible(self, agent_id: str, sample: common_pb2.LinkSample) -> None:
        """Flag and drop a sample no link can produce; the link counts as failed."""
        why = (f"{agent_id} reported {sample.bandwidth_gbps:g} Gbit/s to {sample.peer_id}, "
               f"above the {MAX_LINK_GBPS:g} Gbit/s any link can carry: sample dropped")
        log.warning("implausible link measurement: %s", why)
        self.store.mark_unreachable(agent_id, sample.peer_id, why)

    def _contradicting(self, ids: list[str]) -> list[tuple[str, str, str]]:
        """The pairs whose two ends' delays disagree by more than REVERSE_DELAY_SLACK, each
        with what they said."""
        out = []
        for a, b in itertools.combinations(ids, 2):
            ab, ba = self.store.entries.get((a, b)), self.store.entries.get((b, a))
            if ab is None or ba is None or not (ab.reachable and ba.reachable):
                continue
            low, high = sorted((ab.delay_ms, ba.delay_ms))
            if high > REVERSE_DELAY_SLACK[0] * low + REVERSE_DELAY_SLACK[1]:
                out.append((a, b, f"{a} measured {ab.delay_ms:.1f} ms to {b} but {b} measured "
                                  f"{ba.delay_ms:.1f} ms back: one round trip cannot give both"))
        return out

    async def _check_reverse_delays(self, run: int, ids: list[str],
                                    by_id: dict[str, AgentRecord], silent: set[str],
                                    probe_seconds: float, pings: Pings) -> None:
        """Both ends of a pair measure half the same round trip, so their delays must agree.
        A pair that disagrees is pinged again, both ways and on its own: a burst of pings on
        busy cores can make one end read a link 100 ms long (a 16-agent job lost 7 agents so),
        and a second, quiet look settles that. A pair that still disagrees (a lie, or a broken
        agent) is flagged and both directions are dropped, which leaves the pair out of plans.
        A pair whose low end reads far under the other (`figures.deflated_delays`) gets the
        same second look; still so, its low figure is discarded and recorded against it."""
        pairs = await asyncio.to_thread(self._contradicting, ids)  # N^2/2 pairs
        pairs += [(a, b, f"{a} measured its link to {b} far shorter than {b} measured it back")
                  for a, b in await asyncio.to_thread(
                      lambda: list(figures.deflated_delays(self.store, ids)))
                  if not any({a, b} == {x, y} for x, y, _ in pairs)]
        if not pairs:
            return
        log.info("pinging %d pairs again, on their own: their two ends disagreed (%s)",
                 len(pairs), pairs[0][2])
        peers: dict[str, list[str]] = {}
        for a, b, _ in pairs:
            peers.setdefault(a, []).append(b)
            peers.setdefault(b, []).append(a)
        await self._run(run, coordinator_pb2.MEASURE_KIND_LATENCY,
                        [_Probe(a, tuple(p)) for a, p in peers.items()], by_id, silent,
                        probe_seconds, pings=pings)
        for a, b, why in await asyncio.to_thread(self._contradicting, ids):
            log.warning("contradictory link measurement: %s", why)
            self.store.mark_unreachable(a, b, why)
            self.store.mark_unreachable(b, a, why)
        for a, b in figures.discard_deflated(self.store, ids, self.evidence):
            log.warning("link %s->%s: its delay, far under %s's measurement back, is "
                        "discarded (evidence against %s)", a, b, b, a)

    async def _second_looks(self, run: int, ids: list[str], by_id: dict[str, AgentRecord],
                            silent: set[str], probe_seconds: float) -> None:
        """Probe again, one at a time, the links that read far under their reverse
        (`figures.lopsided_bandwidth`), and keep the higher of each one's two readings: an
        honest probe errs low (load, a window that never filled), and a link that really is
        asymmetric reads the same again."""
        links = await asyncio.to_thread(figures.lopsided_bandwidth, self.store, ids)
        if not links:
            return
        first = {link: self.store.entries[link] for link in links}
        a, b = links[0]
        log.info("probing %d links again, one at a time: each read under 1/%gx its reverse "
                 "(%s->%s %.1f Mbit/s, %.1f back)", len(links), figures.LOPSIDED, a, b,
                 first[a, b].bandwidth_gbps * 1e3, self.store.entries[b, a].bandwidth_gbps * 1e3)
        await self._run(run, coordinator_pb2.MEASURE_KIND_BANDWIDTH,
                        [_Probe(x, (y,)) for x, y in links], by_id, silent, probe_seconds,
                        max_probes=1)
        for (x, y), before in first.items():
            again = self.store.entries.get((x, y))
            if again is None or not again.reachable or \
                    again.bandwidth_gbps < before.bandwidth_gbps:
                self.store.entries[x, y] = before
            kept = self.store.entries[x, y].bandwidth_gbps
            log.info("link %s->%s: %.1f Mbit/s, then %s: keeps %.1f Mbit/s", x, y,
                     before.bandwidth_gbps * 1e3,
                     f"{again.bandwidth_gbps * 1e3:.1f}" if again is not None and again.reachable
                     else "no reading", kept * 1e3)

    async def measure(self, agents: list[AgentRecord], only_missing: bool = False,
                      bandwidth_links: set[tuple[str, str]] | None = None,
                      probe_seconds: float | None = None,
                      sampled: bool = False,
                      max_probes: int = 0,
                      pings: Pings = Pings(), latency: bool = True,
                      infer: dict[tuple[str, str], tuple[str, str]] | None = None
                      ) -> common_pb2.LinkMatrix:
        """Measure every directed link between `agents`; returns their matrix.

        `only_missing` probes just the links the store has no figure for (a newcomer's, to
        and from everyone): links between agents measured before did not change because
        someone joined, and probing them again would cost the job minutes of probes.
        `bandwidth_links` (a re-measurement while the job trains, coordinator/job/replan.py):
        the latency of every pair, but the bandwidth of just these links, each probe lasting
        about `probe_seconds` (default: the measurer's). `sampled`: bandwidth only for
        representatives of latency clusters, the rest inferred and marked so
        (`coordinator/links/infer.py`). `max_probes`: at most this many bandwidth probes at
        once (0: as many as the devices allow), for a job's links while it trains.
        `pings`: how many pings per peer, over how long (`Pings`). `latency=False` skips the
        latency pass (the bandwidth of `bandwidth_links` right after a latency-only pass).
        `infer`: {link: the probed link whose bandwidth it takes}, recorded as inferred
        (a re-measurement probing representatives, `linkinfer.representatives`)."""
        async with self._lock:
            self.running = True
            try:
                return await self._measure(agents, only_missing, bandwidth_links,
                                           probe_seconds or self.probe_seconds, sampled,
                                           max_probes, pings, latency, infer)
            finally:
                self.running = False

    def missing_links(self, ids: list[str]) -> set[tuple[str, str]]:
        """The directed links between `ids` with no usable figure: never measured, or
        failed last time (an agent that re-joins after being unreachable gets a new try)."""
        return {(a, b) for a in ids for b in ids
                if a != b and ((e := self.store.entries.get((a, b))) is None or not e.reachable)}

    async def _measure(self, agents: list[AgentRecord], only_missing: bool,
                       bandwidth_links: set[tuple[str, str]] | None,
                       probe_seconds: float, sampled: bool = False,
                       max_probes: int = 0, pings: Pings = Pings(), latency: bool = True,
                       infer: dict[tuple[str, str], tuple[str, str]] | None = None
                       ) -> common_pb2.LinkMatrix:
        by_id = {a.agent_id: a for a in agents}
        ids = list(by_id)
        self._targets = {a: t for a, t in self._targets.items() if a in by_id}
        wanted = self.missing_links(ids) if only_missing else {
            (a, b) for a in ids for b in ids if a != b}
        run = next(self._ids)
        started = time.monotonic()
        log.info("measuring %d links of %d agents", len(wanted), len(ids))
        silent: set[str] = set()  # agents that let a probe time out: not asked again this run
        # All latencies first, at once: a ping is a few hundred bytes, so pings do not queue
        # behind each other, and every agent opens its channels to every peer on the way.
        if latency:
            await self._run(run, coordinator_pb2.MEASURE_KIND_LATENCY,
                            [_Probe(a, peers) for a in ids
                             if (peers := tuple(b for b in ids if b != a and (
                                 not only_missing or (a, b) in wanted)))],
                            by_id, silent, probe_seconds, pings=pings)
        if bandwidth_links is None:
            await self._check_reverse_delays(run, ids, by_id, silent, probe_seconds, pings)
        else:  # while a job trains, its traffic makes pings disagree: no pair is dropped
            wanted &= bandwidth_links
        stands_for = dict(infer or {})
        if sampled:  # seconds of Python at 1,000 agents: off the event loop (heartbeats)
            clusters = await asyncio.to_thread(latency_clusters, ids, self._delay)
            stands_for = await asyncio.to_thread(sampled_links, clusters)
            if only_missing:  # links measured before keep their figures
                stands_for = {link: s for link, s in stands_for.items() if link in wanted}
            wanted &= to_measure(stands_for)
            log.info("%d latency clusters (%s): probing the bandwidth of %d links, inferring "
                     "the rest", len(clusters), " ".join(str(len(c)) for c in clusters),
                     len(wanted))
        log.info("latencies measured after %.1f s", time.monotonic() - started)
        # Then bandwidth: each device sends one transfer and receives one at a time, and a
        # link is never measured while its reverse is (its acknowledgements would queue).
        bandwidth = [_Probe(a, (b,), frozenset((f"send {a}", f"receive {b}",
                                                f"pair {min(a, b)} {max(a, b)}")))
                     for a, b in in_rotation(ids, wanted)]
        await self._run(run, coordinator_pb2.MEASURE_KIND_BANDWIDTH, bandwidth, by_id, silent,
                        probe_seconds, max_probes)
        if bandwidth_links is None:  # while a job trains, its traffic is what a probe sees
            await self._second_looks(run, ids, by_id, silent, probe_seconds)
        if stands_for:
            await asyncio.to_thread(self._infer, stands_for)
        for a, b in figures.inflated_bandwidth(self.store, ids, self.evidence):
            log.warning("link %s->%s: %s", a, b, self.store.entries[(a, b)].estimate)
        await self._unreachable_ends(run, ids, by_id, silent, probe_seconds)
        figures.one_sided(self.store, ids, set(ids) - relayed.undialable(list(by_id.values())),
                          self.evidence)
        self.last_seconds = time.monotonic() - started
        log.info("measured %d links of %d agents in %.1f s", len(wanted), len(ids),
                 self.last_seconds)
        return self.store.matrix(ids)

    async def _run(self, run: int, kind: int, probes: list[_Probe],
                   by_id: dict[str, AgentRecord], silent: set[str],
                   probe_seconds: float, max_probes: int = 0, pings: Pings = Pings()
                   ) -> None:
        """Run `probes`, each as soon as no running probe holds what it holds (and fewer than
        `max_probes` run, where that is > 0).

        No round barrier: a probe starts as soon as its devices are free, so one slow link
        holds up only the probes that need its devices, not a whole round.
        """
        pending = list(probes)
        running: dict[asyncio.Task[None], frozenset[str]] = {}
        busy: set[str] = set()
        try:
            while pending or running:
                for probe in list(pending):
                    # a probe holds N peers in a latency pass: no set of them per look, or
                    # each completion costs O(N) per pending probe (O(N^3) per pass)
                    quiet = sorted(({probe.measurer, *probe.peers} & silent) if silent and (
                        probe.measurer in silent or not silent.isdisjoint(probe.peers)) else ())
                    if quiet:
                        pending.remove(probe)
                        for peer in probe.peers:
                            self.store.mark_unreachable(
                                probe.measurer, peer,
                                f"agent {quiet[0]} did not answer an earlier probe")
                        continue
                    if kind == coordinator_pb2.MEASURE_KIND_BANDWIDTH and all(
                            self._unreachable(probe.measurer, p) for p in probe.peers):
                        pending.remove(probe)  # the latency pass already said why
                        continue
                    if probe.holds & busy:
                        continue
                    if 0 < max_probes <= len(running):
                        break
                    pending.remove(probe)
                    busy.update(probe.holds)
                    task = asyncio.create_task(self._probe(run, kind, probe, by_id, silent,
                                                           probe_seconds, pings))
                    running[task] = probe.holds
                if not running:
                    continue
                done, _ = await asyncio.wait(list(running), return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    busy.difference_update(running.pop(task))
                    task.result()
        finally:
            for task in running:
                task.cancel()

    async def _unreachable_ends(self, run: int, ids: list[str], by_id: dict[str, AgentRecord],
                                silent: set[str], probe_seconds: float) -> None:
        """Links a probe could not dial (coordinator/links/relayed.py): those whose reverse
        was probed take its figures; for pairs failed both ways, each end measures its link
        to the relay (the coordinator, as a peer it dials), and the pair is priced relayed."""
        hidden = relayed.undialable([by_id[i] for i in ids])
        if filled := relayed.fill_other_way(self.store, ids, hidden):
            log.info("%d links taken from the probe of their other direction (their receiver "
                     "cannot be dialled): %s", len(filled),
                     " ".join(f"{a}->{b}" for a, b in filled[:6]))
        pairs = relayed.stranded_pairs(self.store, ids, hidden)
        # pairs priced before keep their figure only until their hops are measured again
        again = [p for p in relayed.relayed_pairs(self.store, ids)
                 if p not in pairs and set(p) <= hidden]
        if not (pairs or again):
            return
        if hops := relayed.hop_agents(pairs):
            log.info("%d pairs can dial neither way (%s): measuring %d agents' links to the "
                     "relay", len(pairs), " ".join(f"{a}-{b}" for a, b in pairs[:6]),
                     len(hops))
            await self._run(run, coordinator_pb2.MEASURE_KIND_LATENCY,
                            [_Probe(x, (relayed.RELAY,)) for x in hops], by_id, silent,
                            probe_seconds)
            await self._run(run, coordinator_pb2.MEASURE_KIND_BANDWIDTH,
                            [_Probe(x, (relayed.RELAY,), frozenset((
                                f"send {x}", f"receive {relayed.RELAY}"))) for x in hops],
                            by_id, silent, probe_seconds)
        agents = [i for i in ids if relayed.serves_relay(by_id[i])]
        if punched := await self._punch(run, pairs, by_id, silent, probe_seconds):
            direct = punchprobe.kept(self.store, punched, agents)
            if slower := [p for p in punched if p not in direct]:
                log.info("%d punched pairs are faster through the relay, where the data plane "
                         "keeps them: priced relayed (%s)", len(slower),
                         " ".join(f"{a}-{b}" for a, b in slower[:6]))
            pairs = [p for p in pairs if p not in direct]
        pairs += again
        if not pairs:
            return
        priced = relayed.price(self.store, pairs, agents)
        log.info("%d links priced as relayed through the cheapest of the coordinator and %d "
                 "relay agents", len(priced), len(agents))
        if unpriced := [(x, y) for a, b in pairs for x, y in ((a, b), (b, a))
                        if (x, y) not in priced]:
            log.warning("%d links neither end can dial stay failed: %s", len(unpriced),
                        self.store.entries[unpriced[0]].error)

    async def _punch(self, run: int, pairs: list[tuple[str, str]],
                     by_id: dict[str, AgentRecord], silent: set[str], probe_seconds: float
                     ) -> list[tuple[str, str]]:
        """Have both agents of each stranded pair punch through the coordinator's relay and
        measure the direct connection (coordinator/links/punchprobe.py), pairs in rounds
        that use each agent once; the pairs punched both ways. None where hole punching is
        off or no relay runs here."""
        relay = punchprobe.relay_of(self.punching)
        if relay is None or not pairs:
            return []
        for batch in punchprobe.rounds([p for p in pairs if not set(p) & silent]):
            tickets = punchprobe.admit(relay, run, batch)
            try:
                await asyncio.gather(*(
                    self._probe(run, coordinator_pb2.MEASURE_KIND_PUNCH,
                                _Probe(x, (y,), punch=ticket), by_id, silent, probe_seconds)
                    for (x, y), ticket in tickets.items()))
            finally:
                punchprobe.retire(relay, tickets)
        direct = punchprobe.punched(self.store, pairs)
        log.info("%d of %d pairs nobody can dial punched through both ways, measured direct "
                 "(%s)", len(direct), len(pairs),
                 " ".join(f"{a}-{b}" for a, b in direct[:6]) or "none")
        return direct

    def _target(self, peer: str, by_id: dict[str, AgentRecord]
                ) -> coordinator_pb2.PeerTarget:
        """Whom a command names: one message per agent, kept while its address holds (a
        latency pass of 1,000 agents names a million peers; building each anew blocked the
        event loop for half a minute, and every heartbeat waited behind it)."""
        rec = by_id.get(peer)
        info = rec.info if rec is not None else None
        kept = self._targets.get(peer)
        if kept is None or kept[0] is not info:  # a re-join replaces the info
            kept = self._targets[peer] = (info, coordinator_pb2.PeerTarget(
                agent_id=peer, address=rec.address if rec is not None else ""))
        return kept[1]

    def _delay(self, a: str, b: str) -> float | None:
        entry = self.store.entries.get((a, b))
        return entry.delay_ms if entry is not None and entry.reachable else None

    def _infer(self, stands_for: dict[tuple[str, str], tuple[str, str]]) -> None:
        """Give every reachable link that was not probed its sample's bandwidth, marked as
        inferred (an estimate: `coordinator links` and `status` show it)."""
        for link, sample in stands_for.items():
            target, source = self.store.entries.get(link), self.store.entries.get(sample)
            if link == sample or target is None or source is None:
                continue
            if target.reachable and source.reachable:
                self.store.entries[link] = replace(
                    target, bandwidth_gbps=source.bandwidth_gbps,
                    estimate=f"inferred from {sample[0]}->{sample[1]} (same latency clusters)")

    def _unreachable(self, a: str, b: str) -> bool:
        entry = self.store.entries.get((a, b))
        return entry is not None and not entry.reachable

    async def _probe(self, run: int, kind: int, probe: _Probe, by_id: dict[str, AgentRecord],
                     silent: set[str], probe_seconds: float, pings: Pings = Pings()
                     ) -> None:
        """Send one command and wait for its report; a measurer silent past the deadline is
        noted, so it is not asked again."""
        measurer, peers = probe.measurer, probe.peers
        round_id = f"m{run}-k{kind}-{next(self._seq)}"
        count = pings.count or self.ping_count
        spread_s = (pings.spread_for(count, len(peers)) if kind in (
            coordinator_pb2.MEASURE_KIND_LATENCY, coordinator_pb2.MEASURE_KIND_BOTH) else 0.0)
        ingest_s = INGEST_S_PER_SAMPLE * len(peers) * (len(peers) + 1) if spread_s else 0.0
        command = coordinator_pb2.Command(measure=coordinator_pb2.MeasureLinksCommand(
            round_id=round_id,
            # the relay (the coordinator) has no address here: the agent dials the one it
            # joined at
            peers=[self._target(p, by_id) for p in peers],
            ping_count=count, probe_seconds=probe_seconds,
            probe_max_bytes=self.probe_max_bytes, kind=kind,  # type: ignore[arg-type]
            ping_spread_s=spread_s,
        ))
        if probe.punch is not None:
            command.measure.punch.CopyFrom(probe.punch)
            spread_s += punchprobe.EXTRA_S  # the peer's arrival at the relay and the punch
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending[(round_id, measurer)] = _Pending(future, kind, peers)
        try:
            try:
                self.registry.send(measurer, command)
            except KeyError:
                for peer in peers:
                    self.store.mark_unreachable(
                        measurer, peer, f"agent {measurer} left before it could measure")
                return
            # a latency pass's pings take their spread before the report comes
            if why := await self._await_report(future, measurer,
                                               self.probe_timeout_s + spread_s + ingest_s):
                silent.add(measurer)
                for peer in peers:
                    self.store.mark_unreachable(measurer, peer, f"agent {measurer} {why} "
                                                                f"(its probe of {peer})")
        finally:
            self._pending.pop((round_id, measurer), None)
            future.cancel()

    async def _await_report(self, future: asyncio.Future[None], measurer: str,
                            timeout_s: float) -> str:
        """Wait for `measurer`'s report: "" once it came, else why it will not. The registry
        losing the measurer (silent past the liveness timeout, or gone) ends the wait early:
        a frozen agent would otherwise hold the round up for the whole probe deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not future.done():
            record = self.registry.get(measurer)
            if record is None or record.state != ALIVE:
                return "was lost before it reported"
            if (left := deadline - loop.time()) <= 0:
                return f"did not report within {self.probe_timeout_s:.0f} s"
            await asyncio.wait({future}, timeout=min(left, LIVENESS_POLL_S))
        return ""


@dataclass(frozen=True)
class _Probe:
    """One command: `measurer` measures its links to `peers`."""

    measurer: str
    peers: tuple[str, ...]
    holds: frozenset[str] = frozenset()  # what no other probe may use meanwhile ("send A")
    punch: coordinator_pb2.PunchProbe | None = None  # a punch probe's ticket (punchprobe.py)


@dataclass(frozen=True)
class _Pending:
    """A command awaiting its report: what was asked, so nothing else is taken."""

    future: asyncio.Future[None]
    kind: int
    peers: tuple[str, ...]
