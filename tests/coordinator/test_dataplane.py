"""The coordinator's data-plane choice per epoch (coordinator/job/dataplane.py)."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.daemon.registry import AgentRecord
from coordinator.job.dataplane import DataPlanes, pair_bytes, peer_table
from coordinator.links.relayed import direct_dials
from coordinator.scheduler.relaychoice import NOMINAL_BYTES
from coordinator.scheduler.steptime import StepShape
from dtfm.core.layout import Layout
from dtfm.net import dataplane as dp
from dtfm.net import reach
from dtfm.net.front import Front
from dtfm.procs import wait_for
from protos.dtfm.v1 import common_pb2, coordinator_pb2
from tests.dtfm.test_relay_counters import hello_only


def _rec(i: int, verdict: int, kind: str = "cpu") -> AgentRecord:
    info = common_pb2.AgentInfo(agent_id=f"a{i}", host=f"10.0.0.{i}", port=7071,
                                data_port=7072, device=common_pb2.DeviceInfo(kind=kind))
    return AgentRecord(info, 0.0, 0.0, reach=common_pb2.ReachStatus(verdict=verdict))


def test_every_member_reachable_keeps_gloo_or_nccl() -> None:
    planes = DataPlanes()
    cpu = [_rec(i, reach.EVERYWHERE) for i in range(3)] + [_rec(4, reach.UNKNOWN)]
    assert planes.plan("j", 1, cpu).backend == "gloo" and planes.plan("j", 1, cpu).plane is None
    gpu = [_rec(i, reach.EVERYWHERE, "cuda") for i in range(2)]
    assert planes.plan("j", 1, gpu).backend == "nccl"
    assert DataPlanes("dtfm").backend(cpu) == "dtfm"
    assert DataPlanes("gloo").backend([_rec(1, reach.NOWHERE)]) == "gloo"


def test_unreachable_members_get_dtfm_a_peer_table_and_a_fresh_secret_per_epoch() -> None:
    async def run() -> None:
        planes = DataPlanes()
        await planes.start_relay("127.0.0.1", 0)
        try:
            recs = [_rec(1, reach.EVERYWHERE), _rec(2, reach.NOWHERE),
                    _rec(3, reach.SOME_PEERS), _rec(4, reach.UNKNOWN)]
            e1 = planes.plan("job-x", 1, recs)
            e2 = planes.plan("job-x", 2, recs)
            assert e1.backend == e2.backend == "dtfm" and e1.plane and e2.plane
            assert list(e1.plane.listen) == ["10.0.0.1:7072", "", "", ""]
            assert e1.relayed == ["a2", "a3", "a4"]
            assert planes.relay is not None
            assert e1.plane.relay == f":{planes.relay.port}"
            assert len(e1.plane.secret) == 32 and e1.plane.secret != e2.plane.secret
            # the relay knows epoch 2 only: epoch 1 was retired when 2 was planned
            assert planes.relay.epochs() == [(dp.job_digest("job-x"), 2)]
        finally:
            await planes.close()
    asyncio.run(run())


def test_a_gpu_job_with_an_unreachable_member_trains_on_its_gpus_over_dtfm() -> None:
    """Every member CUDA: NCCL when all accept connections; with one that cannot, the dtfm
    plane with `gpu` set (the workers place their stages on CUDA and stage messages through
    host memory); a job with one CPU member is a CPU job either way."""
    reachable = [_rec(1, reach.EVERYWHERE, "cuda"), _rec(2, reach.EVERYWHERE, "cuda")]
    assert DataPlanes().plan("j", 1, reachable).backend == "nccl"
    gpu = DataPlanes().plan("j", 1, [_rec(1, reach.EVERYWHERE, "cuda"),
                                     _rec(2, reach.NOWHERE, "cuda")])
    assert gpu.backend == "dtfm" and not gpu.unsupported
    assert gpu.plane is not None and gpu.plane.gpu
    mixed = DataPlanes().plan("j", 1, [_rec(1, reach.EVERYWHERE, "cuda"),
                                       _rec(2, reach.NOWHERE)])
    assert mixed.plane is not None and not mixed.plane.gpu


def test_missing_relays_are_refused_with_a_reason() -> None:
    no_relay = [_rec(1, reach.NOWHERE), _rec(2, reach.NOWHERE)]
    assert "--relay-port 0" in DataPlanes().plan("j", 1, no_relay).unsupported
    one = DataPlanes().plan("j", 1, [_rec(1, reach.EVERYWHERE), _rec(2, reach.NOWHERE)])
    assert not one.unsupported and one.plane is not None and one.plane.relay == ""
    with pytest.raises(ValueError, match="--transport"):
        DataPlanes("udp")


def test_by_default_each_daemon_serves_its_data_plane_on_its_grpc_port() -> None:
    """One port per daemon (dtfm/net/front.py): an agent advertises its gRPC port as its data
    port and the coordinator's relay shares its gRPC port, unless given ports of their own
    (deploy/install.sh numbers a host's agents 7071, 7072, ...: nothing else to collide)."""
    from agent.daemon.config import AgentConfig
    from coordinator.daemon.config import CoordinatorConfig

    grpc = [7071 + n for n in range(8)]
    assert [AgentConfig(listen=f"0.0.0.0:{p}").data_port_for(p) for p in grpc] == grpc
    assert AgentConfig(listen="0.0.0.0:7071").data_shared
    own_data = AgentConfig(listen="0.0.0.0:7071", data_port=9000)
    assert own_data.data_port_for(7071) == 9000 and not own_data.data_shared
    shared = CoordinatorConfig(listen="0.0.0.0:7070")
    assert shared.relay_shared and shared.relay_address() is None
    own = CoordinatorConfig(listen="0.0.0.0:7070", relay_port=7170)
    assert not own.relay_shared and own.relay_address() == ("0.0.0.0", 7170)
    off = CoordinatorConfig(listen="0.0.0.0:7070", relay_port=0)
    assert not off.relay_shared and off.relay_address() is None


def _relay_agent_world(agent_delay_ms: float, shape: StepShape | None = None
                       ) -> tuple[list[AgentRecord], tuple]:
    """2 stages x 2 replicas: rank 0 a reachable relay agent, ranks 1-3 dial only. Every
    direct hop 10 ms except via the relay agent (`agent_delay_ms` each way); the
    coordinator-relayed links (the pairs of dial-only ranks) 25 ms; 1 Gbit/s everywhere."""
    import numpy as np

    from coordinator.scheduler.network import Network
    from dtfm.core.layout import Layout

    recs = [_rec(0, reach.EVERYWHERE)] + [_rec(i, reach.NOWHERE) for i in (1, 2, 3)]
    recs[0].info.relay_port = 7171
    delay = np.full((4, 4), 25.0)
    delay[0, :] = delay[:, 0] = agent_delay_ms
    net = Network.measured(delay, np.ones((4, 4)))
    return recs, (net, [0, 1, 2, 3], Layout(2, 2), shape)


def test_dial_only_pairs_spread_over_the_coordinator_and_a_near_relay_agent() -> None:
    async def run() -> None:
        planes = DataPlanes()
        await planes.start_relay("127.0.0.1", 0)
        try:
            recs, links = _relay_agent_world(agent_delay_ms=10.0)
            plane = planes.plan("j", 1, recs, links).plane
            assert plane is not None
            pairs = {(p.rank_a, p.rank_b): p.relay for p in plane.pair_relays}
            # talking pairs: (1, 3) data-parallel, (2, 3) pipeline; (1, 2) scalars only.
            # The first talking pair takes the nearer agent, the second the idle
            # coordinator (the agent's uplink would be shared), the light one the agent.
            assert pairs == {(1, 3): "10.0.0.0:7171", (1, 2): "10.0.0.0:7171"}
            far_recs, far = _relay_agent_world(agent_delay_ms=900.0)
            assert not planes.plan("j", 2, far_recs, far).plane.pair_relays  # far: avoided
        finally:
            await planes.close()
    asyncio.run(run())


def test_pairs_weigh_the_bytes_the_plans_step_moves_between_them() -> None:
    layout = Layout(2, 2)
    shape = StepShape(micro_batches=4, act_bytes=1e6, grad_bytes=[8e6, 4e6], sync_every=2)
    weights = pair_bytes(layout, shape)
    pipeline = {p for p in weights if layout.stage_of(p[0]) != layout.stage_of(p[1])}
    assert len(pipeline) == 2 and len(weights) == 4  # two neighbours, two dp groups
    for (a, b), w in weights.items():
        stage = layout.stage_of(a)
        # activations and their gradients of 4 micro-batches; 2/R of the stage's gradient
        # every second step
        assert w == (8e6 if (a, b) in pipeline else 2 * [8e6, 4e6][stage] / 2 / 2)
    assert set(pair_bytes(layout, None).values()) == {NOMINAL_BYTES}


def test_the_heavier_pair_takes_the_nearer_relay() -> None:
    async def run() -> None:
        planes = DataPlanes()
        await planes.start_relay("127.0.0.1", 0)
        try:
            # as in the test above, but the pipeline pair (2, 3) moves 10x the gradient pair
            # (1, 3): it goes first and takes the near agent, (1, 3) the idle coordinator
            heavy_pipeline = StepShape(micro_batches=1, act_bytes=5e7, grad_bytes=[1e7, 1e7])
            recs, links = _relay_agent_world(agent_delay_ms=10.0, shape=heavy_pipeline)
            plane = planes.plan("j", 1, recs, links).plane
            assert plane is not None
            pairs = {(p.rank_a, p.rank_b): p.relay for p in plane.pair_relays}
            assert pairs == {(2, 3): "10.0.0.0:7171", (1, 2): "10.0.0.0:7171"}
        finally:
            await planes.close()
    asyncio.run(run())


def test_a_relay_agent_serves_every_pair_when_the_coordinator_relays_nothing() -> None:
    recs, links = _relay_agent_world(agent_delay_ms=10.0)
    e = DataPlanes().plan("j", 1, recs, links)
    assert not e.unsupported and e.plane is not None
    assert sorted((p.rank_a, p.rank_b) for p in e.plane.pair_relays) == [(1, 2), (1, 3), (2, 3)]
    unmeasured = DataPlanes().plan("j", 1, recs).unsupported  # no links: no agent weighed
    assert "no relay agent" in unmeasured


def test_status_adds_relay_agents_counts_and_keeps_them_across_an_agent_restart() -> None:
    planes = DataPlanes()
    assert planes.status_fields("j") == {"relayed_bytes": 0, "relay_refused_bytes": 0}

    def report(forwarded: int, refused: int) -> coordinator_pb2.ProgressReport:
        return coordinator_pb2.ProgressReport(relay_forwarded_bytes=forwarded,
                                              relay_refused_bytes=refused)

    planes.observe("a", report(100, 5))
    planes.observe("b", report(40, 0))
    planes.observe("a", report(250, 5))  # counts since its start: the newest replaces
    assert planes.status_fields("j") == {"relayed_bytes": 290, "relay_refused_bytes": 5}
    planes.observe("a", report(30, 0))  # restarted: counts from zero, the 250 stay counted
    assert planes.status_fields("j") == {"relayed_bytes": 320, "relay_refused_bytes": 5}


def test_an_adopted_epoch_is_retired_on_whichever_relay_the_planes_get() -> None:
    """After a restart the adopted epoch's key is gone: the relay, made before or after the
    adoption, takes its members' dials for stale ones; the next epoch is admitted as ever."""
    shared, own = DataPlanes(), DataPlanes()
    shared.adopted("j", 4)  # before the daemon makes its relay
    front = Front()
    relay = shared.share_relay(front)
    assert front.on_data == relay.accept  # wired before the front listens, not after
    own.share_relay_of(shared)
    own.adopted("k", 2)
    assert shared.plan("j", 5, [_rec(0, reach.NOWHERE), _rec(1, reach.EVERYWHERE)]).plane
    addr = relay.start_in_thread()  # listening itself here, for the test's dials
    try:
        for job, epoch in (("j", 4), ("k", 1), ("k", 2)):
            hello_only(addr, job, epoch)
        hello_only(addr, "k", 3)  # never admitted: a stranger's dial
        wait_for(lambda: relay.stale_dials == 3 and relay.rejected == 1, 10,
                 "the relay's verdicts on four dials")
        assert relay.refused_bytes == dp.HELLO_BYTES
        assert relay.epochs() == [(dp.job_digest("j"), 5)]
    finally:
        relay.stop()


def _dialled(rec: AgentRecord, *results: tuple[str, bool]) -> AgentRecord:
    """`rec` with the dial-back results (dialer, got through) of its check."""
    rec.reach.dials.extend(reach.result(d, "" if ok else "deadline exceeded")
                           for d, ok in results)
    return rec


def _site_world() -> list[AgentRecord]:
    """a0 reachable; a1 and a2 behind one NAT (each reached by the other's dial-back, by
    nobody else); a3 behind a NAT of its own."""
    return [_rec(0, reach.EVERYWHERE),
            _dialled(_rec(1, reach.SOME_PEERS), ("coordinator", False), ("a2", True),
                     ("a0", False)),
            _dialled(_rec(2, reach.SOME_PEERS), ("coordinator", False), ("a1", True)),
            _dialled(_rec(3, reach.NOWHERE), ("coordinator", False), ("a0", False))]


def test_a_some_peers_member_listens_for_the_peers_that_reached_it_only() -> None:
    """Before: a SOME_PEERS member was taken as NOWHERE, so the a1-a2 pair of one site met
    at the relay. Now each listens for the other: they talk directly, and only pairs with no
    direct path either way (with a3) are relayed."""
    async def run() -> None:
        planes = DataPlanes()
        await planes.start_relay("127.0.0.1", 0)
        try:
            e = planes.plan("j", 1, _site_world())
            assert e.plane is not None and not e.unsupported
            assert list(e.plane.listen) == ["10.0.0.0:7072", "10.0.0.1:7072",
                                            "10.0.0.2:7072", ""]
            assert list(e.plane.limited) == [1, 2]
            assert {(d.dialer, d.listener) for d in e.plane.direct} == {(1, 2), (2, 1)}
            table = peer_table(_site_world(), direct_dials(_site_world()))
            assert table.relayed_pairs() == [(1, 3), (2, 3)]  # not (1, 2), nor any with a0
            assert not table.can_dial(0, 1) and table.can_dial(1, 0)  # a0 did not reach a1
        finally:
            await planes.close()
    asyncio.run(run())


def test_a_probe_that_got_through_is_evidence_of_its_direction_and_no_relay_is_needed() -> None:
    """A link probe of a3 by a1 got through (identified by id, path "": probed): a1 may dial
    a3 though a3's dial-back had no site peer among its dialers. Its reverse, taken the
    other way, is no evidence. With every pair direct, no relay is needed at all."""
    from coordinator.links.store import REVERSE, LinkEntry, LinkStore

    store = LinkStore()
    store.entries["a1", "a3"] = LinkEntry(1.0, 1.0, True, "", 0.0)
    store.entries["a3", "a2"] = LinkEntry(1.0, 1.0, True, "", 0.0, path=REVERSE)
    assert direct_dials(_site_world(), store) == {("a1", "a2"), ("a2", "a1"), ("a1", "a3")}
    recs = [_site_world()[k] for k in (1, 2, 3)]  # ranks: a1, a2, a3
    three = DataPlanes().plan("j", 1, recs, probes=store)  # no relay running
    assert three.unsupported  # a2-a3 has no direct path and there is no relay
    two = DataPlanes().plan("j", 1, recs[:2])
    assert not two.unsupported and two.plane is not None and two.plane.relay == ""
    assert {(d.dialer, d.listener) for d in two.plane.direct} == {(0, 1), (1, 0)}
    # the operator's --reachable no stands over any evidence: nobody dials it
    recs[0].reach.overridden = True
    assert ("a2", "a1") not in direct_dials(recs, store)
