"""Many simulated agents in one asyncio process, driven over stdin and reporting on stdout.

A driver (bench/scale.py, the scale test) starts a few swarm processes, each holding a slice
of the world's agents, and reads one JSON line per event from each: `welcome` (an agent
joined or re-joined), `assign` (an assignment arrived) and `train` (its first step of an
epoch). On stdin it may say `kill I J ...` (those agents vanish at once, as a crashed
machine would: no goodbye, so the coordinator must notice their silence) and `quit`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import sys
import time
from dataclasses import dataclass

import grpc

from agent.sim.agent import SimSession, SimSupervisor, agent_id
from agent.sim.world import MEMORY_BYTES, World
from dtfm import rpc
from protos.dtfm.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)
FIRST_PORT = 20000  # simulated agents advertise 127.0.0.1:FIRST_PORT+index (nobody dials it)


@dataclass(frozen=True)
class SwarmConfig:
    coordinator: str
    security: rpc.Security
    world_seed: int
    world_agents: int  # the world's size; this swarm holds [first, first + count)
    first: int
    count: int
    time_scale: float = 1.0  # probe and start-up times times this (tests: short)


def agent_info(index: int, world: World) -> common_pb2.AgentInfo:
    """What simulated agent `index` says of itself: a CPU device of its site's speed, an
    address nobody dials (it says it is reachable, so the coordinator does not check)."""
    return common_pb2.AgentInfo(
        agent_id=agent_id(index), host="127.0.0.1", port=FIRST_PORT + index,
        device=common_pb2.DeviceInfo(kind="cpu", name="simulated", memory_bytes=MEMORY_BYTES,
                                     flops=world.flops(index), cores=8),
        version="sim", reachable=common_pb2.REACH_OVERRIDE_YES)


def emit(event: str, index: int, **fields: object) -> None:
    print(json.dumps({"ev": event, "i": index, "t": time.time(), **fields}), flush=True)


class PlanPace:
    """The predicted step of each epoch, read once per epoch from the coordinator's plan."""

    def __init__(self, config: SwarmConfig) -> None:
        self._channel = rpc.open_channel(config.coordinator, config.security)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._epochs: dict[tuple[str, int], asyncio.Future[tuple[float, float]]] = {}

    async def __call__(self, a: common_pb2.Assignment) -> tuple[float, float]:
        key = (a.job_id, a.epoch)
        if key not in self._epochs:
            self._epochs[key] = asyncio.ensure_future(self._read(a.epoch))
        return await asyncio.shield(self._epochs[key])

    async def _read(self, epoch: int) -> tuple[float, float]:
        for _ in range(30):
            with contextlib.suppress(grpc.aio.AioRpcError):
                plan = await self._stub.GetPlan(coordinator_pb2.PlanRequest(), timeout=10.0)
                if plan.epoch == epoch and plan.predicted_step_s > 0:
                    return plan.predicted_step_s, plan.predicted_compute_s
            await asyncio.sleep(1.0)
        return 1.0, 0.5  # no plan said: a second a step

    async def close(self) -> None:
        await self._channel.close()


async def run_swarm(config: SwarmConfig) -> None:
    world = World.draw(config.world_seed, config.world_agents)
    pace = PlanPace(config)
    tasks: dict[int, asyncio.Task[None]] = {}
    for index in range(config.first, config.first + config.count):
        rng = random.Random(config.world_seed * 1_000_003 + index)
        supervisor = SimSupervisor(pace, rng, config.time_scale)
        session = SimSession(index, world, agent_info(index, world), config.coordinator,
                             config.security, supervisor, time_scale=config.time_scale)
        session.on_welcome = lambda i=index: emit("welcome", i)
        session.on_assign = lambda a, i=index: emit("assign", i, epoch=a.epoch)
        supervisor.on_step = lambda p, i=index: emit("train", i, epoch=p.epoch)
        tasks[index] = asyncio.create_task(session.run())
    await _commands(tasks)
    for task in tasks.values():
        task.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    await pace.close()


async def _commands(tasks: dict[int, asyncio.Task[None]]) -> None:
    """Follow stdin until `quit` or its end."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := (await reader.readline()).decode().split():
        if line[0] == "quit":
            return
        if line[0] == "kill":
            for index in map(int, line[1:]):
                if (task := tasks.get(index)) is not None:
                    task.cancel()
                    emit("killed", index)



