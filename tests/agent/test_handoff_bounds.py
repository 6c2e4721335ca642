"""What a stranger can make an agent hold through its one public port (issue 41): data-plane
hellos wait only for the epoch the agent runs or starts, within bounds per source and in all,
and the port keeps serving real hand-offs under 1,100 hellos and a 1,024-descriptor limit.

Real sockets throughout: the agent's front and hand-off on a loop thread (tests/agent/
handoffs.py) or in a process of their own, the ranks real `Mesh`es. Sources are distinct
loopback addresses (127.0.0.0/8 is all loopback on Linux).
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from dtfm.net import dataplane as dp
from dtfm.net.parking import Parking
from tests.agent.handoffs import LoopAgent, closed, dial_hello, mesh, wait_for

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def _dial(agent: LoopAgent, epoch: int, job: str = "job-a",
          source: str = "127.0.0.1") -> socket.socket:
    """A hello for (job, epoch) from `source`, once the hand-off has been given it."""
    before = agent.seen()
    s = dial_hello(agent.port, epoch, job, source)
    wait_for(lambda: agent.seen() > before, "the hand-off to be given the hello")
    return s


def test_hellos_for_an_epoch_the_agent_neither_runs_nor_starts_are_closed_at_once() -> None:
    agent = LoopAgent(epoch=3, wait_s=30.0, ahead_wait_s=30.0)
    made_up: list[socket.socket] = []
    try:
        for i in range(100):  # a made-up job, and this job's epochs that are over
            made_up.append(dial_hello(agent.port, 3 + i, f"job-made-up-{i}"))
            made_up.append(dial_hello(agent.port, i % 3, "job-a"))
        started = time.monotonic()
        assert all(closed(s, timeout_s=5) for s in made_up)
        assert time.monotonic() - started < 5  # at once, not after the 30 s wait
        wait_for(lambda: agent.handoff.refused == 200, "every refusal to be counted")
        assert len(agent.handoff.parking) == 0
        mine, ahead = _dial(agent, 3), _dial(agent, 4)  # its epoch; the next, maybe on its way
        assert len(agent.handoff.parking) == 2
        assert not closed(mine, timeout_s=0.3) and not closed(ahead, timeout_s=0.01)
        # a stop ends the epoch: what waits for it is closed; the job's next epoch still waits
        agent.on_loop(agent.handoff.release)
        assert closed(mine, timeout_s=5) and not closed(ahead, timeout_s=0.3)
        with dial_hello(agent.port, 3) as late:
            assert closed(late, timeout_s=5)
    finally:
        for s in made_up:
            s.close()
        agent.close()


def test_an_early_dial_for_the_next_epoch_reaches_its_worker_once_assigned() -> None:
    """A peer may dial before this agent's own assignment arrives: it waits `ahead_wait_s`,
    then, assigned, as long as any connection of the agent's epoch."""
    agent = LoopAgent(epoch=3, ahead_wait_s=1.0)
    try:
        peers: dict[int, str | None] = {0: f"127.0.0.1:{agent.port}", 1: None}
        m1 = mesh(1, peers, None, epoch=4)
        try:
            sent = m1.send(0, 0, 7, torch.arange(64, dtype=torch.float32))
            wait_for(lambda: len(agent.handoff.parking) == 1, "the early dial to wait")
            agent.on_loop(agent.handoff.hold, "job-a", 4)
            time.sleep(1.5)  # past the early wait: the assignment made it a full one
            m0 = mesh(0, peers, agent.handoff.name, epoch=4)
            try:
                got = torch.zeros(64)
                m0.recv(1, 0, 7, got).wait(timedelta(seconds=10))
                sent.wait(timedelta(seconds=10))
                assert torch.equal(got, torch.arange(64, dtype=torch.float32))
                assert agent.handoff.handed == 1 and agent.handoff.dropped == 0
            finally:
                m0.close()
        finally:
            m1.close()
    finally:
        agent.close()


def test_waiting_connections_are_bounded_per_source_and_in_all() -> None:
    agent = LoopAgent(epoch=1, wait_s=30.0, parking=Parking(total=12, per_source=4))
    socks: dict[str, list[socket.socket]] = {}
    try:
        flood = socks["127.0.0.2"] = [_dial(agent, 1, source="127.0.0.2") for _ in range(10)]
        # over its source's bound, the source's oldest went: a flood pushes out only its own
        assert [closed(s, timeout_s=0.2) for s in flood] == [True] * 6 + [False] * 4
        assert agent.handoff.parking.held_by("127.0.0.2") == 4 and agent.handoff.evicted == 6
        for host in ("127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6"):
            socks[host] = [_dial(agent, 1, source=host) for _ in range(2)]
        assert len(agent.handoff.parking) == 12 and agent.handoff.evicted == 6
        # over the bound in all, the largest holder loses its oldest, not a small honest source
        socks["127.0.0.7"] = [_dial(agent, 1, source="127.0.0.7")]
        assert len(agent.handoff.parking) == 12 and agent.handoff.evicted == 7
        assert closed(flood[6], timeout_s=5)
        for host in ("127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6", "127.0.0.7"):
            assert not any(closed(s, timeout_s=0.01) for s in socks[host]), host
        # many sources of many connections: the bound in all holds
        for i in range(200):
            socks.setdefault(f"127.0.1.{i % 50}", []).append(
                _dial(agent, 1, source=f"127.0.1.{i % 50}"))
        assert len(agent.handoff.parking) == 12
        assert max(agent.handoff.parking.held_by(h) for h in socks) <= 4
        # a dialer that gives up frees its place at once, not at the end of its wait
        for s in socks["127.0.1.49"]:
            s.close()
        wait_for(lambda: agent.handoff.abandoned >= 1, "the hand-off to see the dialer leave")
    finally:
        for group in socks.values():
            for s in group:
                s.close()
        agent.close()


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_the_agents_port_keeps_serving_under_1100_hellos_and_1024_descriptors() -> None:
    """The issue's attack, on an agent process with systemd's default limit: half the hellos
    name a made-up epoch, half the agent's own from ten sources. Its descriptors stay
    bounded, and a real peer's connection still reaches its worker."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 4096:
        pytest.skip(f"needs 4,096 open files for the attacker's side; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), hard))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "tests.agent.handoffs", "1"], cwd=ROOT,
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    attack: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        started = json.loads(proc.stdout.readline())
        port, name = started["port"], started["handoff"]
        baseline, most = _open_fds(proc.pid), 0
        for i in range(550):
            attack.append(dial_hello(port, 7, "job-made-up", "127.0.0.2"))
            attack.append(dial_hello(port, 1, "job-a", f"127.0.0.{3 + i % 10}"))
            if i % 50 == 0:
                most = max(most, _open_fds(proc.pid))
        # what the agent holds once the front has sorted them (connections still being
        # sniffed are the front's to bound): the lot's default bound in all (256) at most
        wait_for(lambda: _open_fds(proc.pid) - baseline <= 256, "the agent to let go",
                 timeout_s=10)
        time.sleep(1.0)
        settled = _open_fds(proc.pid)
        assert settled - baseline <= 256, (baseline, most, settled)
        print(f"agent descriptors: {baseline} before, at most {most} during the flood "
              f"(sampled), {settled} after")
        assert all(closed(s, timeout_s=5) for s in attack[::2])  # the made-up epoch's
        peers: dict[int, str | None] = {0: f"127.0.0.1:{port}", 1: None}
        m1 = mesh(1, peers, None)  # dials while the attacker's connections still wait
        try:
            sent = m1.send(0, 0, 7, torch.arange(256, dtype=torch.float32))
            time.sleep(0.5)
            m0 = mesh(0, peers, name)
            try:
                got = torch.zeros(256)
                m0.recv(1, 0, 7, got).wait(timedelta(seconds=20))
                sent.wait(timedelta(seconds=20))
                assert torch.equal(got, torch.arange(256, dtype=torch.float32))
            finally:
                m0.close()
        finally:
            m1.close()
    finally:
        for s in attack:
            s.close()
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_a_worker_that_does_not_take_its_connections_neither_stalls_the_agent_nor_gets_them_all(
        ) -> None:
    """Connections handed but not yet taken sit in the worker's queue: the agent fills it
    without blocking, keeps the rest waiting in its lot, and hands them on as it drains."""
    agent = LoopAgent(epoch=1, wait_s=30.0)
    worker = dp.connect_handoff(agent.handoff.name, "job-a", 1)  # claims, then reads nothing
    flood: list[socket.socket] = []
    try:
        first = _dial(agent, 1)
        wait_for(lambda: agent.handoff.handed == 1, "the claim to take effect")
        flood = [first] + [_dial(agent, 1, source=f"127.0.2.{i % 5}") for i in range(149)]
        queued = agent.handoff.handed
        assert 10 <= queued <= 100 and len(agent.handoff.parking) == 150 - queued, queued
        with dial_hello(agent.port, 2, "job-made-up") as s:  # the agent's loop still serves
            assert closed(s, timeout_s=2)
        worker.settimeout(10)
        for _ in range(150):  # the worker drains its queue: the rest follows, none lost
            handed = dp.receive_handed(worker)
            assert handed is not None
            handed.close()
        # the agent counts a connection handed just after passing it on: the worker may
        # hold the 150th before the agent's loop has counted it
        wait_for(lambda: agent.handoff.handed == 150 and not agent.handoff.parking,
                 "the agent to count the last connection it handed")
    finally:
        worker.close()
        for s in flood:
            s.close()
        agent.close()
