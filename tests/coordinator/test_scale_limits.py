"""What keeps one coordinator's work per event from growing with the number of agents (issue
46, bench/scale.py): the job's loops are paced however often agents poke it, a scrape does
not carry N^2 link series, and a sampled measurement orders its probes without listing every
link."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import generate_latest

from coordinator.daemon import metrics
from coordinator.daemon.config import JobConfig
from coordinator.daemon.metrics import MAX_LINK_SERIES, coordinator_registry
from coordinator.daemon.registry import Registry
from coordinator.job import machine
from coordinator.job.machine import FOLLOW_EVERY_S, Job
from coordinator.links.measure import LinkMeasurer
from coordinator.links.store import LinkStore, in_rotation, rotation_rounds
from protos.dtfm.v1 import common_pb2


def _job(links: LinkStore) -> tuple[Registry, Job]:
    registry = Registry(5.0)
    return registry, Job(JobConfig(model="gpt-tiny", agents=2), registry,
                         LinkMeasurer(registry, links), links)


def test_the_job_wakes_at_most_every_follow_period_however_often_it_is_poked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert FOLLOW_EVERY_S <= 0.1  # a failure or a finished job is seen within 0.1 s
    monkeypatch.setattr(machine, "FOLLOW_EVERY_S", 0.02)

    async def passes() -> int:
        _, job = _job(LinkStore())
        stop = time.monotonic() + 5 * 0.02

        async def poke() -> None:  # a thousand agents' heartbeats: a poke every millisecond
            while time.monotonic() < stop:
                job.poke()
                await asyncio.sleep(0.0005)

        poker, count = asyncio.ensure_future(poke()), 0
        while time.monotonic() < stop:
            await job._wait()  # noqa: SLF001 - the pacing under test
            count += 1
        await poker
        return count

    assert asyncio.run(passes()) <= 7  # 5 periods, and the first pass is not held back


def _links(agents: int) -> LinkStore:
    links = LinkStore()
    for a in range(agents):
        for b in range(agents):
            if a != b:
                links.record(f"a{a}", common_pb2.LinkSample(
                    peer_id=f"a{b}", delay_ms=10.0, bandwidth_gbps=1.0, reachable=True))
    return links


def test_a_scrape_leaves_out_per_link_series_past_the_limit_but_counts_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert MAX_LINK_SERIES == 64 * 63  # 64 agents' links, all pairs, keep their series
    monkeypatch.setattr(metrics, "MAX_LINK_SERIES", 3 * 2)
    for agents, per_link in ((3, True), (4, False)):
        links = _links(agents)
        registry, job = _job(links)
        text = generate_latest(coordinator_registry(registry, job, links)).decode()
        assert ("dtfm_link_delay_seconds{" in text) is per_link
        assert f'dtfm_links{{state="reachable"}} {float(agents * (agents - 1))}' in text


def test_in_rotation_keeps_the_rounds_order_of_the_links_it_is_given() -> None:
    ids = [f"a{i}" for i in range(7)]
    every = [link for rnd in rotation_rounds(ids) for link in rnd]
    some = set(every[::3])
    assert in_rotation(ids, some) == [link for link in every if link in some]
