"""Whether the coordinator hands an agent's advertised data port to its peers (issue 41).

An agent's data port (`AgentInfo.data_port`: its gRPC port by default, `agent start
--data-port` for one of its own) is where the epoch's peer table tells the other workers to
dial its rank. Taken at the agent's word, one false field (another agent's port) sent every
peer of that rank to the other agent: the handshake refused them ("the peer table is
stale"), every epoch failed, and the honest agent's worker was the one that reported it.

So the coordinator checks the port when the agent joins, beside the reachability dial-back
(coordinator/links/reachability.py): where the dial-back does not already cover it (a port of
its own, or an operator's `--reachable yes`, which skips the dial-back; with `--reachable no`
no peer is ever told to dial it) it pings the data address once on a fresh channel
(`dtfm.net.reach.answering`). An answer from another agent's id
proves the address is someone else's: the port is refused (`AgentRecord.data_port_refused`,
so `data_port` reads 0 and the agent's workers only dial out), the coordinator logs a warning
naming the agent, the port and who holds it, and the agent's reachability line says it. No
answer proves nothing either way: a `--data-port` is served by the agent's worker, and only
while an epoch runs. Such a port stays in use, and should it be false the workers' handshake
catches it and the job blames its owner (coordinator/job/rootcause.py `stale_entry`), which
refuses the port the same way.
"""

from __future__ import annotations

import logging

from coordinator.daemon.registry import AgentRecord
from dtfm import rpc
from dtfm.core.assignment import member_address
from dtfm.net import reach
from protos.dtfm.v1 import common_pb2

log = logging.getLogger(__name__)


def data_address(rec: AgentRecord) -> str:
    """HOST:PORT the agent advertises for its data plane."""
    return member_address(rec.info.host, rec.info.data_port)


def needs_check(rec: AgentRecord) -> bool:
    """Whether the data port needs a dial of its own: peers may be told to dial it (not
    `--reachable no`), and the reachability dial-back does not cover it (a port of its own,
    or `--reachable yes`, which skips the dial-back)."""
    reachable = rec.info.reachable
    return (rec.info.data_port > 0 and reachable != common_pb2.REACH_OVERRIDE_NO
            and (rec.info.data_port != rec.info.port
                 or reachable == common_pb2.REACH_OVERRIDE_YES))


async def check(rec: AgentRecord, security: rpc.Security,
                timeout_s: float = reach.DIAL_TIMEOUT_S) -> str:
    """Why `rec`'s data port must not be used ("" when nothing says so): another agent
    answers at its data address."""
    address = data_address(rec)
    answered = await reach.answering(address, security, timeout_s)
    if not answered or answered == rec.agent_id:
        return ""
    return held_by(rec, answered)


def held_by(rec: AgentRecord, holder: str) -> str:
    """The refusal, in words, of `rec`'s data port, found to be agent `holder`'s."""
    return (f"agent {rec.agent_id}'s data port {rec.info.data_port} is not used: "
            f"{data_address(rec)} is agent {holder}'s; its workers only dial out until it "
            f"re-joins with a port of its own (fix its --data-port, or leave that unset to "
            f"share its gRPC port)")


def refuse(rec: AgentRecord, why: str) -> bool:
    """Stop handing `rec`'s data port to peers, for `why`; False when it was refused already
    (nothing new to say)."""
    if rec.data_port_refused:
        return False
    rec.data_port_refused = why
    log.warning("%s", why)
    return True
