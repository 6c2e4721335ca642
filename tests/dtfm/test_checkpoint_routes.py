"""Who holds a second copy of each stage's checkpoint, and whom an agent asks for its stage."""

from __future__ import annotations

from typing import Any

import pytest

from dtfm.core.assignment import (
    COORDINATOR_PEER,
    build_assignments,
    checkpoint_routes,
    member_address,
)
from dtfm.core.layout import Layout
from dtfm.core.presets import get_preset
from dtfm.core.spec import TrainConfig
from protos.dtfm.v1 import common_pb2


def _names(layout: Layout) -> list[str]:
    """Member addresses in rank order, named by (stage, replica) for readable asserts."""
    out = []
    for rank in range(layout.world_size):
        stage, replica = layout.coords(rank)
        out.append(f"s{stage}r{replica}:1")
    return out


def test_single_replica_stages_are_mirrored_by_the_next_stage() -> None:
    layout = Layout(3, 1)
    routes = checkpoint_routes(layout, _names(layout))
    assert [r.mirrors for r in routes] == [(
        (2, "s2r0:1"),), ((0, "s0r0:1"),), ((1, "s1r0:1"),)]
    assert routes[1].peers == ("s0r0:1", "s2r0:1")


def test_replicated_stages_need_no_mirror_and_everyone_is_a_peer() -> None:
    layout = Layout(2, 2)
    routes = checkpoint_routes(layout, _names(layout))
    assert all(r.mirrors == () for r in routes)
    for rank, r in enumerate(routes):
        assert set(r.peers) == set(_names(layout)) - {_names(layout)[rank]}


def test_each_rank_asks_its_best_connected_peers_first() -> None:
    """With measured links, a rank's peers start with the fastest link into it (unknown last,
    ties in rank order): an agent fetches from the first holder on its list."""
    layout = Layout(2, 2)
    names = _names(layout)
    nan = float("nan")
    gbps = [[0.0, 0.1, 0.5, 0.5],   # from rank 0
            [2.0, 0.0, nan, 0.5],   # from rank 1
            [0.2, 0.3, 0.0, 0.9],   # from rank 2
            [0.2, 0.3, 0.1, 0.0]]   # from rank 3
    routes = checkpoint_routes(layout, names, gbps)
    assert routes[0].peers == tuple(names[i] for i in (1, 2, 3))
    assert routes[1].peers == tuple(names[i] for i in (2, 3, 0))
    assert routes[2].peers == tuple(names[i] for i in (0, 3, 1))
    assert routes[3].peers == tuple(names[i] for i in (2, 0, 1))
    assert checkpoint_routes(layout, names, [[1.0] * 4] * 4) == checkpoint_routes(layout, names)
    with pytest.raises(ValueError, match="must be 4 x 4"):
        checkpoint_routes(layout, names, gbps[:3])


def test_one_agent_alone_has_no_one_to_copy_to() -> None:
    (only,) = checkpoint_routes(Layout(1, 1), ["a:1"])
    assert only.peers == () and only.mirrors == ()
    with pytest.raises(ValueError, match="2 member addresses for 3 ranks"):
        checkpoint_routes(Layout(3, 1), ["a:1", "b:1"])


def test_build_assignments_sets_routes_only_for_agents_own_directories() -> None:
    members = [("10.0.0.1", 7001), ("::1", 7002)]
    assert member_address("::1", 7002) == "[::1]:7002"

    def build(**train: Any) -> list[common_pb2.Assignment]:
        return build_assignments(
            job_id="j", epoch=0, layout=Layout(2, 1), spec=get_preset("gpt-tiny"),
            train=TrainConfig(global_batch=2, micro_batches=1, **train),
            master_addr="127.0.0.1", master_port=1, members=members)

    first, second = build()
    assert list(first.checkpoint_peers) == ["[::1]:7002"]
    assert [(m.stage, m.peer) for m in first.mirrors] == [(1, "[::1]:7002")]
    assert [(m.stage, m.peer) for m in second.mirrors] == [(0, "10.0.0.1:7001")]
    for shared in (build(checkpoint_dir="/shared"), build(checkpoint_every=0)):
        assert all(not a.checkpoint_peers and not a.mirrors for a in shared)
    plain = build_assignments(job_id="j", epoch=0, layout=Layout(2, 1),
                              spec=get_preset("gpt-tiny"),
                              train=TrainConfig(global_batch=2, micro_batches=1),
                              master_addr="127.0.0.1", master_port=1)
    assert all(not a.checkpoint_peers and not a.mirrors for a in plain)


def test_agents_sharing_a_private_address_are_told_apart_by_id() -> None:
    """Behind two NATs, ranks 0 and 1 both advertise 192.168.1.2:7000: each still lists the
    other (by address alone each took the other for itself and listed nobody)."""
    layout = Layout(2, 1)
    same = ["192.168.1.2:7000", "192.168.1.2:7000"]
    routes = checkpoint_routes(layout, same, ids=["nat-a", "nat-b"])
    assert [r.peers for r in routes] == [("192.168.1.2:7000",), ("192.168.1.2:7000",)]
    assert routes[0].mirrors == ((1, "192.168.1.2:7000"),)
    with pytest.raises(ValueError, match="1 member ids for 2 ranks"):
        checkpoint_routes(layout, same, ids=["nat-a"])


def test_holders_nobody_can_dial_are_asked_last_and_a_stage_only_they_hold_is_pushed_out(
        caplog: pytest.LogCaptureFixture) -> None:
    """A copy needs a dial: peers that can be dialled come first whatever their link, and a
    stage written only by agents behind NATs is pushed by its first holder to the dialable
    agent with the best link from it, where anyone can fetch it."""
    layout = Layout(2, 2)
    names = _names(layout)  # rank = replica * stages + stage: s0r0, s1r0, s0r1, s1r1
    gbps = [[0.0, 1.0, 1.0, 1.0], [9.0, 0.0, 9.0, 9.0], [1.0, 1.0, 0.0, 1.0],
            [9.0, 9.0, 9.0, 0.0]]  # ranks 1 and 3 (stage 1) have the best links out
    with caplog.at_level("WARNING", logger="dtfm.core.assignment"):
        routes = checkpoint_routes(layout, names, gbps, dialable=[True, False, True, False])
    # the coordinator after the dialable members: it may hold a copy where a member is NATed
    assert routes[0].peers == (names[2], COORDINATOR_PEER, names[1], names[3])
    assert routes[2].peers == (names[0], COORDINATOR_PEER, names[1], names[3])
    assert routes[1].pushes == ((1, names[0]),)  # equal links to ranks 0 and 2: the lower
    assert routes[0].received == ((1, names[1]),) and routes[2].received == ()
    faster = [row[:] for row in gbps]
    faster[1][2] = 20.0
    routes = checkpoint_routes(layout, names, faster, dialable=[True, False, True, False])
    assert routes[1].pushes == ((1, names[2]),)  # the better link from the holder
    assert routes[3].pushes == ()
    assert "nobody can dial" not in caplog.text


def test_a_mirrored_stage_whose_holder_nobody_can_dial_is_pushed_to_its_mirror(
        caplog: pytest.LogCaptureFixture) -> None:
    """3 stages, 1 replica, each mirrored by the next stage's agent. Rank 1 is behind a NAT:
    its stage is pushed to rank 2 (which can be dialled) instead of pulled; rank 0's stage,
    mirrored by rank 1, is still pulled (rank 1 dials out to rank 0). Ranks 1 and 2 both
    undialable: stage 1 goes to rank 0."""
    layout = Layout(3, 1)
    names = _names(layout)
    routes = checkpoint_routes(layout, names, dialable=[True, False, True])
    assert routes[1].pushes == ((1, names[2]),) and routes[2].received == ((1, names[1]),)
    assert routes[2].mirrors == () and routes[1].mirrors == ((0, names[0]),)
    assert routes[0].pushes == routes[0].received == ()
    # ranks 1 and 2 both undialable: stage 1's mirror cannot take a push, so rank 1 pushes
    # to the one agent anyone can dial
    routes = checkpoint_routes(layout, names, ids=["a", "b", "c"],
                               dialable=[True, False, False])
    assert routes[1].pushes == ((1, names[0]),) and routes[0].received[-1] == (1, names[1])


def test_with_no_dialable_member_every_stage_is_pushed_to_the_coordinator(
        caplog: pytest.LogCaptureFixture) -> None:
    """Every agent behind a NAT: nobody can take a copy but the coordinator, which every
    agent dials. Each stage's first holder pushes it there (the copy of last resort), and
    every rank's peers name the coordinator, so whoever needs a stage later can fetch it.
    (Before: the stages had no second copy, and losing an agent lost its stage.)"""
    layout = Layout(3, 1)
    names = _names(layout)
    with caplog.at_level("INFO", logger="dtfm.core.assignment"):
        routes = checkpoint_routes(layout, names, ids=["a", "b", "c"], dialable=[False] * 3)
    assert [r.pushes for r in routes] == [((s, COORDINATOR_PEER),) for s in range(3)]
    assert all(r.received == () for r in routes)
    assert routes[0].peers == (COORDINATOR_PEER, names[1], names[2])
    assert "(b), and no member of the job can be dialled: b pushes its newest step to the " \
        "coordinator" in caplog.text
    # replicated stages too; a stage with a dialable replica is not pushed anywhere
    layout = Layout(2, 2)
    names = _names(layout)
    routes = checkpoint_routes(layout, names, dialable=[False] * 4)
    assert routes[0].pushes == ((0, COORDINATOR_PEER),) and routes[2].pushes == ()
    assert routes[1].pushes == ((1, COORDINATOR_PEER),) and routes[3].pushes == ()
    routes = checkpoint_routes(layout, names, dialable=[True, False, False, False])
    assert all(COORDINATOR_PEER not in (p for _, p in r.pushes) for r in routes)
    # every member dialable: the coordinator holds nothing and is not asked
    assert all(COORDINATOR_PEER not in r.peers
               for r in checkpoint_routes(layout, names, dialable=[True] * 4))


def test_build_assignments_names_the_coordinator_in_pushes_and_peers() -> None:
    layout = Layout(2, 1)
    out = build_assignments(
        job_id="j", epoch=1, layout=layout, spec=get_preset("gpt-tiny"),
        train=TrainConfig(global_batch=2, micro_batches=1, checkpoint_every=2),
        master_addr="10.0.0.1", master_port=1, members=[("10.0.0.1", 1), ("10.0.0.2", 1)],
        member_dialable=[False, False])
    for rank, a in enumerate(out):
        assert [(p.stage, p.peer) for p in a.checkpoint_pushes] == [(rank, COORDINATOR_PEER)]
        assert COORDINATOR_PEER in a.checkpoint_peers
