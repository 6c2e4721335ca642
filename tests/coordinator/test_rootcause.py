"""The job acts on the root cause of a failure, not on the first report to arrive.

A worker that fails on its own input makes its pipeline neighbour fail with a peer error, and
the neighbour's agent may heartbeat first; a lost agent makes the survivors fail long before
the registry's liveness timeout notices it. The job (real `Job`, fake registry and agents from
test_job_states) must fail on the configuration error without a needless recovery, and show
the lost agent as the recovery's reason.
"""

from __future__ import annotations

import asyncio
import time

from coordinator.job import rootcause
from dtfm.core import staleentry
from dtfm.core.staleentry import StaleEntry
from dtfm.core.workerstate import WorkerState
from protos.dtfm.v1 import coordinator_pb2
from tests.coordinator.test_job_states import FAILED, RECOVERING, Harness, config, run, until

S = coordinator_pb2
PEER = "PeerError: rank 1: pipeline receive failed after 0.2 s: Connection closed by peer"


def test_causes_rank_configuration_over_a_lost_agent_over_what_they_cause() -> None:
    assert rootcause.outranks("config", "peer") and rootcause.outranks("lost", "peer")
    assert rootcause.outranks("config", "lost") and rootcause.outranks("internal", "peer")
    assert not rootcause.outranks("peer", "peer") and not rootcause.outranks("peer", "config")
    assert rootcause.hold_s("config", since=10.0, now=10.0, heartbeat_interval_s=2.0) == 0.0
    assert rootcause.hold_s("peer", since=10.0, now=10.5, heartbeat_interval_s=2.0) == 2.5
    assert rootcause.hold_s("peer", since=10.0, now=20.0, heartbeat_interval_s=2.0) == 0.0


def test_a_config_error_heard_after_its_neighbours_peer_error_fails_the_job_at_once() -> None:
    async def body(h: Harness) -> None:
        await h.running_epoch(1)
        h.report("agent-1", WorkerState.FAILED, error=PEER, error_kind="peer")
        await asyncio.sleep(0.02)  # the neighbour's agent heartbeats first
        h.report("agent-0", WorkerState.FAILED, error_kind="config",
                 error="ValueError: checkpoint step 10 of stage 0 lacks tensor wte.weight")
        await until(lambda: h.job.state == FAILED)
        assert "lacks tensor wte.weight" in h.job.message and "invalid" in h.job.message
        assert RECOVERING not in h.job.entered and h.job.epoch == 1
        assert all(a.kinds() == ["assign", "stop"] for a in h.registry.agents.values())
    run(config(max_restarts=3), body)


def test_a_member_lost_while_its_neighbours_errors_arrive_is_the_recovery_reason() -> None:
    async def body(h: Harness) -> None:
        await h.running_epoch(1)
        h.report("agent-1", WorkerState.FAILED, error=PEER, error_kind="peer")
        h.registry.states["agent-3"] = S.AGENT_STATE_LOST  # the registry's sweep did this
        h.job.on_lost([h.registry.agents["agent-3"]])
        await until(lambda: h.job.state == RECOVERING)
        reason = h.job.recoveries.items[-1].reason
        assert reason.startswith("lost agent(s) agent-3") and "Connection closed" in reason
    run(config(max_restarts=3), body)


def test_a_member_found_lost_after_the_recovery_began_becomes_its_reason() -> None:
    async def body(h: Harness) -> None:
        await h.running_epoch(1)
        h.registry.agents["agent-3"].silent_since = time.monotonic()  # it died
        h.report("agent-1", WorkerState.FAILED, error=PEER, error_kind="peer")
        await until(lambda: "3 of 4 alive" in h.job.message)  # the recovery waits for it
        assert h.job.recoveries.items[-1].reason.startswith("worker on agent-1 failed")
        h.registry.states["agent-3"] = S.AGENT_STATE_LOST  # its liveness timeout passed
        h.job.on_lost([h.registry.agents["agent-3"]])
        reason = h.job.recoveries.items[-1].reason
        assert reason.startswith("lost agent(s) agent-3 (seen first as: worker on agent-1"), \
            reason
        assert h.job.status().recoveries[-1].reason == reason  # what status shows
    run(config(max_restarts=3), body, agents=4)


def test_a_non_finite_loss_fails_the_job_instead_of_being_retried() -> None:
    """A worker reports a non-finite loss as a `config` failure: retrying the same weights and
    data diverges the same way, so the job fails with restarts left, in a recovered epoch too."""
    async def body(h: Harness) -> None:
        await h.running_epoch(1)
        h.report("agent-2", WorkerState.FAILED, error=PEER, error_kind="peer")
        await h.running_epoch(2)
        h.report("agent-0", WorkerState.FAILED, error_kind="config",
                 error="ValueError: the loss at step 7 is nan: lower --lr or check the data")
        await until(lambda: h.job.state == FAILED)
        await asyncio.sleep(0.05)
        assert h.job.epoch == 2 and "loss at step 7 is nan" in h.job.message
        assert "rescheduling" not in h.job.message and "invalid" in h.job.message
    run(config(max_restarts=5), body)


def _stale(h: Harness, wanted: str, answered: str) -> str:
    """The error a worker reports when `wanted`'s peer-table entry is answered by `answered`
    (the transport's own words, dtfm/core/staleentry.py, wrapped as the worker wraps them)."""
    ranks = h.job.members
    entry = h.registry.agents[wanted].info
    exc = StaleEntry(f"{entry.host}:{entry.data_port}", ranks.index(answered), ranks.index(wanted))
    return (f"PeerError: rank {ranks.index(answered)}: pipeline receive failed after 0.1 s; "
            f"caused by StaleEntry: {exc}")


def test_a_stale_peer_table_entry_is_blamed_on_the_member_whose_entry_was_wrong() -> None:
    """Issue 41: agent-0 advertises agent-1's port as its data port. agent-1's worker dials
    agent-0's rank there, is answered by its own rank, and fails "the peer table is stale".
    The failure names agent-0 (its entry was wrong, as the coordinator's records show), not
    agent-1 that reported it; agent-0's data port is refused, and the job recovers."""
    async def body(h: Harness) -> None:
        liar, honest = h.registry.agents["agent-0"], h.registry.agents["agent-1"]
        liar.info.host, liar.info.data_port = honest.info.host, honest.info.port
        for a in h.registry.agents.values():
            a.data_port_refused = ""  # type: ignore[attr-defined]  # AgentRecord's field
        await h.running_epoch(1)
        h.report("agent-1", WorkerState.FAILED, error=_stale(h, "agent-0", "agent-1"),
                 error_kind="peer")
        ranks = list(h.job.members)
        await h.running_epoch(2)  # recovered at once: not held as a peer error, not permanent
        reason = h.job.recoveries.items[-1].reason
        assert reason.startswith(f"rank {ranks.index('agent-0')}'s peer-table entry "
                                 f"10.0.0.2:7071 was answered by rank "
                                 f"{ranks.index('agent-1')}: agent agent-0's data "
                                 f"port 7071 is not used"), reason
        assert reason.endswith("(seen by the worker on agent-1)"), reason
        assert "agent-1's data port" not in reason
        refused = liar.data_port_refused  # type: ignore[attr-defined]
        assert "agent agent-0's data port 7071 is not used" in refused, refused
        assert not honest.data_port_refused  # type: ignore[attr-defined]
    run(config(max_restarts=3), body)


def test_a_stale_entry_the_records_do_not_bear_out_blames_nobody() -> None:
    """The reporter's word alone (agent-0's advertised data address is not agent-1's) refuses
    no one's port: the failure is the reporter's, as any peer error."""
    async def body(h: Harness) -> None:
        for a in h.registry.agents.values():
            a.data_port_refused = ""  # type: ignore[attr-defined]
        await h.running_epoch(1)
        h.report("agent-1", WorkerState.FAILED, error=_stale(h, "agent-0", "agent-1"),
                 error_kind="peer")
        await h.running_epoch(2)
        assert h.job.recoveries.items[-1].reason.startswith("worker on agent-1 failed")
        assert not any(a.data_port_refused  # type: ignore[attr-defined]
                       for a in h.registry.agents.values())
    run(config(max_restarts=3), body)


def test_the_stale_entry_words_round_trip() -> None:
    text = str(StaleEntry("10.0.0.2:7071", 3, 1))
    assert "answered as rank 3, not rank 1: the peer table is stale" in text
    assert staleentry.ranks(f"RuntimeError: x; caused by StaleEntry: {text}") == (1, 3)
    assert staleentry.ranks("PeerError: Connection closed by peer") is None
