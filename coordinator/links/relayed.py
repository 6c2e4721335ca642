"""Links to and between agents nobody can dial: measured the other way, or priced as relayed.

A probe is a dial: agent A measures A->B by calling B's gRPC port. An agent behind a NAT or a
firewall (reachability verdict "nowhere", coordinator/links/reachability.py) cannot be
dialled, so every probe to it fails, and without this module it would be left out of every
plan as unreachable. Two cases, after the measurer's passes (`coordinator/links/measure.py`):

- A can be dialled, B cannot: B's probe of A (B dials out) measured the link the other way.
  WAN paths are near enough symmetric (one round trip gives both delays; the emulator's and
  most real links carry alike rates each way) that A->B takes B->A's figures, marked as an
  estimate whose note says so. The data plane uses that direction too: the rank that cannot
  accept dials the one that can.
- Neither can be dialled: their traffic goes through the relay the coordinator hosts. Each
  such agent measures its own link to the coordinator as a peer (`RELAY`: the agent dials out,
  and the coordinator answers the same Ping and Probe RPCs agents do), and A->B is priced
  A->relay + relay->B: the sum of both hops' delays, the narrower hop's bandwidth (relay->B
  taken as B->relay's figures, as above). That is the rate of one flow alone; a relay's
  uplink is shared by every relayed flow it carries, which the scheduler divides by
  (`coordinator/scheduler/relay.py`), since only a placement (and the data plane's choice of
  relay per pair) says how many there are.

A pair neither end can dial may still have a direct path through both NATs: with hole
punching on, the measurer has both ends punch through the coordinator's relay and measure
that connection (coordinator/links/punchprobe.py) before anything here prices the pair.
A pair punched both ways (whose relay path is not the faster) keeps those figures, marked
`PUNCHED`: priced direct, not among the relay's flows, since placement can count on the
data plane punching again at each epoch and keeping the direct path where it is the faster.
Only pairs whose punch failed (or with `--hole-punch off`, or no coordinator relay) reach
`price`, an upper bound as before.

Agents reachable from some peers only (one site's LAN reaches them, the rest of the world
does not) are undialable too, but not for everyone: a peer whose own dial got through, the
dial-back's or a probe of that very direction (`direct_dials`), dials them directly on the
data plane as well (coordinator/job/dataplane.py). Such a link needs nothing from here: its
probe measured it as it is, direct, and it is priced so (path "": no relay hop, not counted
among the relay's flows), which lets the scheduler place two agents of one site next to each
other at their LAN's price. Only pairs failed both ways (`stranded_pairs`: no evidence of a
direct path either way) are priced relayed, the same pairs the data plane relays.

Pure bookkeeping on the `LinkStore`; the measurer runs the probes.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from coordinator.daemon.registry import AgentRecord
from coordinator.links.store import RELAYED, REVERSE, LinkEntry, LinkStore
from coordinator.scheduler.relaychoice import NOMINAL_BYTES, Path, cost_s
from dtfm.core.limits import clip
from dtfm.net import reach

RELAY = reach.COORDINATOR  # the relay's peer id in a MeasureLinksCommand and in the store


def serves_relay(rec: AgentRecord) -> bool:
    """Whether this agent may relay for pairs nobody can dial: peers can dial it, and it
    serves a relay (`agent start --relay-port`, `AgentInfo.relay_port`), and it has not
    been caught altering a frame it forwarded (`relaytrust`)."""
    return (rec.reach.verdict == reach.EVERYWHERE and rec.info.relay_port > 0
            and not rec.relay_distrusted)


def _ok(store: LinkStore, a: str, b: str) -> LinkEntry | None:
    entry = store.entries.get((a, b))
    return entry if entry is not None and entry.reachable else None


def _failed(store: LinkStore, a: str, b: str) -> bool:
    """Whether a's probe of b failed to get through (or never ran); not a link the
    coordinator failed itself (`LinkEntry.judged`: a lie or a broken agent stays failed)."""
    entry = store.entries.get((a, b))
    return entry is None or not (entry.reachable or entry.judged)


def _probed(store: LinkStore, a: str, b: str) -> LinkEntry | None:
    """The link's figure where a probe of that very direction gave it."""
    entry = _ok(store, a, b)
    return entry if entry is not None and entry.path == "" else None


def undialable(records: Sequence[AgentRecord]) -> set[str]:
    """The agents peers cannot dial (verdict nowhere or some peers only): under the dtfm data
    plane they dial out, so their links are taken the other way or relayed. A failed link
    between two agents everyone can dial is a broken path (a route down, a firewall between
    two sites), which failure handling plans around; pricing it through the relay would put
    a job on it that gloo then cannot cross."""
    return {r.agent_id for r in records
            if r.reach.verdict in (reach.NOWHERE, reach.SOME_PEERS)}


def direct_dials(records: Sequence[AgentRecord], store: LinkStore | None = None
                 ) -> set[tuple[str, str]]:
    """(dialer, listener) agent ids where the listener is undialable (`undialable`) yet the
    dialer got through to it: the dialer's dial-back of it succeeded (`ReachStatus.dials`),
    or the dialer's own probe of that direction did (a probe, not a figure taken the other
    way or through a relay). Both are a dial of the listener's advertised address answered
    by the listener's own id (`dtfm.net.reach.identified`, agent/probing/linkprobe.py), so two
    agents behind different NATs at one private address never count as each other. A direction is
    evidence for itself only: a NAT lets its LAN dial out and in, a firewall may not.

    An agent the operator declared unreachable (`--reachable no`) is dialled by nobody: the
    operator's word stands over any probe."""
    ids = {r.agent_id for r in records}
    out = set()
    for rec in records:
        if rec.agent_id not in undialable([rec]) or rec.reach.overridden:
            continue
        ok = {d.dialer for d in rec.reach.dials if d.ok and not d.outvoted} & ids
        if store is not None:
            ok |= {a for a in ids if _probed(store, a, rec.agent_id) is not None}
        out |= {(a, rec.agent_id) for a in ok - {rec.agent_id}}
    return out


def fill_other_way(store: LinkStore, ids: Sequence[str], hidden: set[str]
                   ) -> list[tuple[str, str]]:
    """Give every failed link a->b into an agent nobody can dial (`hidden`) whose reverse b->a
    was probed the reverse's figures, marked as measured the other way; a link taken the
    other way before takes them again (its reverse may have been probed since: a relay
    agent's hop to a NATed agent that slowed); returns the links filled."""
    filled = []
    for a, b in itertools.permutations(ids, 2):
        if b not in hidden or (back := _probed(store, b, a)) is None:
            continue
        entry = store.entries.get((a, b))
        if not _failed(store, a, b) and (entry is None or entry.path != REVERSE
                                         or entry.measured_unix_s == back.measured_unix_s):
            continue
        why = ("taken the other way before" if entry is not None and entry.reachable
               else entry.error if entry is not None else "not probed")
        note = f"measured the other way ({b}->{a}): {a} cannot dial {b} ({why})"
        if back.estimate:
            note += f"; that probe's own estimate: {back.estimate}"
        store.entries[a, b] = LinkEntry(back.delay_ms, back.bandwidth_gbps, True, "",
                                        back.measured_unix_s, clip(note), REVERSE)
        filled.append((a, b))
    return filled


def stranded_pairs(store: LinkStore, ids: Sequence[str], hidden: set[str]
                   ) -> list[tuple[str, str]]:
    """Unordered pairs of agents nobody can dial (`hidden`) whose links failed both ways
    although each end got through to (or was reached by) someone: only a relay joins them,
    as the data plane does. An agent whose every link failed is dead or cut off, not
    relayed: failure handling leaves it out. Where nobody can be dialled at all (every agent
    behind a NAT) no probe can get through, so no link says who is alive: all are taken as
    alive, and a dead one shows as its failed hop to the relay."""
    alive = {a for a in ids if any(_ok(store, a, b) or _ok(store, b, a) for b in ids if b != a)}
    if not set(ids) - hidden:
        alive = set(ids)
    return [(a, b) for a, b in itertools.combinations(ids, 2)
            if {a, b} <= hidden & alive and _failed(store, a, b) and _failed(store, b, a)]


def relayed_pairs(store: LinkStore, ids: Sequence[str]) -> list[tuple[str, str]]:
    """Unordered pairs of `ids` already priced as relayed (either direction): a measurement
    that re-measured some of their hops (a re-plan's, while the job trains) prices them
    again, so a relay whose hops slowed stops being their price."""
    return [(a, b) for a, b in itertools.combinations(ids, 2)
            if any((e := _ok(store, x, y)) is not None and e.path == RELAYED
                   for x, y in ((a, b), (b, a)))]


def hop_agents(pairs: Sequence[tuple[str, str]]) -> list[str]:
    """The agents whose link to the relay the relayed pairs need, in first-seen order."""
    return list(dict.fromkeys(x for pair in pairs for x in pair))


def _hops(store: LinkStore, x: str, y: str, relay: str) -> tuple[LinkEntry, LinkEntry] | None:
    """x's hop to `relay` and `relay`'s hop to y, both measured (never through a relay)."""
    if relay == RELAY:
        first, second = _ok(store, x, RELAY), _ok(store, y, RELAY)  # relay->y as y->relay
    elif relay in (x, y):
        return None
    else:
        first, second = _ok(store, x, relay), _ok(store, relay, y)
    if first is None or second is None or RELAYED in (first.path, second.path):
        return None
    return first, second


def price(store: LinkStore, pairs: Sequence[tuple[str, str]],
          relays: Sequence[str] = ()) -> list[tuple[str, str]]:
    """Price both directions of each pair as relayed, through the cheapest relay for one
    flow (`relaychoice.cost_s` of `NOMINAL_BYTES`): the coordinator's, from its ends'
    measured hops to it (`(x, RELAY)` in the store), or one of `relays` (agents serving a
    relay, `agent start --relay-port`), from x->agent and agent->y. A pair with no relay
    whose both hops were measured stays failed, its error saying which coordinator hop and
    why. Returns the links priced."""
    priced = []
    now = time.time()
    for a, b in pairs:
        for x, y in ((a, b), (b, a)):
            paths = {r: h for r in (RELAY, *relays) if (h := _hops(store, x, y, r)) is not None}
            if not paths:
                hx, hy = _ok(store, x, RELAY), _ok(store, y, RELAY)
                lost = x if hx is None else y
                hop = store.entries.get((lost, RELAY))
                store.mark_unreachable(x, y, clip(
                    f"neither {x} nor {y} can dial the other, and {lost}'s link to the "
                    f"relay (the coordinator) was not measured: "
                    f"{hop.error if hop is not None else 'not probed'}"))
                continue
            relay = min(paths, key=lambda r: cost_s(Path(
                paths[r][0].delay_ms + paths[r][1].delay_ms,
                min(paths[r][0].bandwidth_gbps, paths[r][1].bandwidth_gbps)), NOMINAL_BYTES, 0))
            hx, hy = paths[relay]
            via = "the coordinator" if relay == RELAY else f"relay agent {relay}"
            back = f" (taken from {y}->relay)" if relay == RELAY else ""
            note = (f"relayed via {via}: {x}->relay {hx.delay_ms:.1f} ms "
                    f"{hx.bandwidth_gbps * 1e3:.1f} Mbit/s + relay->{y} {hy.delay_ms:.1f} ms "
                    f"{hy.bandwidth_gbps * 1e3:.1f} Mbit/s{back}; the "
                    f"rate of one flow alone: the relay's uplink is shared by every relayed "
                    f"flow")
            store.entries[x, y] = LinkEntry(hx.delay_ms + hy.delay_ms,
                                            min(hx.bandwidth_gbps, hy.bandwidth_gbps), True,
                                            "", now, clip(note), RELAYED)
            priced.append((x, y))
    return priced


def via(store: LinkStore, x: str, y: str, relay: str) -> Path | None:
    """The path x -> `relay` -> y from the store's measured hops (`RELAY`: the
    coordinator's, relay->y taken as y->relay); None where a hop has no figure."""
    hops = _hops(store, x, y, relay)
    if hops is None:
        return None
    return Path(hops[0].delay_ms + hops[1].delay_ms,
                min(hops[0].bandwidth_gbps, hops[1].bandwidth_gbps))


def coordinator_hop(store: LinkStore, x: str) -> Path | None:
    """x's measured link to the coordinator's relay (its delay and rate), None if unknown."""
    entry = _ok(store, x, RELAY)
    return None if entry is None else Path(entry.delay_ms, entry.bandwidth_gbps)


def relayed_figures(store: LinkStore, links: Sequence[tuple[str, str]],
                    routes: dict[tuple[str, str], str] | None = None
                    ) -> dict[tuple[str, str], Path]:
    """The figures of relayed links x->y as the store has them now. With `routes` ({(a, b):
    the relay the pair meets at, agent id or RELAY}, either order), through that very relay:
    what a running epoch pays, which may not be the cheapest relay any more (a relay that
    slowed keeps its pairs until the job re-plans). Without, the store's price (the cheapest
    relay, `price`). Links without figures are left out."""
    out = {}
    for x, y in links:
        if routes is None:
            entry = _ok(store, x, y)
            if entry is not None and entry.path == RELAYED:
                out[x, y] = Path(entry.delay_ms, entry.bandwidth_gbps)
            continue
        relay = routes.get((x, y), routes.get((y, x)))
        if relay is not None and (path := via(store, x, y, relay)) is not None:
            out[x, y] = path
    return out
