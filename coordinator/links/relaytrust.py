"""Relays caught altering a frame they forwarded relay no more (issue 43, item 5).

Every frame between two ranks carries a MAC under a key only those two ranks hold
(dtfm/net/framemac.py), so a frame that fails it at the receiver was changed on the way: by
the relay the pair went through, not by either end. The receiving worker fails its step with
the kind `tampered` (`dtfm.core.causes.TAMPERED`) and an error that names the pair and the
relay's address (`framemac.refusal_message`). Here the coordinator reads that error back
(`blame`): where the address is a relay agent's, that agent is the culprit. It is distrusted
(`AgentRecord.relay_distrusted`): `relayed.serves_relay` no longer offers it, so the next
epoch routes every pair it relayed through another relay (a relay agent, or the
coordinator's); `coordinator status` says why under the agents (`--json`:
`agents[].relay_distrusted`), and the coordinator
logs a warning that begins with `RELAY_TAMPERED`, and the job's integrity ledger keeps it as
(unconfirmed) `tampered_frame` evidence against the relay agent.

The worker's word is taken against the relay and not against an end: a worker could lie to
discredit a relay, but the worst it gets is that relay unused for the job (the coordinator's
relay remains). A refusal on the coordinator's own relay (trusted) or on a direct connection
names no agent here: a direct one is the sending end's fault, which the worker reports as a
peer's bad value instead (agent/worker/errors.py). A re-join does not clear the distrust.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from coordinator.daemon.registry import AgentRecord, Registry
from dtfm.core.assignment import member_address
from dtfm.net import framemac

log = logging.getLogger(__name__)

RELAY_TAMPERED = "relay tampered"  # the warning's first words: the event to wire evidence to


def relay_agent(address: str, registry: Registry) -> AgentRecord | None:
    """The agent that serves a relay at `address` (HOST:PORT as the data plane named it)."""
    for rec in registry.all():
        if rec.info.relay_port > 0 and member_address(rec.info.host,
                                                      rec.info.relay_port) == address:
            return rec
    return None


def distrust(rec: AgentRecord, why: str) -> bool:
    """Stop offering `rec`'s relay, for `why`; False when it was distrusted already."""
    if rec.relay_distrusted:
        return False
    rec.relay_distrusted = why
    log.warning("%s: %s", RELAY_TAMPERED, why)
    return True


def blame(agent_id: str, error: str, members: Sequence[str], registry: Registry,
          evidence: Callable[[str, str], object] = lambda culprit, why: None) -> str:
    """The failure, in words, of agent `agent_id`'s worker that refused a frame (`error`);
    the relay agent it names is distrusted, and `evidence(culprit, why)` keeps it against that
    agent (the job's integrity ledger: unconfirmed, since only the worker saw the MAC fail).
    `members`: the epoch's agent ids by rank."""
    r = framemac.refusal(error)
    if r is None:
        return f"worker on {agent_id} refused a frame: {error or 'no reason'}"
    ends = " and ".join(f"rank {k} ({members[k]})" if 0 <= k < len(members) else f"rank {k}"
                        for k in (r.src, r.dst))
    culprit = relay_agent(r.relay, registry) if r.relay else None
    if culprit is None:
        where = f"relay {r.relay} (the coordinator's)" if r.relay else "a direct connection"
        return (f"a frame between {ends} failed its integrity check on {where}, seen by the "
                f"worker on {agent_id}: {error}")
    why = (f"relay agent {culprit.agent_id} at {r.relay} altered, replayed or reordered "
           f"frame {r.seq} it forwarded from {ends.replace(' and ', ' to ')} (its MAC "
           f"failed; only the two ranks hold their pair's key): it relays for this job no "
           f"more, its pairs are re-routed")
    if distrust(culprit, why):
        evidence(culprit.agent_id, why)
    return why
