"""A relay caught altering a frame is named and relays no more (issue 43, item 5): the worker's
refusal is the `tampered` kind, the coordinator blames the relay agent it names (not the
reporter, not the sender), and the next epoch's plane routes the pair elsewhere."""

from __future__ import annotations

import asyncio

from agent.worker import errors
from coordinator.daemon.registry import AgentRecord, Registry
from coordinator.job import rootcause
from coordinator.job.dataplane import DataPlanes
from coordinator.links.relayed import serves_relay
from dtfm.core import causes
from dtfm.net import framemac as fm
from dtfm.net import reach
from protos.dtfm.v1 import common_pb2, coordinator_pb2

RELAY = "10.0.0.1:7171"


def _registry() -> Registry:
    """a0 serves a relay at RELAY and is reachable from everywhere; a1..a3 only dial."""
    registry = Registry(liveness_timeout_s=60)
    for i in range(4):
        registry.join(common_pb2.AgentInfo(agent_id=f"a{i}", host=f"10.0.0.{i + 1}",
                                           port=7071, data_port=7071,
                                           relay_port=7171 if i == 0 else 0))
        rec = registry.get(f"a{i}")
        assert rec is not None
        rec.reach.verdict = reach.EVERYWHERE if i == 0 else reach.NOWHERE
    return registry


def _refused(relay: str = RELAY) -> str:
    """A worker's error as rank 2 reports it: frame 7 from rank 3 failed on the relay."""
    refusal = fm.refusal_message(fm.Refusal(7, 3, 2, fm.MAC, relay))
    return (f"PeerError: rank 2: pipeline receive failed after 0.1 s: dtfm transport: receive "
            f"from rank 3 failed: {refusal}")


def test_the_worker_reports_a_refused_frame_as_tampered_and_a_direct_one_as_bad_value() -> None:
    try:
        try:
            raise RuntimeError("dtfm transport: receive from rank 3 failed: " + _refused())
        except RuntimeError as e:
            raise errors.PeerError(f"pipeline receive failed: {e}") from e
    except errors.PeerError as exc:
        assert errors.classify(exc, errors.TRAIN) == causes.TAMPERED
    direct = fm.refusal_message(fm.Refusal(0, 3, 2, fm.MAC, ""))
    assert errors.classify(errors.PeerError(direct), errors.TRAIN) == causes.BAD_VALUE
    assert causes.outranks(causes.TAMPERED, causes.PEER)
    assert causes.outranks(causes.TAMPERED, causes.BAD_VALUE)
    assert rootcause.hold_s(causes.TAMPERED, 10.0, 10.0, 2.0) == 0.0  # acted on at once


def test_the_relay_agent_is_blamed_and_no_longer_offered() -> None:
    registry = _registry()
    members = ["a0", "a1", "a2", "a3"]
    report = coordinator_pb2.ProgressReport(error=_refused(), error_kind=causes.TAMPERED)
    kept: list[tuple[str, str]] = []
    why, kind = rootcause.worker_failure("a2", report, members, registry,
                                         lambda culprit, why: kept.append((culprit, why)))
    assert kind == causes.TAMPERED and kept == [("a0", why)]  # evidence against the relay
    assert why.startswith(f"relay agent a0 at {RELAY} altered, replayed or reordered frame 7 "
                          f"it forwarded from rank 3 (a3) to rank 2 (a2)"), why
    relay = registry.get("a0")
    assert relay is not None and relay.relay_distrusted == why
    assert not serves_relay(relay) and relay.to_proto().relay_distrusted == why
    assert all(not r.relay_distrusted for r in registry.all() if r.agent_id != "a0")
    rootcause.worker_failure("a1", report, members, registry,
                             lambda culprit, why: kept.append((culprit, why)))
    assert len(kept) == 1  # distrusted once, kept once


def test_a_refusal_on_the_coordinators_relay_blames_no_agent() -> None:
    registry = _registry()
    report = coordinator_pb2.ProgressReport(error=_refused("10.0.0.99:7070"),
                                            error_kind=causes.TAMPERED)
    why, kind = rootcause.worker_failure("a2", report, ["a0", "a1", "a2", "a3"], registry)
    assert kind == causes.TAMPERED and "(the coordinator's)" in why, why
    assert not any(r.relay_distrusted for r in registry.all())


def test_the_next_epoch_routes_the_pairs_away_from_the_distrusted_relay() -> None:
    registry = _registry()
    recs: list[AgentRecord] = registry.all()
    routes = {(f"a{x}", f"a{y}"): "a0" for x, y in ((1, 2), (1, 3), (2, 3))}

    async def run() -> None:
        planes = DataPlanes()
        await planes.start_relay("127.0.0.1", 0)
        try:
            before = planes.plan("job", 1, recs, routes=routes).plane
            assert before is not None
            assert {p.relay for p in before.pair_relays} == {RELAY}
            rootcause.worker_failure("a2", coordinator_pb2.ProgressReport(
                error=_refused(), error_kind=causes.TAMPERED), [r.agent_id for r in recs],
                registry)
            after = planes.plan("job", 2, recs, routes=routes).plane
            assert after is not None
            assert not after.pair_relays  # every pair at the coordinator's relay now
        finally:
            await planes.close()
    asyncio.run(run())
