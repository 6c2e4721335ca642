"""Reachability: whether an agent accepts inbound connections at the address it advertises.

Both programs need the same two things, so they live here once: the dial-back itself (one
`Agent.Ping` at the advertised HOST:PORT, whose answer must come from the agent we meant: two
agents behind different NATs often believe they are 192.168.1.2, so an answer from another
id at that address is a failure, never a success), and the verdict over several dialers with
the words people read for it (`coordinator status`, `agent start`'s log line).

The verdict is found, not configured: the coordinator dials each newcomer and asks a few live
peers to dial it too (coordinator/links/reachability.py). `--reachable yes|no` on the agent
overrides it for the operator who knows better.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence

import grpc

from dtfm import rpc
from dtfm.core.limits import clip
from protos.dtfm.v1 import agent_pb2, agent_pb2_grpc, common_pb2

UNKNOWN = common_pb2.REACHABILITY_UNKNOWN
EVERYWHERE = common_pb2.REACHABILITY_EVERYWHERE
SOME_PEERS = common_pb2.REACHABILITY_SOME_PEERS
NOWHERE = common_pb2.REACHABILITY_NOWHERE
NAMES = {UNKNOWN: "unknown", EVERYWHERE: "everywhere", SOME_PEERS: "some-peers",
         NOWHERE: "nowhere"}

# The operator's --reachable, as the flag spells it and as the wire carries it.
OVERRIDES = {"auto": common_pb2.REACH_OVERRIDE_AUTO, "yes": common_pb2.REACH_OVERRIDE_YES,
             "no": common_pb2.REACH_OVERRIDE_NO}
COORDINATOR = "coordinator"  # the dialer name of the coordinator's own dial-back
DIAL_TIMEOUT_S = 3.0  # one round trip across the world and a TCP/HTTP2 handshake, with room


async def dial(address: str, agent_id: str, security: rpc.Security,
               timeout_s: float = DIAL_TIMEOUT_S) -> str:
    """Dial `agent_id` at `address` once on a fresh channel; "" if it answered as itself, else
    why not, in words. A fresh channel, so a connection some earlier call left open (in the
    other direction, through a NAT's mapping) cannot stand in for an inbound one."""
    try:
        async with rpc.open_channel(address, security) as channel:
            return await identified(agent_pb2_grpc.AgentStub(channel), agent_id, address,
                                    timeout_s)
    except (ValueError, OSError) as exc:
        return clip(f"agent {agent_id} at {address}: {exc}")


async def identified(stub: agent_pb2_grpc.AgentStub, agent_id: str, address: str,
                     timeout_s: float = DIAL_TIMEOUT_S) -> str:
    """One `Agent.Ping` on `stub` (a channel to `address`): "" when `agent_id` itself answered,
    else why not, in words (it did not answer, or another agent sits at that address)."""
    answered, error = await _ping(stub, timeout_s, f"agent {agent_id} at {address}")
    if error:
        return error
    if answered != agent_id:
        return clip(f"{address} answered as agent {answered}, not "
                    f"{agent_id}: another agent sits at the address {agent_id} advertises")
    return ""


async def answering(address: str, security: rpc.Security,
                    timeout_s: float = DIAL_TIMEOUT_S) -> str:
    """The id of the agent that answers `Agent.Ping` at `address` (a fresh channel, as in
    `dial`); "" when no agent answers there (nothing listens, or something that is not an
    agent's gRPC server: a worker's own data-plane listener, say)."""
    try:
        async with rpc.open_channel(address, security) as channel:
            answered, error = await _ping(agent_pb2_grpc.AgentStub(channel), timeout_s,
                                          address)
    except (ValueError, OSError):
        return ""
    return "" if error else answered


async def _ping(stub: agent_pb2_grpc.AgentStub, timeout_s: float, who: str
                ) -> tuple[str, str]:
    """(the id in the answer, "") when the nonce came back, else ("", why not: `who` names
    the one dialled)."""
    try:
        nonce = secrets.randbits(63)
        reply = await stub.Ping(agent_pb2.PingRequest(nonce=nonce), timeout=timeout_s,
                                wait_for_ready=False)
    except grpc.aio.AioRpcError as exc:
        return "", clip(rpc.describe_rpc_error(exc, who))
    if reply.nonce != nonce:
        return "", clip(f"{who} echoed the wrong nonce")
    return reply.agent_id or "(no id)", ""


def result(dialer: str, error: str) -> common_pb2.DialResult:
    return common_pb2.DialResult(dialer=dialer, ok=not error, error=error, unix_s=time.time())


def verdict(dials: Sequence[common_pb2.DialResult]) -> int:
    """Everywhere when every dialer got through, nowhere when none did, some peers between;
    unknown without a single dial. An outvoted dial (`DialResult.outvoted`: the other dialers
    disagree with it alone, coordinator/links/dialvotes.py) does not count."""
    dials = [d for d in dials if not d.outvoted]
    ok = sum(d.ok for d in dials)
    if not dials:
        return UNKNOWN
    return EVERYWHERE if ok == len(dials) else NOWHERE if ok == 0 else SOME_PEERS


def judged(address: str, dials: Sequence[common_pb2.DialResult]) -> common_pb2.ReachStatus:
    """The status the dials say, with its one line."""
    status = common_pb2.ReachStatus(verdict=verdict(dials), address=address,  # type: ignore[arg-type]
                                    dials=dials)
    status.summary = summary(status)
    return status


def overridden(address: str, override: int) -> common_pb2.ReachStatus:
    """The operator's verdict (--reachable yes|no): nothing is dialled."""
    yes = override == common_pb2.REACH_OVERRIDE_YES
    status = common_pb2.ReachStatus(verdict=EVERYWHERE if yes else NOWHERE,  # type: ignore[arg-type]
                                    address=address, overridden=True)
    status.summary = summary(status)
    return status


def summary(status: common_pb2.ReachStatus) -> str:
    """The verdict in one line: who could dial which address, and who could not (and why)."""
    if status.overridden:
        word = "yes" if status.verdict == EVERYWHERE else "no"
        return (f"{'reachable' if word == 'yes' else 'not reachable'} at {status.address} "
                f"(set by the operator: --reachable {word}; not checked)")
    dials = [d for d in status.dials if not d.outvoted]
    if status.verdict == UNKNOWN:
        return f"reachability of {status.address or 'this agent'} not checked yet"
    ok = [d.dialer for d in dials if d.ok]
    failed = [d for d in dials if not d.ok]
    outvoted = [f"{d.dialer} said {'answered' if d.ok else 'refused'}"
                for d in status.dials if d.outvoted]
    note = f"; outvoted, alone against the others: {', '.join(outvoted)}" if outvoted else ""
    if status.verdict == EVERYWHERE:
        return f"reachable from everywhere: {', '.join(ok)} dialled {status.address}{note}"
    why = f"{failed[0].dialer}: {failed[0].error}"
    if status.verdict == NOWHERE:
        return (f"not reachable: {len(failed)} of {len(dials)} dialer(s) cannot dial "
                f"{status.address} ({why}){note}")
    return (f"reachable from {len(ok)} of {len(dials)} dialers ({', '.join(ok)}); "
            f"not from {', '.join(d.dialer for d in failed)} ({why}){note}")


def agent_line(status: common_pb2.ReachStatus) -> str:
    """What `agent start` logs when the coordinator's verdict arrives."""
    if status.verdict == NOWHERE and not status.overridden:
        first = next((d for d in status.dials if not d.ok and not d.outvoted), None)
        why = f" ({first.dialer}: {first.error})" if first is not None else ""
        return (f"not reachable: peers cannot dial {status.address}{why}; this agent's "
                "workers will dial out and meet unreachable peers at the coordinator's relay "
                "(the dtfm transport, CPU only; docs/operations.md, Ports); if peers can "
                "reach it after all, start it with --reachable yes")
    return status.summary
