"""Each relayed pair's relay, chosen by measured links (coordinator/scheduler/relaychoice.py)."""

from __future__ import annotations

import math

from coordinator.scheduler.relaychoice import Path, choose, cost_s

MB = 1e6


def test_flows_spread_over_two_equal_relays() -> None:
    pairs = {(0, 1): 10 * MB, (2, 3): 10 * MB, (4, 5): 10 * MB, (6, 7): 10 * MB}
    same = Path(delay_ms=20.0, gbps=1.0)
    paths = {(p, r): same for p in pairs for r in ("coord", "agent")}
    chosen = choose(pairs, paths, ["coord", "agent"])
    assert sorted(chosen.values()) == ["agent", "agent", "coord", "coord"]


def test_a_far_relay_is_avoided() -> None:
    pairs = {(0, 1): 1 * MB, (2, 3): 1 * MB}
    paths = {}
    for p in pairs:
        paths[(p, "near")] = Path(delay_ms=5.0, gbps=1.0)
        paths[(p, "far")] = Path(delay_ms=400.0, gbps=1.0)
    # sharing "near" (2 flows: 16 ms for 1 MB) still beats 400 ms of delay
    assert choose(pairs, paths, ["far", "near"]) == {(0, 1): "near", (2, 3): "near"}


def test_a_narrow_relay_takes_flows_only_once_the_wide_one_is_loaded() -> None:
    pairs = {(0, 1): 100 * MB, (2, 3): 100 * MB, (4, 5): 100 * MB}
    wide, narrow = Path(delay_ms=10.0, gbps=10.0), Path(delay_ms=10.0, gbps=4.0)
    paths = {**{(p, "wide"): wide for p in pairs}, **{(p, "narrow"): narrow for p in pairs}}
    chosen = choose(pairs, paths, ["narrow", "wide"])
    # wide: 80 ms, 160 ms, 240 ms for its 1st, 2nd, 3rd flow; narrow: 200 ms for its first
    assert sorted(chosen.values()) == ["narrow", "wide", "wide"]


def test_a_pair_no_relay_can_serve_gets_none() -> None:
    pairs = {(0, 1): MB, (2, 3): MB}
    paths = {((0, 1), "r"): Path(5.0, 1.0), ((2, 3), "r"): Path(math.inf, 1.0)}
    assert choose(pairs, paths, ["r"]) == {(0, 1): "r"}
    assert cost_s(Path(5.0, 0.0), MB, 0) == math.inf


def test_heavier_pairs_choose_first() -> None:
    # one good relay, one poor: the heavy pair gets the good one even though listed last
    pairs = {(0, 1): 1 * MB, (2, 3): 500 * MB}
    paths = {}
    for p in pairs:
        paths[(p, "good")] = Path(delay_ms=10.0, gbps=10.0)
        paths[(p, "poor")] = Path(delay_ms=10.0, gbps=1.0)
    chosen = choose(pairs, paths, ["good", "poor"])
    assert chosen[(2, 3)] == "good"
