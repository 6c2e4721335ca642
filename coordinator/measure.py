"""Drives link measurement: tells agents whom to probe and collects their reports.

The coordinator never measures anything itself. It hands out probes in the round-robin order
of `coordinator.links`, starting each as soon as both of its devices are free, so no device
takes part in two transfers at once and no slow pair holds up a whole round. A peer that does
not answer ends up as an unreachable link, never a hang: every probe has a deadline, and an
agent that stays silent past it is recorded as a failed link and not asked again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from coordinator.links import LinkStore, measurement_phases, round_robin_pairs
from coordinator.registry import AgentRecord, Registry
from protos.dtfm.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)


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
        self._pending: dict[tuple[str, str], tuple[asyncio.Future[None], int]] = {}
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self.last_seconds = 0.0
        self.running = False

    def on_report(self, report: coordinator_pb2.LinkReport) -> str | None:
        """Record a report; or say why it cannot be used (stale, forged, or incomplete)."""
        pending = self._pending.get((report.round_id, report.agent_id))
        if pending is None or pending[0].done():
            return f"no measurement round {report.round_id!r} is waiting for {report.agent_id}"
        future, kind = pending
        for sample in report.samples:
            if (sample.reachable and kind != coordinator_pb2.MEASURE_KIND_LATENCY
                    and sample.bandwidth_gbps <= 0):
                return (f"sample for {sample.peer_id}: a bandwidth round needs "
                        f"bandwidth_gbps > 0 for a reachable link, got {sample.bandwidth_gbps}")
        latency_only = kind == coordinator_pb2.MEASURE_KIND_LATENCY
        for sample in report.samples:
            self.store.record(report.agent_id, sample,
                              latency=kind != coordinator_pb2.MEASURE_KIND_BANDWIDTH,
                              bandwidth=not latency_only)
            if latency_only:  # the same round trip, seen from the other end
                mirrored = common_pb2.LinkSample()
                mirrored.CopyFrom(sample)
                mirrored.peer_id = report.agent_id
                self.store.record(sample.peer_id, mirrored, latency=True, bandwidth=False)
        future.set_result(None)
        return None

    async def measure(self, agents: list[AgentRecord]) -> common_pb2.LinkMatrix:
        """Measure every directed link between `agents`; returns their matrix."""
        async with self._lock:
            self.running = True
            try:
                return await self._measure(agents)
            finally:
                self.running = False

    async def _measure(self, agents: list[AgentRecord]) -> common_pb2.LinkMatrix:
        by_id = {a.agent_id: a for a in agents}
        ids = list(by_id)
        run = next(self._ids)
        started = time.monotonic()
        log.info("measuring %d links of %d agents", len(ids) * (len(ids) - 1), len(ids))
        silent: set[str] = set()  # agents that let a probe time out: not asked again this run
        # All latencies first, then all bandwidths (see MeasureKind in coordinator.proto).
        # A round trip a->b->a is b->a->b, so latency needs one probe per unordered pair.
        latency = [pair for pairs in round_robin_pairs(ids) for pair in pairs]
        await self._run(run, coordinator_pb2.MEASURE_KIND_LATENCY, latency, by_id, silent)
        log.info("latencies measured after %.1f s", time.monotonic() - started)
        bandwidth = [pair for phase in measurement_phases(ids) for pair in phase]
        await self._run(run, coordinator_pb2.MEASURE_KIND_BANDWIDTH, bandwidth, by_id, silent)
        self.last_seconds = time.monotonic() - started
        log.info("measured %d agents in %.1f s", len(ids), self.last_seconds)
        return self.store.matrix(ids)

    async def _run(self, run: int, kind: int, order: list[tuple[str, str]],
                   by_id: dict[str, AgentRecord], silent: set[str]) -> None:
        """Probe every (measurer, peer) in `order`, each device in one probe at a time.

        No phase barrier: a probe starts as soon as both its devices are free, so one slow
        pair holds up only the probes that need its devices, not a whole round.
        """
        loop = asyncio.get_running_loop()
        pending = list(order)
        running: dict[asyncio.Future[None], tuple[str, str, str, float]] = {}
        busy: set[str] = set()
        seq = itertools.count()
        while pending or running:
            for a, b in list(pending):
                if a in silent or b in silent:
                    pending.remove((a, b))
                    quiet = a if a in silent else b
                    self.store.mark_unreachable(
                        a, b, f"agent {quiet} did not answer an earlier probe")
                    continue
                if a in busy or b in busy:
                    continue
                pending.remove((a, b))
                round_id = f"m{run}-k{kind}-{next(seq)}"
                command = coordinator_pb2.Command(measure=coordinator_pb2.MeasureLinksCommand(
                    round_id=round_id,
                    peers=[coordinator_pb2.PeerTarget(agent_id=b, address=by_id[b].address)],
                    ping_count=self.ping_count, probe_seconds=self.probe_seconds,
                    probe_max_bytes=self.probe_max_bytes, kind=kind,  # type: ignore[arg-type]
                ))
                future: asyncio.Future[None] = loop.create_future()
                self._pending[(round_id, a)] = (future, kind)
                running[future] = (a, b, round_id, time.monotonic() + self.probe_timeout_s)
                busy.update((a, b))
                try:
                    self.registry.send(a, command)
                except KeyError:
                    future.set_result(None)
            if not running:
                continue
            next_deadline = min(deadline for *_, deadline in running.values())
            await asyncio.wait(list(running), return_when=asyncio.FIRST_COMPLETED,
                               timeout=max(0.0, next_deadline - time.monotonic()))
            now = time.monotonic()
            for future, (a, b, round_id, deadline) in list(running.items()):
                if not future.done() and now < deadline:
                    continue
                del running[future]
                busy.difference_update((a, b))
                self._pending.pop((round_id, a), None)
                if not future.done():
                    future.cancel()
                    silent.add(a)
                    why = (f"agent {a} did not report its probe of {b} within "
                           f"{self.probe_timeout_s:.0f} s")
                    self.store.mark_unreachable(a, b, why)
                    if kind == coordinator_pb2.MEASURE_KIND_LATENCY:
                        self.store.mark_unreachable(b, a, why)
