"""Which of an epoch's failures to act on: the root cause, not the first report to arrive.

When one worker fails, its neighbours fail a moment later with a `peer` error ("Connection
closed by peer"), and whichever agent heartbeats first is heard first. Acting on that first
report hid the real cause: a worker that failed on its own input (`config`: a missing tensor, a
refused checkpoint) showed as its neighbour's gloo error and started a needless recovery before
the real error failed the job; a lost agent showed as a survivor's gloo error. So:

- causes are ranked (`dtfm.core.causes`, the order `agent local` uses too): a configuration
  error over a lost agent, over a worker's own failure (`internal`), over a peer's impossible
  value (`bad_value`: the report names the sender), over failing to join (`rendezvous`), over
  a peer's failure (`peer`), which others explain; a report replaces the job's failure only
  when it ranks higher;
- a failure that others may explain (`bad_value`, `peer`, `rendezvous`) is acted on only
  after a heartbeat interval and a margin (`hold_s`), so every member's report of the same
  fault has arrived;
- an agent found lost after the recovery began, among the members that failed, becomes the
  recovery's reason (`lost_reason`): the registry notices a silent agent only after its
  liveness timeout, long after its neighbours' errors arrived;
- a worker that dialled rank W's peer-table entry and was answered by rank A ("the peer table
  is stale", dtfm/core/staleentry.py) is not at fault: rank W's agent advertised an address
  agent A holds. Where the coordinator's own records bear that out (W's data address is one
  of A's), the failure names W's agent (`MISDIRECTED`, acted on at once, never permanent) and
  W's data port is refused (coordinator/links/dataport.py), so the next epoch's workers dial
  W's rank never again at A's port; it only dials out (`worker_failure`, `stale_entry`);
- a worker that refused a frame its pair's MAC does not vouch for (`tampered`) names the relay
  the pair went through: that relay agent is blamed and relays no more
  (coordinator/links/relaytrust.py), not the reporter nor the sender, acted on at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from coordinator.daemon.registry import EXCLUDED, AgentRecord, Registry
from coordinator.links import dataport, relaytrust
from dtfm.core import staleentry
from dtfm.core.assignment import member_address
from dtfm.core.causes import CAUSES, EXPLAINED_BY_OTHERS, LOST, TAMPERED, outranks, rank
from protos.dtfm.v1 import coordinator_pb2

__all__ = ["CAUSES", "LOST", "MISDIRECTED", "hold_s", "lost_members", "lost_reason",
           "outranks", "rank",
           "stale_entry", "worker_failure"]

# a member's advertised data address is another's: the coordinator's kind, not a worker's
# (unknown to `dtfm.core.causes`, so it ranks as `internal`: over the peer errors it causes)
MISDIRECTED = "misdirected"

HOLD_MARGIN_S = 1.0  # on top of a heartbeat interval: the report's way to the coordinator


def hold_s(kind: str, since: float, now: float, heartbeat_interval_s: float) -> float:
    """How much longer to wait for other members' reports before acting on a failure of
    `kind` first seen at `since` (0: act now)."""
    if kind not in EXPLAINED_BY_OTHERS:
        return 0.0
    return max(0.0, since + heartbeat_interval_s + HOLD_MARGIN_S - now)


def lost_members(lost: Sequence[AgentRecord], members: Sequence[str]) -> list[str]:
    """The ids of the lost records among `members`, an excluded one with why it was."""
    return [f"{r.agent_id} ({r.why})" if r.state == EXCLUDED else r.agent_id
            for r in lost if r.agent_id in members]


def lost_reason(lost: list[str], seen_first: str = "") -> str:
    """The failure a lost member makes, with the error its loss caused where one came first."""
    why = f"lost agent(s) {', '.join(lost)}"
    return f"{why} (seen first as: {seen_first})" if seen_first else why


def stale_entry(error: str, members: Sequence[str], registry: Registry
                ) -> tuple[AgentRecord, str] | None:
    """The member whose peer-table entry a worker's `error` says was wrong, and why in words,
    where the coordinator's records bear it out: that member's advertised data address is an
    address of the member that answered there. `members`: the epoch's agent ids in rank
    order. None when `error` names no stale entry, or the records do not show the clash
    (the reporter's word alone blames nobody)."""
    ranks = staleentry.ranks(error)
    if ranks is None:
        return None
    wanted, answered = ranks
    if wanted == answered or not all(0 <= r < len(members) for r in ranks):
        return None
    culprit, holder = registry.get(members[wanted]), registry.get(members[answered])
    if culprit is None or holder is None:
        return None
    address = member_address(culprit.info.host, culprit.info.data_port)
    if address not in {member_address(holder.info.host, p)
                       for p in (holder.info.data_port, holder.info.port)}:
        return None
    return culprit, (f"rank {wanted}'s peer-table entry {address} was answered by rank "
                     f"{answered}: {dataport.held_by(culprit, holder.agent_id)}")


def worker_failure(agent_id: str, report: coordinator_pb2.ProgressReport,
                   members: Sequence[str], registry: Registry,
                   evidence: Callable[[str, str], object] = lambda culprit, why: None
                   ) -> tuple[str, str]:
    """(the failure in words, its kind) of agent `agent_id`'s failed worker. A stale peer-table
    entry the records bear out (`stale_entry`) is blamed on the entry's member, whose data
    port is refused here, not on the worker that reported it. `evidence(culprit, why)`: a
    tampering relay agent's record in the integrity ledger (`relaytrust.blame`)."""
    if report.error_kind == TAMPERED:  # a relay altered a frame: named, and used no more
        return relaytrust.blame(agent_id, report.error, members, registry, evidence), TAMPERED
    blamed = stale_entry(report.error, members, registry)
    if blamed is None:
        return (f"worker on {agent_id} failed: {report.error or 'no reason'}",
                report.error_kind or "internal")
    culprit, why = blamed
    dataport.refuse(culprit, why)
    return f"{why} (seen by the worker on {agent_id})", MISDIRECTED
