"""A job plans an epoch only once its members' reachability verdicts are in (issue 32).

The race it closes: an agent behind a NAT joins, the job has enough agents at once, and the
coordinator's dial-back of the newcomer ends only at its timeout. Planned before the verdict,
the newcomer counts as "not checked" and `--transport auto` picks gloo, which cannot reach
it: the epoch fails. Real registry, checker and data-plane rule; the agent's address is a
TCP listener that never answers gRPC (the dial ends at its timeout, as into a NAT).
"""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from coordinator.daemon.config import JobConfig
from coordinator.daemon.registry import Registry
from coordinator.job.dataplane import DataPlanes
from coordinator.job.membership import Membership
from coordinator.links.measure import LinkMeasurer
from coordinator.links.reachability import ReachChecker
from coordinator.links.store import LinkStore
from dtfm import rpc
from dtfm.net import reach
from protos.dtfm.v1 import common_pb2, coordinator_pb2

pytestmark = pytest.mark.timeout(60)


def _silent_listener() -> socket.socket:
    """Accepts TCP connections (the kernel's backlog) and never says a word."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    return sock


def _membership(dial_timeout_s: float) -> tuple[Registry, ReachChecker, Membership]:
    """A real registry, reachability checker and job membership, with no agent yet."""
    registry = Registry(liveness_timeout_s=30)
    checker = ReachChecker(registry, rpc.Security(token=""), dial_timeout_s=dial_timeout_s)
    links = LinkStore()
    membership = Membership(JobConfig(), registry, LinkMeasurer(registry, links), links,
                            checker)
    return registry, checker, membership


def _world(dial_timeout_s: float, override: int = common_pb2.REACH_OVERRIDE_AUTO,
           ) -> tuple[Registry, ReachChecker, Membership, socket.socket]:
    registry, checker, membership = _membership(dial_timeout_s)
    silent = _silent_listener()
    registry.join(common_pb2.AgentInfo(agent_id="natted", host="127.0.0.1",
                                       port=silent.getsockname()[1], reachable=override))
    return registry, checker, membership, silent


async def _plan_after_join() -> tuple[str, str, int]:
    registry, checker, membership, silent = _world(dial_timeout_s=1.0)
    try:
        rec = registry.get("natted")
        assert rec is not None
        checker.on_join(rec)  # as the server does on Join
        assert checker.checking(["natted"]) == ["natted"]
        racing = DataPlanes("auto").backend([rec])  # what planning at once would pick
        members = await membership.with_verdicts([rec])
        return racing, DataPlanes("auto").backend(members), members[0].reach.verdict
    finally:
        await checker.close()
        silent.close()


def test_the_epoch_waits_for_a_newcomers_verdict_and_picks_dtfm() -> None:
    racing, planned, verdict = asyncio.run(_plan_after_join())
    assert racing == "gloo"  # the race: not checked yet counts as reachable
    assert verdict == reach.NOWHERE
    assert planned == "dtfm"


async def _bounded(caplog: pytest.LogCaptureFixture) -> tuple[list[str], int]:
    registry, checker, membership, silent = _world(dial_timeout_s=20.0)
    try:
        rec = registry.get("natted")
        assert rec is not None
        checker.on_join(rec)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with caplog.at_level(logging.INFO, logger="coordinator.job.membership"):
            await membership.with_verdicts([rec], bound_s=0.3)
        assert loop.time() - start < 5.0  # the bound, not the 20 s dial, ended the wait
        return checker.checking(["natted"]), rec.reach.verdict
    finally:
        await checker.close()
        silent.close()


def test_the_wait_is_bounded_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    pending, verdict = asyncio.run(_bounded(caplog))
    assert pending == ["natted"] and verdict == reach.UNKNOWN
    assert "no reachability verdict for natted after 0.3 s" in caplog.text
    assert "waiting up to 0.3 s for the reachability verdict of natted" in caplog.text


async def _overridden() -> tuple[list[str], int]:
    registry, checker, membership, silent = _world(dial_timeout_s=20.0,
                                                   override=common_pb2.REACH_OVERRIDE_NO)
    try:
        rec = registry.get("natted")
        assert rec is not None
        checker.on_join(rec)
        await asyncio.wait_for(membership.with_verdicts([rec]), 1.0)  # nothing to wait for
        return checker.checking(["natted"]), rec.reach.verdict
    finally:
        await checker.close()
        silent.close()


def test_an_operators_verdict_is_not_waited_for() -> None:
    pending, verdict = asyncio.run(_overridden())
    assert pending == [] and verdict == reach.NOWHERE


def test_the_default_bound_covers_the_longest_check() -> None:
    checker = ReachChecker(Registry(liveness_timeout_s=30), rpc.Security(token=""))
    assert checker.longest_check_s >= reach.DIAL_TIMEOUT_S


def _dials(queue: asyncio.Queue[coordinator_pb2.Command]) -> list[coordinator_pb2.DialCommand]:
    """The dial commands waiting on an agent's Join stream (as its agent would read them)."""
    found = []
    while not queue.empty():
        command = queue.get_nowait()
        if command is not None and command.HasField("dial"):
            found.append(command.dial)
    return found


async def _site_pair() -> tuple[bool, int, int]:
    """Two agents of one NAT'd site: the first is judged "nowhere" (nobody else existed); the
    second joins and is asked to dial it back (a backfill), and gets through. An epoch planned
    for both must wait for that dial too, not only for the newcomer's own check."""
    registry, checker, membership = _membership(dial_timeout_s=1.0)
    listeners = [_silent_listener(), _silent_listener()]
    try:
        first = registry.join(common_pb2.AgentInfo(
            agent_id="first", host="127.0.0.1", port=listeners[0].getsockname()[1]))
        checker.on_join(first)
        assert not await checker.settled(["first"], 10.0)
        assert first.reach.verdict == reach.NOWHERE
        second = registry.join(common_pb2.AgentInfo(
            agent_id="second", host="127.0.0.1", port=listeners[1].getsockname()[1]))
        checker.on_join(second)
        planning = asyncio.ensure_future(membership.with_verdicts([first, second]))
        await asyncio.sleep(0.1)  # the checks start and send their dial commands
        ask_first, = _dials(first.commands)  # the newcomer's own check: can first dial it?
        backfill, = _dials(second.commands)  # and can the newcomer dial first?
        assert (ask_first.peer.agent_id, backfill.peer.agent_id) == ("second", "first")
        assert checker.on_report(coordinator_pb2.DialReport(
            agent_id="first", round_id=ask_first.round_id, peer_id="second", ok=True)) is None
        while second.reach.verdict == reach.UNKNOWN:  # its own check settles (~1 s)
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        waited = not planning.done()  # the backfill of first is still out
        assert checker.on_report(coordinator_pb2.DialReport(
            agent_id="second", round_id=backfill.round_id, peer_id="first", ok=True)) is None
        await asyncio.wait_for(planning, 5.0)
        return waited, first.reach.verdict, second.reach.verdict
    finally:
        await checker.close()
        for sock in listeners:
            sock.close()


def test_the_epoch_waits_for_a_newcomers_dial_of_an_earlier_agent() -> None:
    waited, first, second = asyncio.run(_site_pair())
    assert waited
    assert first == second == reach.SOME_PEERS
