"""The reachability checker's bookkeeping: verdicts over dialers, and reports taken only for
what was asked (coordinator/links/reachability.py, dtfm/net/reach.py). The dials themselves run
against real daemons in tests/system/test_reach.py."""

from __future__ import annotations

import asyncio

import pytest

from agent.daemon.server import AgentService, registrar
from coordinator.daemon.registry import AgentRecord, Registry
from coordinator.job.dataplane import accepts
from coordinator.links import dataport
from coordinator.links.reachability import ReachChecker
from dtfm import rpc
from dtfm.net import reach
from dtfm.rpc import free_port
from protos.dtfm.v1 import common_pb2, coordinator_pb2

pytestmark = pytest.mark.timeout(30)
SECURITY = rpc.Security(token="test-token-0123456789")


def test_verdict_over_dialers() -> None:
    ok, bad = reach.result("a", ""), reach.result("b", "refused")
    assert reach.verdict([]) == reach.UNKNOWN
    assert reach.verdict([ok, ok]) == reach.EVERYWHERE
    assert reach.verdict([ok, bad]) == reach.SOME_PEERS
    assert reach.verdict([bad, bad]) == reach.NOWHERE
    assert reach.judged("h:1", [ok, bad]).summary.startswith("reachable from 1 of 2 dialers")
    no = reach.overridden("h:1", common_pb2.REACH_OVERRIDE_NO)
    assert no.verdict == reach.NOWHERE and no.overridden and "--reachable no" in no.summary


async def _check_with_one_peer() -> tuple[list[str | None], common_pb2.ReachStatus]:
    registry = Registry(liveness_timeout_s=10)
    closed = free_port()  # nothing listens there: the coordinator's own dial fails
    target = registry.join(common_pb2.AgentInfo(agent_id="target", host="127.0.0.1",
                                                port=closed))
    peer = registry.join(common_pb2.AgentInfo(agent_id="peer", host="127.0.0.1", port=1))
    checker = ReachChecker(registry, SECURITY, dial_timeout_s=1.0)
    task = asyncio.create_task(checker.check(target, target.stream_generation))
    command = await asyncio.wait_for(peer.commands.get(), 5)
    dial = command.dial
    assert dial.peer.agent_id == "target" and dial.peer.address == f"127.0.0.1:{closed}"
    answers = [
        checker.on_report(coordinator_pb2.DialReport(agent_id="peer", round_id="r999",
                                                     peer_id="target", ok=True)),
        checker.on_report(coordinator_pb2.DialReport(agent_id="target", round_id=dial.round_id,
                                                     peer_id="target", ok=True)),
        checker.on_report(coordinator_pb2.DialReport(agent_id="peer", round_id=dial.round_id,
                                                     peer_id="someone", ok=True)),
        checker.on_report(coordinator_pb2.DialReport(agent_id="peer", round_id=dial.round_id,
                                                     peer_id="target", ok=True)),
    ]
    await task
    pushed = await asyncio.wait_for(target.commands.get(), 5)
    assert pushed.reach == target.reach
    return answers, target.reach


def test_reports_count_only_from_the_peer_asked_for_the_agent_asked() -> None:
    """A report for a round nobody asked, from the wrong agent, or about another agent is
    refused; the asked peer's counts: it got through while the coordinator did not, so the
    target is reachable from some peers (one site's LAN)."""
    answers, status = asyncio.run(_check_with_one_peer())
    assert "no dial 'r999'" in answers[0]
    assert "is waiting for target" in answers[1]
    assert "not someone" in answers[2]
    assert answers[3] is None
    assert status.verdict == reach.SOME_PEERS, status
    assert {(d.dialer, d.ok) for d in status.dials} == {("coordinator", False), ("peer", True)}


async def _data_ports() -> tuple[AgentRecord, AgentRecord]:
    """A real agent gRPC server ("honest"); "liar" advertises honest's port as its data
    port, "quiet" a port nothing answers at; both say --reachable yes, so only their data
    ports are dialled."""
    honest = AgentService(common_pb2.AgentInfo(agent_id="honest"))
    server, port, _ = await rpc.start_server("127.0.0.1:0", SECURITY,
                                             registrar(honest), "honest")
    try:
        registry = Registry(liveness_timeout_s=10)
        yes = common_pb2.REACH_OVERRIDE_YES
        liar, quiet = (registry.join(common_pb2.AgentInfo(
            agent_id=name, host="127.0.0.1", port=free_port(), data_port=data, reachable=yes))
            for name, data in (("liar", port), ("quiet", free_port())))
        checker = ReachChecker(registry, SECURITY, dial_timeout_s=2.0)
        for rec in (liar, quiet):
            checker.on_join(rec)
        assert await checker.settled(["liar", "quiet"], 10) == []
        pushed = [c.reach for c in [liar.commands.get_nowait() for _ in range(2)]]
        assert pushed[-1].summary == liar.reach.summary
        return liar, quiet
    finally:
        await server.stop(None)


def test_a_data_port_another_agent_answers_at_is_refused() -> None:
    """Issue 41: the coordinator dials a data port the dial-back does not cover; one another
    agent answers at is not used (the member only dials out), and says why on its line; one
    nothing answers at proves nothing and stays in use."""
    liar, quiet = asyncio.run(_data_ports())
    refusal = (f"agent liar's data port {liar.info.data_port} is not used: "
               f"127.0.0.1:{liar.info.data_port} is agent honest's")
    assert liar.data_port == 0 and liar.data_port_refused.startswith(refusal)
    assert liar.reach.verdict == reach.EVERYWHERE and refusal in liar.reach.summary
    assert not accepts(liar)
    assert quiet.data_port == quiet.info.data_port > 0 and not quiet.data_port_refused
    assert accepts(quiet)
    # what needs a dial of its own: not a port the dial-back covers, nor one never dialled
    no, auto = common_pb2.REACH_OVERRIDE_NO, common_pb2.REACH_OVERRIDE_AUTO
    shared = common_pb2.AgentInfo(agent_id="s", port=7071, data_port=7071, reachable=auto)
    assert not dataport.needs_check(AgentRecord(shared, 0, 0))
    assert dataport.needs_check(AgentRecord(liar.info, 0, 0))  # --reachable yes
    own = common_pb2.AgentInfo(agent_id="o", port=7071, data_port=9000, reachable=auto)
    assert dataport.needs_check(AgentRecord(own, 0, 0))
    own.reachable = no
    assert not dataport.needs_check(AgentRecord(own, 0, 0))
    again = Registry(liveness_timeout_s=10)
    row = again.join(liar.info)
    row.data_port_refused = "x"
    assert again.join(liar.info, row.secret).data_port_refused == ""  # a re-join checks anew
