"""Reachability verdicts need agreement: one dialer alone neither downgrades nor vouches for an
agent (issue 43, "lies about the network").

A dial-back verdict (coordinator/links/reachability.py) is taken over the coordinator's own
dial and up to a few peers' (`DialReport`). Counting every peer's word as it came let one
agent steer the data plane: reporting every dial it was asked for as "refused" turned three
honest agents everyone could dial into "some peers", the job moved from gloo to the dtfm
transport and their traffic went through a relay; reporting "answered" for an agent nobody
can dial had the plan dial it directly. The coordinator is trusted (threat model: it belongs
to the job's owner); agents are not. So (`outvoted`):

- a lone refusal: when exactly one dialer failed, it is a peer, and the coordinator or
  another peer got through, the refusal does not count: the agent stays reachable;
- a lone vouch: when exactly one dialer got through, it is a peer, and the coordinator and at
  least one other peer failed, the success does not count, unless the dialer and the agent
  share a LAN (`one_lan`: both advertise private addresses of one /24, or one IPv6 /64),
  which is exactly how the first agent of a NAT'd site is reached by its neighbour only. A
  loopback address is no LAN here: an agent that advertises it can only be dialled from its
  own host, where the coordinator's own failed dial already spoke for every dialer.

An outvoted dial stays on the status (`DialResult.outvoted`, shown by `coordinator status`),
counts toward nothing (the verdict, `relayed.direct_dials`), and is recorded as evidence
against its dialer (kind `dial_vote`, unconfirmed: an honest peer behind a strict firewall
fails the same way). With two dialers in all there is no majority: the coordinator's failure
and a peer's success stay "some peers", as before. Pure functions on dial results and hosts.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence

from dtfm.net import reach
from protos.dtfm.v1 import common_pb2

DIAL_VOTE = "dial_vote"  # the evidence kind of an outvoted dial


def one_lan(a: str, b: str) -> bool:
    """Whether hosts `a` and `b` are private, non-loopback addresses of one LAN (one IPv4
    /24, one IPv6 /64); False for names and public addresses."""
    try:
        x, y = ipaddress.ip_address(a.strip("[]")), ipaddress.ip_address(b.strip("[]"))
    except ValueError:
        return False
    if x.version != y.version or x.is_loopback or not (x.is_private and y.is_private):
        return False
    prefix = 24 if x.version == 4 else 64
    return ipaddress.ip_network(f"{x}/{prefix}", strict=False) == \
        ipaddress.ip_network(f"{y}/{prefix}", strict=False)


def outvoted(dials: Sequence[common_pb2.DialResult], target_host: str,
             host_of: Callable[[str], str]) -> set[str]:
    """The dialers whose dial does not count toward the verdict (see the module docstring);
    `host_of(dialer)`: the host a peer advertises ("" unknown)."""
    ok = [d for d in dials if d.ok]
    failed = [d for d in dials if not d.ok]
    coordinator_failed = any(d.dialer == reach.COORDINATOR for d in failed)
    out: set[str] = set()
    if len(failed) == 1 and failed[0].dialer != reach.COORDINATOR and ok:
        out.add(failed[0].dialer)
    if (len(ok) == 1 and ok[0].dialer != reach.COORDINATOR and coordinator_failed
            and len(failed) >= 2 and not one_lan(host_of(ok[0].dialer), target_host)):
        out.add(ok[0].dialer)
    return out


def marked(dials: Sequence[common_pb2.DialResult], out: set[str]
           ) -> list[common_pb2.DialResult]:
    """Copies of `dials` with `outvoted` set for the dialers in `out` (and cleared for the
    rest: a later dial may restore a majority)."""
    result = []
    for d in dials:
        copy = common_pb2.DialResult()
        copy.CopyFrom(d)
        copy.outvoted = d.dialer in out
        result.append(copy)
    return result


def why(d: common_pb2.DialResult, target: str) -> str:
    """The evidence's words for an outvoted dial of agent `target`."""
    if d.ok:
        return (f"said it dialled agent {target}, which the coordinator and the other "
                f"dialers could not dial: a lone vouch does not count")
    return (f"said it could not dial agent {target} ({d.error[:120]}), which the "
            f"coordinator or another peer dialled: a lone refusal does not count")
