"""Link figures checked against each other: a reported figure the other direction's
measurement contradicts is discarded, and is evidence against its reporter (issue 43).

The coordinator never measures a link between two agents itself: each direction is measured
and reported by its sender (coordinator/links/measure.py). Only figures no network can give
(over `MAX_LINK_GBPS`) and delays whose two ends differ by more than 3x + 50 ms were caught;
0.01 ms and 900 Gbit/s on a loopback link that measures about 1 ms and 0.3 Gbit/s were
accepted, and pulled the scheduler onto the liar's links. Its own probes reach agents only
as the relay (an agent's link to the coordinator), which bounds nothing between two agents,
so the check is the other direction, measured by the other end:

- **Bandwidth** (`inflated_bandwidth`): the two directions of a path may honestly differ a
  lot (a home uplink: DOCSIS 1000/35 Mbit/s is ~30x, ADSL 24/1 24x, and a probe under load
  may read half), but not by more than `ASYMMETRY` (100x: three times the worst access link
  sold, with the load margin on top). Beyond it the higher figure is the suspect, since a lie
  that pulls traffic inflates and an honest probe errs low (load, an unsettled window): it is
  replaced by the other direction's figure, marked as taken from it, and recorded against
  its reporter. A liar inflating by less than 100x is not caught, but gains at most that.
- **Delay** (`deflated_delays`): both ends measure half of one round trip, so they agree up
  to load. An honest ping only errs high (queues on a busy host, an event loop late to
  answer), never below the wire; so the lower of two figures is the suspect when it is
  under a quarter of the other less half a millisecond (`DEFLATION`). Such a pair is pinged
  again, quietly and on its own, as a contradiction is (`LinkMeasurer`); if it still
  disagrees, the lower figure is replaced by the higher and recorded against its reporter.
- **A bandwidth far under its reverse** (`lopsided_bandwidth`): no lie (a liar deflating its
  own link only pushes traffic away from itself), but an honest probe's usual error. One
  probe read Frankfurt->Seoul at 2.1 Mbit/s where Seoul->Frankfurt read 8.8 and the emulated
  link carries 8.9 both ways (`coordinator demo --wan world --nat 3`); the demo's rank order
  then predicted 8.48 s a step and ran 4.10. That cause, windows shorter than a round trip,
  is fixed in the probe (`agent.probing.linkprobe.window_s`); load or a lost packet can still
  make one probe read low. Such a link gets a
  second, quiet probe of its own, and keeps the higher of its two readings
  (`LinkMeasurer`): an honest probe errs low. Honest asymmetry (a home uplink) reads the
  same twice and stays.
- **A dead link only one end reports** (`one_sided`): a reported failure a->b whose reverse
  b->a was probed fine, into an agent everyone can dial, is recorded against its reporter
  (`coordinator/links/store.py` `blame` never resolves such a tie against b).

Evidence here is only recorded, never enough to exclude: an honest agent on a broken path
says the same (docs/architecture.md, "Integrity"). Pure functions over a `LinkStore`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Container, Sequence
from dataclasses import replace

from coordinator.links.store import LinkEntry, LinkStore

ASYMMETRY = 100.0  # the most two directions of one path may differ in bandwidth
DEFLATION = (4.0, 0.5)  # a delay under (high - 0.5 ms) / 4 of its reverse is suspect
# a bandwidth under 1/2.5 of its reverse's gets a second look (directions of a symmetric
# emulated link read within 1.05x of each other; the low probe above, 4.2x)
LOPSIDED = 2.5
MAX_SECOND_LOOKS = 6  # links probed again per measurement, the most lopsided first
LINK_FIGURE = "link_figure"  # evidence kinds
DEAD_LINK = "dead_link"

Evidence = Callable[[str, str, str], None]  # (suspect, kind, detail)


def _probed(e: LinkEntry | None) -> bool:
    """A figure its sender probed itself (not taken the other way, relayed or inferred)."""
    return (e is not None and e.reachable and not e.judged and e.path == ""
            and not e.estimate.startswith("inferred"))


def _pinged(e: LinkEntry | None) -> bool:
    """A delay its sender pinged itself (not taken the other way or relayed)."""
    return e is not None and e.reachable and not e.judged and e.path == ""


def inflated_bandwidth(store: LinkStore, ids: Sequence[str], evidence: Evidence
                       ) -> list[tuple[str, str]]:
    """Replace every bandwidth more than ASYMMETRY times its reverse's by the reverse's,
    recording it against its reporter; returns the links replaced."""
    out = []
    for a, b in itertools.permutations(ids, 2):
        ab, ba = store.entries.get((a, b)), store.entries.get((b, a))
        if not (_probed(ab) and _probed(ba)) or ab is None or ba is None:
            continue
        if ba.bandwidth_gbps <= 0 or ab.bandwidth_gbps <= ASYMMETRY * ba.bandwidth_gbps:
            continue
        why = (f"reported {ab.bandwidth_gbps:g} Gbit/s to {b}, over {ASYMMETRY:g}x the "
               f"{ba.bandwidth_gbps:g} Gbit/s {b} measured back (no access link is that "
               f"asymmetric): discarded, the link priced at the reverse's figure")
        store.entries[(a, b)] = replace(ab, bandwidth_gbps=ba.bandwidth_gbps,
                                        estimate=f"taken from {b}->{a}: {a} {why}")
        evidence(a, LINK_FIGURE, why)
        out.append((a, b))
    return out


def lopsided_bandwidth(store: LinkStore, ids: Sequence[str]) -> list[tuple[str, str]]:
    """The links whose probed bandwidth is under 1/LOPSIDED of their reverse's, the most
    lopsided first, at most MAX_SECOND_LOOKS."""
    found = []
    for a, b in itertools.permutations(ids, 2):
        ab, ba = store.entries.get((a, b)), store.entries.get((b, a))
        if not (_probed(ab) and _probed(ba)) or ab is None or ba is None:
            continue
        if 0 < ab.bandwidth_gbps * LOPSIDED < ba.bandwidth_gbps:
            found.append((ab.bandwidth_gbps / ba.bandwidth_gbps, a, b))
    return [(a, b) for _, a, b in sorted(found)[:MAX_SECOND_LOOKS]]


def deflated_delays(store: LinkStore, ids: Sequence[str]) -> list[tuple[str, str]]:
    """(low reporter, other end) of each pair whose low end's delay is under DEFLATION of
    the other's."""
    out = []
    for a, b in itertools.combinations(ids, 2):
        ab, ba = store.entries.get((a, b)), store.entries.get((b, a))
        if not (_pinged(ab) and _pinged(ba)) or ab is None or ba is None:
            continue
        (low, lo_end, hi_end), high = min((ab.delay_ms, a, b), (ba.delay_ms, b, a)), max(
            ab.delay_ms, ba.delay_ms)
        if low * DEFLATION[0] + DEFLATION[1] < high:
            out.append((lo_end, hi_end))
    return out


def discard_deflated(store: LinkStore, ids: Sequence[str], evidence: Evidence
                     ) -> list[tuple[str, str]]:
    """Replace each deflated delay (`deflated_delays`) by its reverse's, recording it
    against its reporter; returns the links replaced."""
    pairs = deflated_delays(store, ids)
    for a, b in pairs:
        ab, ba = store.entries[(a, b)], store.entries[(b, a)]
        why = (f"reported {ab.delay_ms:.3g} ms to {b}, but {b} measured {ba.delay_ms:.3g} ms "
               f"back, twice: a ping errs high, never below the wire; discarded, the link "
               f"priced at {ba.delay_ms:.3g} ms")
        store.entries[(a, b)] = replace(ab, delay_ms=ba.delay_ms)
        evidence(a, LINK_FIGURE, why)
    return pairs


def one_sided(store: LinkStore, ids: Sequence[str], dialable: Container[str],
              evidence: Evidence) -> list[tuple[str, str]]:
    """Record against its reporter every failed link a->b (reported, not judged by the
    coordinator) whose reverse b->a was probed fine, where b is `dialable` by everyone;
    returns those links."""
    out = []
    for a, b in itertools.permutations(ids, 2):
        ab, ba = store.entries.get((a, b)), store.entries.get((b, a))
        if (ab is None or ab.reachable or ab.judged or not _pinged(ba)
                or b not in dialable):
            continue
        evidence(a, DEAD_LINK, f"reported its link to {b} failed ({ab.error[:120]}), "
                               f"while {b} reached it and everyone can dial {b}")
        out.append((a, b))
    return out
