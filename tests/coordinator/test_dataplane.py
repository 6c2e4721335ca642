"""The coordinator's data-plane choice per epoch (coordinator/job/dataplane.py)."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.daemon.registry import AgentRecord
from coordinator.job.dataplane import DataPlanes
from dtfm import reach
from dtfm.core import dataplane as dp
from protos.dtfm.v1 import common_pb2


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


def test_gpu_jobs_and_missing_relays_are_refused_with_a_reason() -> None:
    gpu = [_rec(1, reach.EVERYWHERE, "cuda"), _rec(2, reach.NOWHERE, "cuda")]
    why = DataPlanes().plan("j", 1, gpu).unsupported
    assert "CPU tensors only" in why and "a2 (nowhere)" in why
    no_relay = [_rec(1, reach.NOWHERE), _rec(2, reach.NOWHERE)]
    assert "--relay-port 0" in DataPlanes().plan("j", 1, no_relay).unsupported
    one = DataPlanes().plan("j", 1, [_rec(1, reach.EVERYWHERE), _rec(2, reach.NOWHERE)])
    assert not one.unsupported and one.plane is not None and one.plane.relay == ""
    with pytest.raises(ValueError, match="--transport"):
        DataPlanes("udp")


def test_by_default_each_daemon_serves_its_data_plane_on_its_grpc_port() -> None:
    """One port per daemon (dtfm/front.py): an agent advertises its gRPC port as its data
    port and the coordinator's relay shares its gRPC port, unless given ports of their own
    (deploy/install.sh numbers a host's agents 7071, 7072, ...: nothing else to collide)."""
    from agent.config import AgentConfig
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


def _relay_agent_world(agent_delay_ms: float) -> tuple[list[AgentRecord], tuple]:
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
    return recs, (net, [0, 1, 2, 3], Layout(2, 2))


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


def test_a_relay_agent_serves_every_pair_when_the_coordinator_relays_nothing() -> None:
    recs, links = _relay_agent_world(agent_delay_ms=10.0)
    e = DataPlanes().plan("j", 1, recs, links)
    assert not e.unsupported and e.plane is not None
    assert sorted((p.rank_a, p.rank_b) for p in e.plane.pair_relays) == [(1, 2), (1, 3), (2, 3)]
    unmeasured = DataPlanes().plan("j", 1, recs).unsupported  # no links: no agent weighed
    assert "no relay agent" in unmeasured
