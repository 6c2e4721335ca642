"""Measured links match an emulated wide-area network; dead peers become unreachable links."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest

from coordinator.links.store import rotation_rounds
from dtfm.wan import WanEmulator
from dtfm.wan.cluster import WanCluster, measurement_wan

AVAILABLE, WHY = WanEmulator.available()
needs_wan = pytest.mark.skipif(not AVAILABLE, reason=f"no WAN emulator here: {WHY}")


def test_rotation_covers_every_directed_link_once_and_keeps_reverse_links_apart() -> None:
    for n in range(2, 10):
        ids = [f"a{i}" for i in range(n)]
        rounds = rotation_rounds(ids)
        assert len(rounds) == n - 1
        directed = [link for links in rounds for link in links]
        assert sorted(directed) == sorted((a, b) for a in ids for b in ids if a != b)
        for k, links in enumerate(rounds, start=1):
            senders = [a for a, _ in links]
            receivers = [b for _, b in links]
            assert len(set(senders)) == len(senders) == n, "a device sends twice in a round"
            assert len(set(receivers)) == n, "a device receives twice in a round"
            reversed_too = [(a, b) for a, b in links if (b, a) in links]
            assert not reversed_too or 2 * k == n, f"round {k} measures a link and its reverse"


LOAD_MS = 10.0  # what a saturated 2-core host may add to every ping of a link (below)


def _matrix(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    delay = rng.uniform(5, 150, (n, n))
    delay = np.round((delay + delay.T) / 2, 1)  # RTT/2 only sees the round trip's mean
    bandwidth = np.round(rng.uniform(5, 100, (n, n)), 1)
    np.fill_diagonal(delay, 0)
    np.fill_diagonal(bandwidth, 0)
    return delay, bandwidth


@needs_wan
@pytest.mark.timeout(400)
def test_measured_matrix_matches_the_emulated_one(tmp_path: Path) -> None:
    """Every directed link reads its emulated delay and rate. A loaded host only adds delay
    and takes rate (a gRPC ping waits for a core, and so does the emulator's forwarding): a
    full suite on 2 cores once read 131.8 ms for 119.0, and once 57 Mbit/s for 99. So where
    a link misses, the matrix is measured once more and each link keeps the better of its
    two readings, which load cannot make better than the truth: a measurement that reads
    too fast or too short still fails."""
    n = 4
    delay, bandwidth = _matrix(n, seed=7)
    with measurement_wan(delay.tolist(), bandwidth.tolist()) as wan:
        cluster = WanCluster(wan, tmp_path, agents=n)
        ids = cluster.start()
        # `--ping-spread` across hosts (the jobs' own measurements cover the default): each
        # agent's pings to a peer spread over 2 s still read every delay
        started = time.monotonic()
        got_delay, got_bw = _read(cluster.measure(ping_spread_s=2.0), ids)
        assert time.monotonic() - started >= 2.0
        if _misses(delay, bandwidth, got_delay, got_bw):
            again_delay, again_bw = _read(cluster.measure(ping_spread_s=2.0), ids)
            got_delay = np.minimum(got_delay, again_delay)
            got_bw = np.maximum(got_bw, again_bw)
    errors = _misses(delay, bandwidth, got_delay, got_bw)
    assert not errors, "\n".join(errors)


def _read(measured: dict, ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """A measured matrix's delays (ms) and rates (Mbit/s), in `ids` order."""
    assert measured["unreachable"] == []
    order = [measured["agents"].index(i) for i in ids]
    got_delay = np.array(measured["delay_ms"], dtype=float)[np.ix_(order, order)]
    got_bw = np.array(measured["bandwidth_gbps"], dtype=float)[np.ix_(order, order)] * 1000
    return got_delay, got_bw


def _misses(delay: np.ndarray, bandwidth: np.ndarray, got_delay: np.ndarray,
            got_bw: np.ndarray) -> list[str]:
    errors = []
    n = len(delay)
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            d, b = got_delay[i, j], got_bw[i, j]
            # the minimum of the pings may read up to LOAD_MS more than the delay, never less
            slack = max(2.0, 0.10 * delay[i, j])
            if not -slack <= d - delay[i, j] <= slack + LOAD_MS:
                errors.append(f"delay {i}->{j}: measured {d:.1f} ms, emulated {delay[i, j]}")
            if not abs(b - bandwidth[i, j]) <= 0.20 * bandwidth[i, j]:
                errors.append(f"bandwidth {i}->{j}: measured {b:.1f} Mbit/s, emulated "
                              f"{bandwidth[i, j]}")
    return errors


@needs_wan
@pytest.mark.timeout(400)
def test_links_half_the_world_away_read_their_rate_not_slow_starts(tmp_path: Path) -> None:
    """Four hosts 235 ms apart one way at 9 Mbit/s (Seoul-Frankfurt in the WAN demo, which
    read one direction at 2.1 in 2 of 4 rounds: the probe's in-flight limit, sized from slow
    start's first reports, held it under ~3 Mbit/s; `linkprobe.inflight_limit`). Every one
    of the 12 directions reads within 25 % of its rate."""
    n, rate = 4, 9.0
    delay = [[0 if i == j else 235 for j in range(n)] for i in range(n)]
    bandwidth = [[0 if i == j else rate for j in range(n)] for i in range(n)]
    with measurement_wan(delay, bandwidth) as wan:
        cluster = WanCluster(wan, tmp_path, agents=n)
        ids = cluster.start()
        measured = cluster.measure()
    order = [measured["agents"].index(i) for i in ids]
    got = np.array(measured["bandwidth_gbps"], dtype=float)[np.ix_(order, order)] * 1000
    low = [f"{i}->{j}: {got[i, j]:.1f} Mbit/s" for i in range(n) for j in range(n)
           if i != j and not got[i, j] >= 0.75 * rate]
    assert not low, f"read under 75 % of {rate} Mbit/s: {low}"


@needs_wan
@pytest.mark.timeout(300)
def test_a_dead_peer_is_reported_unreachable_and_left_out(tmp_path: Path) -> None:
    n = 3
    delay = [[0, 10, 10], [10, 0, 10], [10, 10, 0]]
    bw = [[0, 50, 50], [50, 0, 50], [50, 50, 0]]
    with measurement_wan(delay, bw) as wan:
        cluster = WanCluster(wan, tmp_path, agents=n)
        ids = cluster.start()
        # freeze agent 2: its peers' probes of it hang until their deadline, and the round
        # stops waiting for its own report once its silence has the coordinator lose it
        cluster.agent_procs[2].send_signal(signal.SIGSTOP)
        try:
            measured = cluster.measure(timeout=300)
        finally:
            cluster.agent_procs[2].send_signal(signal.SIGCONT)
    dead = ids[2]
    unreachable = set(measured["unreachable"])
    assert {f"{ids[0]}->{dead}", f"{ids[1]}->{dead}"} <= unreachable
    assert f"{ids[0]}->{ids[1]}" not in unreachable
    a, b = measured["agents"].index(ids[0]), measured["agents"].index(ids[1])
    # the live pair is measured, not dropped with the dead one (its accuracy is the first
    # test's: here its pings run beside the ones hanging on the frozen agent, and read 2.5 ms
    # high on a loaded 2-core machine, 8.5 ms high once in a CI rehearsal with the full suite
    # beside it); never below the emulated delay
    assert 6 <= measured["delay_ms"][a][b] <= 30, measured["delay_ms"]
    assert measured["excluded"] == [dead], "the scheduler must be told to leave it out"


# An ordinary volunteer uplink, far away: 2.1 Mbit/s and 171 ms one way between the two agents
# (the coordinator's host 0 has free links). Hosts keep Linux's default TCP settings and a
# 1500-byte MTU, as an agent started by hand does: its probes stall for retransmission
# timeouts and count whole 16 KiB chunks, so their windows need not agree.
SLOW_MBPS, FAR_MS = 2.1, 171.0
SLOW_JOB = ["--model", "gpt-tiny", "--agents", "2", "--stages", "2", "--replicas", "1",
            "--steps", "2", "--batch", "2", "--micro-batches", "1", "--search-seconds", "1",
            "--max-restarts", "0"]


@needs_wan
@pytest.mark.timeout(400)
def test_a_slow_far_link_is_measured_and_its_agents_train(tmp_path: Path) -> None:
    """The job measures the slow link (an estimate at worst, never "unreachable"), leaves
    nobody out and trains across it."""
    delay = [[0, 0, 0], [0, 0, FAR_MS], [0, FAR_MS, 0]]
    rate: list[list[float | None]] = [[None, None, None], [None, None, SLOW_MBPS],
                                      [None, SLOW_MBPS, None]]
    with WanEmulator(delay_ms=delay, bandwidth_mbps=rate) as wan:
        cluster = WanCluster(wan, tmp_path, agents=2, coordinator_args=SLOW_JOB)
        try:
            ids = cluster.start()
            status = cluster.wait_job(timeout=300)
        finally:
            cluster.stop()
    log = (tmp_path / "coordinator.log").read_text()
    assert " lost: " not in log and "unreachable" not in log, log[-3000:]
    assert status["job"]["state"] == "done", status["job"]
    assert [a["state"] for a in status["agents"]] == ["alive", "alive"]
    for agent in status["agents"]:  # a fresh namespace has Linux's default: say so
        assert "net.ipv4.tcp_slow_start_after_idle = 0" in [t["line"] for t in agent["tuning"]]
    links = status["links"]
    assert links["unreachable"] == [] and links["excluded"] == []
    order = [links["agents"].index(i) for i in ids]
    for a, b in ((0, 1), (1, 0)):
        mbps = links["bandwidth_gbps"][order[a]][order[b]] * 1000
        assert SLOW_MBPS / 2 <= mbps <= SLOW_MBPS * 2, f"{a}->{b}: {mbps:.2f} Mbit/s"
        delay_ms = links["delay_ms"][order[a]][order[b]]
        assert abs(delay_ms - FAR_MS) <= 0.1 * FAR_MS, f"{a}->{b}: {delay_ms:.1f} ms"
    for pair, note in links["estimated"].items():  # an estimate says how it was made
        assert pair in {f"{ids[0]}->{ids[1]}", f"{ids[1]}->{ids[0]}"}
        assert note.startswith("no steady rate"), note
