"""Stranded pairs measured direct through a hole punch, at link measurement.

Two agents nobody can dial with no direct path either way (`relayed.stranded_pairs`) meet at
a relay on the data plane, and at each epoch try to punch a direct connection through their
NATs (dtfm/net/punch.py). Priced through the relay only (`relayed.price`: both hops' delay,
the narrower hop's rate), placement could never count on a punch: two NATed agents in one
city with a fast direct link were placed as if two relay hops apart.

So, with hole punching on (`coordinator start --hole-punch on`, the default) and the
coordinator's relay running, the measurer asks both agents of each stranded pair at once to
punch through the coordinator's relay and measure the direct connection
(`MEASURE_KIND_PUNCH`, agent/probing/punchprobe.py). The relay forwards only for epochs it admitted
(`Relay.admit`), so each pair is admitted as a pseudo-job of its own (`admit`: two ranks,
epoch 0, a fresh secret sent to these two agents only) and retired when the round ends
(`retire`): no other agent can open a circuit with it, and the relay holds the key only for
as long as the probe runs. A direction whose punch got through is stored as measured, marked
`PUNCHED` with a note (`record`); a pair punched both ways (`punched`) is priced from those
figures, as a direct link (not in `LinkMatrix.relayed`, not one of the relay's flows). A pair
whose punch failed either way is priced relayed, exactly as without punching.

The data plane is unchanged: such a pair still meets at a relay at each epoch, punches, and
keeps the direct path only where it is not slower than the relay (dtfm/net/pathweigh.py),
which the measurement says it is wherever placement counted on it.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from coordinator.links import relayed
from coordinator.links.store import PUNCHED, RELAYED, LinkEntry, LinkStore
from dtfm.core.limits import clip
from dtfm.net import pathweigh
from protos.dtfm.v1 import common_pb2, coordinator_pb2

if TYPE_CHECKING:
    from dtfm.net.relay import Relay

SECRET_BYTES = 32
# At most this many pairs punch at once: each holds a key at the relay, which keeps at most
# `Relay.max_keys` (64) and drops the oldest beyond, a running job's epoch among them.
MAX_PAIRS_AT_ONCE = 16
# On top of the measurer's probe deadline: the peer's arrival at the relay (up to 15 s,
# agent/probing/punchprobe.py PARTNER_WAIT_S), the punch (4 s) and two transfers in turn.
EXTRA_S = 30.0


class RelaySource(Protocol):
    """Where the coordinator's relay and the hole-punch switch live (the job's `DataPlanes`)."""

    relay: Relay | None
    hole_punch: bool


def relay_of(source: RelaySource | None) -> Relay | None:
    """The relay to punch-probe through: None where hole punching is off (`--hole-punch
    off`) or the coordinator runs no relay (`--relay-port 0`): pairs are priced relayed."""
    if source is None or not source.hole_punch:
        return None
    return source.relay


def rounds(pairs: Sequence[tuple[str, str]], at_once: int = MAX_PAIRS_AT_ONCE
           ) -> list[list[tuple[str, str]]]:
    """The pairs in rounds in which no agent takes part twice (its transfers would share its
    link) and at most `at_once` pairs punch; greedy, in the given order."""
    left = list(pairs)
    out = []
    while left:
        busy: set[str] = set()
        batch = []
        for pair in list(left):
            if len(batch) < at_once and not busy & set(pair):
                batch.append(pair)
                busy.update(pair)
                left.remove(pair)
        out.append(batch)
    return out


_ids = itertools.count(1)


def admit(relay: Relay, run: int, pairs: Sequence[tuple[str, str]]
          ) -> dict[tuple[str, str], coordinator_pb2.PunchProbe]:
    """Admit each pair at `relay` as a two-rank pseudo-job with a fresh secret; the command
    for each direction (a, b): a's, rank 0 for the pair's first agent. Call on the relay's
    loop (the coordinator's)."""
    out = {}
    for a, b in pairs:
        job = f"linkprobe-{run}-{next(_ids)}-{secrets.token_hex(4)}"
        secret = secrets.token_bytes(SECRET_BYTES)
        relay.admit(job, 0, secret, 2)
        for x, y, rank in ((a, b, 0), (b, a, 1)):
            out[x, y] = coordinator_pb2.PunchProbe(relay=f":{relay.port}", job=job,
                                                   secret=secret, rank=rank,
                                                   peer_rank=1 - rank)
    return out


def retire(relay: Relay, tickets: dict[tuple[str, str], coordinator_pb2.PunchProbe]) -> None:
    """Forget the pseudo-jobs' keys: no new circuit of theirs is admitted."""
    for job in {t.job for t in tickets.values()}:
        relay.retire(job)


def record(store: LinkStore, agent_id: str, sample: common_pb2.LinkSample) -> None:
    """Store a punch probe's sample: measured on the punched connection (PUNCHED, with a
    note), or failed with the reason (the pair is then priced relayed)."""
    store.record(agent_id, sample)
    if not sample.reachable:
        return
    entry = store.entries[agent_id, sample.peer_id]
    note = (f"punched: measured on a direct connection hole-punched through both ends' NATs "
            f"({agent_id} and {sample.peer_id} met at the coordinator's relay); the data "
            f"plane punches again each epoch and keeps it while not slower than the relay")
    if entry.estimate:
        note += f"; the bandwidth is the probe's estimate: {entry.estimate}"
    entry.estimate, entry.path = clip(note), PUNCHED


def round_trip_s(there: LinkEntry, back: LinkEntry) -> float:
    """What pathweigh times on a path: PROBE_BYTES there and a byte back."""
    return ((there.delay_ms + back.delay_ms) / 1e3
            + pathweigh.PROBE_BYTES * 8 / (there.bandwidth_gbps * 1e9))


def kept(store: LinkStore, pairs: Sequence[tuple[str, str]], relays: Sequence[str] = ()
         ) -> list[tuple[str, str]]:
    """Of `pairs` (punched both ways), those whose direct path the data plane keeps: at each
    epoch both ends weigh it against the relay and stay on the relay where that is faster by
    more than pathweigh's slack (dtfm/net/pathweigh.py `choose`). The same rule on the
    measured figures: each direction's round trip direct against the one through the relay
    `relayed.price` would choose (the cheapest of the coordinator and `relays`), both as
    pathweigh times them. A pair whose relay path has no figures keeps its direct path."""
    out = []
    for a, b in pairs:
        scratch = LinkStore(dict(store.entries))
        relayed.price(scratch, [(a, b)], relays)
        via = [scratch.entries[x, y] for x, y in ((a, b), (b, a))]
        direct = [store.entries[x, y] for x, y in ((a, b), (b, a))]
        if not all(e.reachable and e.path == RELAYED for e in via) or all(
                pathweigh.choose(round_trip_s(via[i], via[1 - i]),
                                 round_trip_s(direct[i], direct[1 - i])) for i in (0, 1)):
            out.append((a, b))
    return out


def punched(store: LinkStore, pairs: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The pairs whose punch probe got through both ways: priced from it, not relayed."""
    def ok(x: str, y: str) -> bool:
        e = store.entries.get((x, y))
        return e is not None and e.reachable and e.path == PUNCHED

    return [(a, b) for a, b in pairs if ok(a, b) and ok(b, a)]
