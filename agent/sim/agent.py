"""One simulated agent: the real session, with modelled link probes and a modelled worker.

`SimSession` is `CoordinatorSession` itself (join, re-join with backoff, heartbeats built by
`progress_report`, commands dispatched by `_handle`, link reports sent by `_measure`); only
its probe of one peer is replaced, by the world's figures for that link after as long as the
real probe would take (`probe_seconds`). `SimSupervisor` is the real `Supervisor` with the
worker process replaced: it folds the step events a worker would print into the same
`WorkerProgress`, at the pace the plan's step model predicts for the epoch, plus noise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from agent.daemon.session import CoordinatorSession
from agent.daemon.supervisor import Supervisor, WorkerProgress
from agent.sim.world import World
from dtfm import rpc
from dtfm.core.events import StepEvent
from dtfm.core.limits import MAX_PING_SPREAD_S, PING_SPACING_S
from dtfm.core.workerstate import WorkerState
from protos.dtfm.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)
# (predicted step s, predicted compute s) of a job's epoch, as its plan says
Pace = Callable[[common_pb2.Assignment], Awaitable[tuple[float, float]]]
STEP_NOISE = 0.05  # each step's time varies this much (a lognormal's sigma)
STARTUP_S = 0.5  # from an assignment to the first step: a pre-warmed worker's start
SIM_PREFIX = "sim-"


def agent_id(index: int) -> str:
    return f"{SIM_PREFIX}{index:05d}"


def agent_index(agent_id: str) -> int | None:
    """The world index of a simulated agent's id; None for anything else."""
    tail = agent_id.removeprefix(SIM_PREFIX)
    return int(tail) if tail != agent_id and tail.isdigit() else None


def probe_seconds(kind: int, cmd: coordinator_pb2.MeasureLinksCommand, rtt_s: float) -> float:
    """How long the real probe of one peer takes (agent/probing/linkprobe.py): a warm-up
    ping and `ping_count` pings over the spread (or PING_SPACING_S apart); a transfer runs
    until its windows agree, about one and a half `probe_seconds`, after a connection."""
    seconds = 0.0
    if kind != coordinator_pb2.MEASURE_KIND_BANDWIDTH:
        count = max(1, cmd.ping_count or 5)
        spread = min(cmd.ping_spread_s, MAX_PING_SPREAD_S) if cmd.ping_spread_s > 0 else 0.0
        seconds += rtt_s + (spread if spread > 0 else count * PING_SPACING_S) + rtt_s
    if kind != coordinator_pb2.MEASURE_KIND_LATENCY:
        seconds += 2 * rtt_s + 1.5 * (cmd.probe_seconds or 1.0)
    return seconds


class SimSupervisor(Supervisor):
    """A supervisor whose worker is a clock: steps at the plan's predicted pace."""

    def __init__(self, pace: Pace, rng: random.Random, time_scale: float = 1.0) -> None:
        super().__init__(Path("/nonexistent/sim"))  # no worker is ever launched there
        self._pace, self._rng, self._scale = pace, rng, time_scale
        self._clock: asyncio.Task[None] | None = None
        self.on_step: Callable[[WorkerProgress], None] = lambda p: None

    async def start(self, assignment: common_pb2.Assignment) -> None:
        await self.stop("replaced by a new assignment")
        self.progress = WorkerProgress(job_id=assignment.job_id, epoch=assignment.epoch,
                                       state=WorkerState.STARTING,
                                       total_steps=assignment.train.steps)
        self._clock = asyncio.create_task(self._train(assignment, self.progress))

    async def _train(self, a: common_pb2.Assignment, progress: WorkerProgress) -> None:
        step_s, compute_s = await self._pace(a)
        await asyncio.sleep(STARTUP_S * self._scale)
        tokens = a.train.global_batch * a.model.seq_len
        for step in range(1, a.train.steps + 1):
            took = max(step_s, 1e-3) * math.exp(self._rng.gauss(0.0, STEP_NOISE))
            await asyncio.sleep(took)
            progress.apply(StepEvent(
                step=step, total_steps=a.train.steps, loss=2.0 + 3.5 * math.exp(-step / 300),
                tokens_per_s=tokens / took, rank=a.rank, stage=a.stage, replica=a.replica,
                step_s=took, compute_s=compute_s * took / max(step_s, 1e-3)))
            if step == 1:
                self.on_step(progress)
        progress.state = WorkerState.DONE

    async def stop(self, reason: str) -> None:
        clock, self._clock = self._clock, None
        if clock is None:
            return
        clock.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await clock
        self.progress.state = WorkerState.IDLE

    def request_checkpoint(self, job_id: str, epoch: int, step: int, reason: str) -> bool:
        return False  # no checkpoints: the simulated job runs with --checkpoint-every 0


class SimSession(CoordinatorSession):
    """The real session whose link probes read the world instead of the network."""

    def __init__(self, index: int, world: World, *args: object, time_scale: float = 1.0,
                 **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.index, self.world, self.time_scale = index, world, time_scale
        self.on_welcome: Callable[[], None] = lambda: None
        self.on_assign: Callable[[common_pb2.Assignment], None] = lambda a: None

    def _welcomed(self, welcome: coordinator_pb2.Welcome) -> None:
        super()._welcomed(welcome)
        self.on_welcome()

    def _handle(self, command: coordinator_pb2.Command) -> None:
        if command.WhichOneof("kind") == "assign":
            self.on_assign(command.assign)
        super()._handle(command)

    async def _measure(self, cmd: coordinator_pb2.MeasureLinksCommand) -> None:
        """A latency pass pings every peer at once: here one sleep as long as the slowest
        peer's pings, and the samples made at once, not a task per peer (a swarm of 250
        agents held 250,000 of them, and its own heartbeats waited behind them). Bandwidth
        probes go through the real session, one peer at a time."""
        if cmd.kind != coordinator_pb2.MEASURE_KIND_LATENCY:
            await super()._measure(cmd)
            return
        self.state = WorkerState.MEASURING
        try:
            await asyncio.sleep(max((probe_seconds(cmd.kind, cmd, self._model_rtt_s(p.agent_id))
                                     for p in cmd.peers), default=0.0) * self.time_scale)
            await self.report_links(cmd.round_id,
                                    [self._sample(cmd.kind, p.agent_id) for p in cmd.peers])
        except grpc.aio.AioRpcError as exc:
            log.warning("could not report links (a latency pass): %s",
                        rpc.describe_rpc_error(exc, self.target))
        finally:
            self.state = WorkerState.IDLE

    def _model_rtt_s(self, peer_id: str) -> float:
        other = agent_index(peer_id)
        if other is None or other >= len(self.world):
            return 1.0
        return 2 * self.world.delay_ms(self.index, other) / 1000

    async def _measure_peer(self, cmd: coordinator_pb2.MeasureLinksCommand,
                            peer: coordinator_pb2.PeerTarget) -> common_pb2.LinkSample:
        await asyncio.sleep(probe_seconds(cmd.kind, cmd, self._model_rtt_s(peer.agent_id)) *
                            self.time_scale)
        return self._sample(cmd.kind, peer.agent_id)

    def _sample(self, kind: int, peer_id: str) -> common_pb2.LinkSample:
        """The world's figures for the link to `peer_id`, read as a probe reads them."""
        other = agent_index(peer_id)
        if other is None or other >= len(self.world):
            return common_pb2.LinkSample(peer_id=peer_id, reachable=False,
                                         error="no such peer in the simulated world",
                                         measured_unix_s=time.time())
        sample = common_pb2.LinkSample(peer_id=peer_id, reachable=True,
                                       measured_unix_s=time.time())
        if kind != coordinator_pb2.MEASURE_KIND_BANDWIDTH:
            sample.delay_ms = self.world.delay_ms(self.index, other) * (
                1.0 + 0.02 * random.random())  # pings read high, never low
        if kind != coordinator_pb2.MEASURE_KIND_LATENCY:
            sample.bandwidth_gbps = self.world.bandwidth_gbps(self.index, other) * (
                1.0 + random.gauss(0.0, 0.03))
        return sample
