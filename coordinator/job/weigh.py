"""The figures a re-plan weighs (`coordinator/job/replan.py`): which links moved past the
noise of a measurement taken while the job trains, which to probe, what a move costs in
checkpoint copies, and the verdict. Pure functions of numbers, no state: each is tested on
its own (tests/coordinator/test_replan.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from coordinator.links.infer import latency_clusters, representatives
from coordinator.scheduler import Network
from protos.dtfm.v1 import coordinator_pb2

# How far past the newest reported step (seconds, on top of a heartbeat interval: the newest
# report may be that old) a requested checkpoint lies: the command must reach every agent
# before its worker ends that step
REQUEST_MARGIN_S = 1.0
LINK_CHANGE_MS = 5.0  # a delay that moved less than this (and the threshold) did not change
# a sweep taken while the job trains reads many links high by a similar amount; a delay moved
# only past that sweep's own noise: twice the shift that 3 in 4 of its links stay under ...
SWEEP_NOISE_QUANTILE = 0.75
SWEEP_NOISE_FACTOR = 2.0
SWEEP_NOISE_CAP_MS = 50.0  # ... but a delay that moved by 50 ms always changed
SWEEP_NOISE_MIN_LINKS = 8  # fewer readings cannot tell a sweep's noise from a change


def grid_text(grid: list[list[str]]) -> str:
    return ";".join(",".join(row) for row in grid)


def plan_links(grid: list[list[int]]) -> set[tuple[int, int]]:
    """The directed links a grid's traffic uses: pipeline neighbours and data-parallel
    groups, both ways."""
    links: set[tuple[int, int]] = set()
    for j in range(len(grid) - 1):
        for a, b in zip(grid[j], grid[j + 1], strict=True):
            links |= {(a, b), (b, a)}
    for row in grid:
        links |= {(a, b) for a in row for b in row if a != b}
    return links


def moved(old: Network, new: Network, threshold: float, floor_ms: float = LINK_CHANGE_MS
          ) -> tuple[np.ndarray, np.ndarray]:
    """Per directed link: did its delay, did its bandwidth move by more than the threshold (a
    fraction; delays also by more than `floor_ms`)? Less than that is measurement noise."""
    d0, d1 = old.delay_ms, new.delay_ms
    b0, b1 = old.bandwidth_gbps, new.bandwidth_gbps
    with np.errstate(divide="ignore", invalid="ignore"):
        delay = np.abs(d1 - d0) > np.maximum(floor_ms, threshold * d0)
        rate = (b0 > 0) & (b1 > 0) & (np.maximum(b0 / b1, b1 / b0) > 1.0 + threshold)
    np.fill_diagonal(delay, False)
    np.fill_diagonal(rate, False)
    return delay, rate


def request_lead(step_s: float, heartbeat_s: float) -> int:
    """Steps past the newest reported one to ask a checkpoint for: the report may be a
    heartbeat old, and the ask needs `REQUEST_MARGIN_S` more to reach every worker before it
    ends that step (a sparse `--heartbeat-interval` asks further ahead, so workers still hear
    in time rather than the move falling back to the regular checkpoint)."""
    return 1 + math.ceil((heartbeat_s + REQUEST_MARGIN_S) / max(step_s, 1e-3))


def changed_links(old: Network, new: Network, ids: list[str], threshold: float
                  ) -> list[coordinator_pb2.LinkChange]:
    """The links whose delay or bandwidth moved by more than the threshold (a fraction)."""
    delay, rate = moved(old, new, threshold)
    return [coordinator_pb2.LinkChange(
        src=ids[i], dst=ids[j], delay_ms_before=float(old.delay_ms[i, j]),
        delay_ms_after=float(new.delay_ms[i, j]), gbps_before=float(old.bandwidth_gbps[i, j]),
        gbps_after=float(new.bandwidth_gbps[i, j]))
        for i, j in zip(*np.nonzero(delay | rate), strict=True)]


class Settled(NamedTuple):
    """A settled re-measurement and which of its links moved past the threshold."""

    net: Network
    delay_moved: np.ndarray  # bool [i, j]
    rate_moved: np.ndarray
    noise_ms: float  # the sweep's noise floor: a delay moved by less did not change


def sweep_noise_ms(old_delay_ms: np.ndarray, delay_ms: np.ndarray) -> float:
    """How far a sweep moved the delays of links that did not change, from the sweep itself.

    Pings taken beside training traffic on busy hosts read high, and by much the same for
    many links at once: bench/drift.py's run 4 read 85 unchanged links 14-16 ms high, past
    the fixed 5 ms floor, where the 8 degraded links had moved 125-157 ms, and probing the
    bandwidth of every pair whose delay "moved" took 95 s. A change is the exception among a
    sweep's links, so twice the shift that 3 in 4 links stay under bounds the noise as long
    as fewer than a quarter of the links changed (one degraded city pair of 8 cities moves 3 %
    of them); a mode of noise that only some links share (a third of them there) stays under
    it too, where the median and its deviation would call it a change. Capped, so a move of
    `SWEEP_NOISE_CAP_MS` always counts; never below `LINK_CHANGE_MS`."""
    seen = np.isfinite(delay_ms) & np.isfinite(old_delay_ms) & ~np.eye(len(delay_ms), dtype=bool)
    shift = np.abs(delay_ms - old_delay_ms)[seen]
    if shift.size < SWEEP_NOISE_MIN_LINKS:
        return LINK_CHANGE_MS
    return float(np.clip(SWEEP_NOISE_FACTOR * np.quantile(shift, SWEEP_NOISE_QUANTILE),
                         LINK_CHANGE_MS, SWEEP_NOISE_CAP_MS))


def settle_remeasured(old: Network, delay_ms: np.ndarray, bandwidth_gbps: np.ndarray,
                      threshold: float) -> Settled:
    """The figures a re-plan weighs, from a re-measurement taken while the job trains.

    Pings then queue behind the training traffic and wait for busy cores, so they read high,
    and more on one end of a pair than the other. Both ends time the same round trip, so the
    lesser of the two readings is the better one for both directions. A link whose figure
    stayed within the threshold of the plan's, or within the sweep's own noise
    (`sweep_noise_ms`), keeps the plan's: noise must not re-route a plan (a link that failed
    to measure keeps it too)."""
    delay = np.fmin(delay_ms, delay_ms.T)
    noise = sweep_noise_ms(old.delay_ms, delay)
    delay = np.where(np.isnan(delay), old.delay_ms, delay)
    bandwidth = np.where(np.isnan(bandwidth_gbps), old.bandwidth_gbps, bandwidth_gbps)
    delay_moved, rate_moved = moved(old, Network.measured(delay, bandwidth), threshold, noise)
    return Settled(Network.measured(np.where(delay_moved, delay, old.delay_ms),
                                    np.where(rate_moved, bandwidth, old.bandwidth_gbps)),
                   delay_moved, rate_moved, noise)


def links_to_probe(grid: list[list[int]], ids: list[str], delay_moved: np.ndarray,
                   suspects: set[str]) -> set[tuple[str, str]]:
    """The links whose bandwidth a re-measurement probes, after its latency sweep.

    Those whose delay moved (both directions of the pair, in the plan or not): a congested,
    throttled or re-routed path shows in its round trip, and a link the plan does not use yet
    keeping its old rate would draw the new plan onto it. Where no delay moved, the plan's
    links that touch a suspect: a link can lose rate without its delay moving. Probing every
    plan link instead took 48 s on the 16-agent world (72 links, two at a time) and slowed the
    steps meanwhile (bench/drift.py)."""
    n = len(ids)
    pairs = {(a, b) for a in range(n) for b in range(n)
             if a != b and (delay_moved[a, b] or delay_moved[b, a])}
    if not pairs:
        pairs = {(a, b) for a, b in plan_links(grid) if ids[a] in suspects or ids[b] in suspects}
    return {(ids[a], ids[b]) for a, b in pairs}


def probe_representatives(links: set[tuple[str, str]], ids: list[str], net: Network
                          ) -> dict[tuple[str, str], tuple[str, str]]:
    """Which of the links whose delay moved stand for which (`linkinfer.representatives`,
    over latency clusters of the sweep's settled delays): links that moved alike between the
    same two places share one probe. Only where delays moved: a link that lost rate and kept
    its delay looks like its neighbours, so the suspects' plan links are each probed."""
    at = {a: i for i, a in enumerate(ids)}

    def delay(a: str, b: str) -> float | None:
        value = float(net.delay_ms[at[a], at[b]])
        return value if np.isfinite(value) else None

    return representatives(links, latency_clusters(ids, delay), delay)


def copy_seconds(old_grid: list[list[int]], new_grid: list[list[int]], stage_bytes: list[int],
                 net: Network, newcomers: frozenset[int] = frozenset()) -> float:
    """Seconds for the members that change stage to fetch their new stage's checkpoint from
    the best-connected member that holds it (fetches run in parallel: the slowest counts).
    `newcomers`: devices that hold nothing (a spare put in a member's place, at its index)."""
    worst = 0.0
    for j, row in enumerate(new_grid):
        holders = [h for h in old_grid[j] if h not in newcomers] or old_grid[j]
        for d in row:
            if d in holders:
                continue
            gbps = max(float(net.bandwidth_gbps[h, d]) for h in holders)
            delay_s = min(float(net.delay_ms[h, d]) for h in holders) / 1e3
            worst = max(worst, 8.0 * stage_bytes[j] / (max(gbps, 1e-9) * 1e9) + delay_s)
    return worst


def move_verdict(stay_s: float, new_s: float, steps_left: int, cost_s: float,
                 margin: float) -> tuple[bool, float, str]:
    """(move?, predicted gain in seconds, why)."""
    gain = (stay_s - new_s) * steps_left
    if new_s >= stay_s:
        return False, gain, (f"no better plan: the new one predicts {new_s:.2f} s/step, "
                             f"staying {stay_s:.2f} s")
    if gain <= margin * cost_s:
        return False, gain, (f"the gain, {stay_s - new_s:.2f} s x {steps_left} steps = "
                             f"{gain:.0f} s, is under {margin:g} x the {cost_s:.0f} s a move "
                             f"costs")
    return True, gain, (f"{stay_s - new_s:.2f} s/step x {steps_left} steps left = {gain:.0f} s "
                        f"saved, over {margin:g} x the {cost_s:.0f} s a move costs")


def with_links(net: Network, ids: list[str],
               figures: dict[tuple[str, str], tuple[float, float]]) -> Network:
    """`net` with the links in `figures` ({(from, to): (delay ms, Gbit/s)}, by agent id) set
    to those figures; links of agents not in `ids` are ignored."""
    at = {a: i for i, a in enumerate(ids)}
    delay, bandwidth = np.array(net.delay_ms, dtype=float), np.array(net.bandwidth_gbps,
                                                                      dtype=float)
    for (x, y), (d, g) in figures.items():
        if x in at and y in at:
            delay[at[x], at[y]], bandwidth[at[x], at[y]] = d, g
    return Network.measured(delay, bandwidth)


def through_relays(links: set[tuple[str, str]], relayed: set[tuple[str, str]],
                   routes: dict[tuple[str, str], str], coordinator: str
                   ) -> set[tuple[str, str]]:
    """The links a re-measurement probes, with each relayed link (neither end accepts, so its
    probe can only fail) replaced by its pair's hops to the relay agent the pair meets at
    (`routes`, either order): (x, relay) for each end, which dials the relay (relay->x is
    taken the other way). A pair at the coordinator's relay (`coordinator`) needs nothing
    here: every sweep measures the hops to the coordinator of the pairs it finds stranded,
    and the pair is priced again from them."""
    out = links - relayed
    for x, y in links & relayed:
        relay = routes.get((x, y), routes.get((y, x)))
        if relay is not None and relay != coordinator:
            out |= {(x, relay), (y, relay)}
    return out
