"""The job state machine: waiting -> measuring -> scheduling -> running -> done/failed.

One job per coordinator. It waits for enough live agents, has them measure their links, runs
the scheduler off the event loop (it is CPU-bound), pushes one assignment per agent, follows
their progress and, when an agent is lost or a worker fails mid-run, stops everyone and goes
round again with a new epoch (recovering), resuming from checkpoints when the job has them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import secrets
import statistics
import time
import uuid
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator.config import JobConfig
from coordinator.linkstore import LinkStore
from coordinator.measure import LinkMeasurer
from coordinator.placement import Placement, address_key, fixed_grid, score
from coordinator.registry import AgentRecord, Registry
from coordinator.scheduler import Network
from coordinator.scheduler.compute import (
    Devices,
    Workload,
    even_is_enough,
    plan_split,
    tasklet_seconds,
)
from coordinator.scheduler.memory import DoesNotFit, check_fit, stages_bytes
from coordinator.scheduler.steptime import StepShape, StepTime, simulate_step
from dtfm.core.assignment import build_assignments
from dtfm.core.layout import Layout, layer_splits
from dtfm.core.presets import get_preset
from dtfm.core.shape import choose_layout
from protos.dtfm.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)
S = coordinator_pb2  # state constants live in the generated module


def _search(delay: np.ndarray, bandwidth: np.ndarray, stages: int, replicas: int,
            dp_gb: float, pp_gb: float, seed: int, seconds: float) -> dict[str, Any]:
    """Runs in a worker process: the scheduler is pure numpy and CPU-bound."""
    from coordinator.scheduler import Network, search_plan

    result = search_plan(Network(delay_ms=delay, bandwidth_gbps=bandwidth), stages=stages,
                         replicas=replicas, dp_gb=dp_gb, pp_gb=pp_gb, seed=seed,
                         seconds=seconds)
    return {"grid": result.grid, "cost": result.cost, "dp_cost": result.dp_cost,
            "pp_cost": result.pp_cost, "seconds": result.seconds}


def _split(delay: np.ndarray, bandwidth: np.ndarray, grid: list[list[int]], work: Workload,
           dev: Devices, move: bool, seconds: float) -> tuple[list[list[int]], list[int], str]:
    """Runs in a worker process: the grid and layer split for the devices' speed and memory."""
    placed = plan_split(Network(delay_ms=delay, bandwidth_gbps=bandwidth), grid, work, dev,
                        move=move, seconds=seconds)
    return placed.best.grid, placed.best.splits, placed.reason


def agent_flops(records: list[AgentRecord], dtype: str) -> list[float]:
    """Each agent's FLOP/s in the training dtype (0: unknown)."""
    return [r.info.device.flops_bf16 if dtype == "bf16" and r.info.device.flops_bf16 > 0
            else r.info.device.flops for r in records]


def device_figures(records: list[AgentRecord], dtype: str) -> Devices:
    """Each agent's FLOP/s in the training dtype and its memory free for training."""
    memory = [min(r.info.device.free_memory_bytes or r.info.device.memory_bytes, 2**62)
              for r in records]  # uint64 on the wire; 4 EiB is plenty
    return Devices.of(agent_flops(records, dtype), memory)


STEP_WINDOW = 5  # measured step time: the median over the members' last steps


@dataclass
class _Prediction:
    """The running plan's step-time model, refined as workers report their compute.

    Before the first steps, compute is estimated from each agent's measured FLOP/s and its
    stage's layers (the plan's split); once a member has reported steps, its own median
    compute time replaces the estimate."""

    net: Network
    grid: list[list[int]]  # stage x replica -> index into `agents`
    work: Workload
    splits: list[int]
    agents: list[str]
    flops: list[float]  # 0: unknown (no compute estimated)
    _comm: StepTime | None = field(default=None, repr=False)

    @property
    def shape(self) -> StepShape:
        return self.work.step_shape(self.splits)

    @property
    def comm_s(self) -> float:
        if self._comm is None:
            self._comm = simulate_step(self.net, self.grid, self.shape)
        return self._comm.step_s

    def predict(self, compute_per_step: dict[str, float]) -> StepTime:
        """`compute_per_step[agent]`: its measured compute seconds per step, where known."""
        m = self.work.micro_batches
        known = [f if f > 0 else math.inf for f in self.flops]  # unknown speed: no estimate
        estimate = tasklet_seconds(self.work, self.grid, known, self.splits)
        compute = [[compute_per_step[self.agents[d]] / m if self.agents[d] in compute_per_step
                    else float(estimate[j, k]) for k, d in enumerate(row)]
                   for j, row in enumerate(self.grid)]
        return simulate_step(self.net, self.grid, self.shape, compute)


class Job:
    def __init__(self, config: JobConfig, registry: Registry, measurer: LinkMeasurer,
                 links: LinkStore) -> None:
        self.config = config
        self.registry = registry
        self.measurer = measurer
        self.links = links
        self.state = S.JOB_STATE_WAITING if config.model else S.JOB_STATE_IDLE
        self.job_id = f"job-{uuid.uuid4().hex[:8]}" if config.model else ""
        self.epoch = 0
        self.plan: common_pb2.Plan | None = None
        self.message = "" if config.model else "no job: start with --model and --agents"
        self.members: list[str] = []
        self.restarts = 0
        self._wake = asyncio.Event()
        self._progress: dict[str, coordinator_pb2.ProgressReport] = {}
        self._failure: str = ""
        self._failure_kind: str = ""
        self._last_epoch_failure: tuple[str, int] = ("", 0)  # (kind, steps done) of the last
        self._steps: dict[str, deque[coordinator_pb2.ProgressReport]] = {}
        self._model: _Prediction | None = None
        self._trained_splits: list[int] | None = None  # the split checkpoints hold
        self._port_epoch, self._port = -1, 0
        self.started_unix_s = 0.0

    # --- events from the server ---
    def poke(self) -> None:
        self._wake.set()

    def on_join(self, rec: AgentRecord) -> None:
        self.poke()

    def on_progress(self, rec: AgentRecord, report: coordinator_pb2.ProgressReport) -> None:
        """Take a member's report for this epoch; `rec` is the agent its secret proved, so
        no one else's report can mark a member done or fail the job."""
        if (report.job_id and report.job_id == self.job_id and report.epoch == self.epoch
                and rec.agent_id in self.members):
            self._progress[rec.agent_id] = report
            steps = self._steps.setdefault(rec.agent_id, deque(maxlen=STEP_WINDOW))
            if report.step >= 2 and report.step_s > 0 and (
                    not steps or steps[-1].step != report.step):
                steps.append(report)  # step 1 carries warm-up; later ones are steady
            if report.worker_state == "failed" and not self._failure:
                self._failure = f"worker on {rec.agent_id} failed: {report.error or 'no reason'}"
                self._failure_kind = report.error_kind or "internal"
            self.poke()

    def on_lost(self, lost: list[AgentRecord]) -> None:
        if self.state == S.JOB_STATE_RUNNING:
            ids = [r.agent_id for r in lost if r.agent_id in self.members]
            if ids and not self._failure:
                self._failure = f"lost agent(s) {', '.join(ids)}"
        self.poke()

    def busy_training(self) -> bool:
        return self.state in (S.JOB_STATE_RUNNING, S.JOB_STATE_SCHEDULING,
                              S.JOB_STATE_MEASURING)

    def measured_step_s(self) -> float:
        """Median step time over the members' last few steady steps (0 before any)."""
        times = [r.step_s for steps in self._steps.values() for r in steps]
        return statistics.median(times) if times else 0.0

    def _refresh_prediction(self) -> None:
        """Replace estimated compute by what members measured, once they have."""
        if self._model is None or self.plan is None:
            return
        measured = {a: statistics.median(r.compute_s for r in steps)
                    for a, steps in self._steps.items() if steps and a in self.members}
        predicted = self._model.predict(measured)
        self.plan.predicted_step_s = predicted.step_s
        self.plan.predicted_compute_s = predicted.compute_s

    def status(self) -> coordinator_pb2.JobStatus:
        reports = list(self._progress.values())
        step = max((r.step for r in reports), default=0)
        with_loss = [r for r in reports if r.step == step and r.loss > 0]
        self._refresh_prediction()
        measured = self.measured_step_s()
        tokens = self.config.train.global_batch * get_preset(self.config.model).seq_len \
            if self.config.model else 0
        return coordinator_pb2.JobStatus(
            job_id=self.job_id, state=self.state, model=self.config.model,
            agents_wanted=self.config.agents, epoch=self.epoch, step=step,
            total_steps=self.config.train.steps,
            loss=with_loss[0].loss if with_loss else 0.0,
            tokens_per_s=tokens / measured if measured else 0.0, message=self.message,
            placement=self.plan.placement if self.plan else "",
            predicted_step_s=self.plan.predicted_step_s if self.plan else 0.0,
            measured_step_s=measured,
        )

    # --- the machine ---
    def _set(self, state: int, message: str) -> None:
        self.state = state
        self.message = message
        log.info("job %s: %s — %s", self.job_id,
                 coordinator_pb2.JobState.Name(state).removeprefix("JOB_STATE_").lower(),
                 message)

    async def _wait(self, timeout: float = 1.0) -> None:
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            pass

    async def run(self) -> None:
        if not self.config.model:
            return
        while self.state not in (S.JOB_STATE_DONE, S.JOB_STATE_FAILED):
            await self._run_epoch()

    async def _run_epoch(self) -> None:
        cfg = self.config
        spec = get_preset(cfg.model)
        placement = cfg.parsed_placement()
        members = await self._gather(placement)
        wanted = len(members)
        ids = [m.agent_id for m in members]
        if cfg.links_file:
            try:
                delay, bandwidth = self._known_links(ids)
            except ValueError as exc:
                self._set(S.JOB_STATE_FAILED, str(exc))
                return
        elif cfg.measure_links and wanted > 1:
            self._set(S.JOB_STATE_MEASURING, f"measuring {wanted * (wanted - 1)} links")
            matrix = await self.measurer.measure(members)
            bad = self.links.unreachable_agents(ids)
            if bad:
                self._set(S.JOB_STATE_WAITING,
                          f"leaving out unreachable agent(s) {', '.join(bad)}; waiting for others")
                for agent_id in bad:
                    rec = self.registry.get(agent_id)
                    if rec is not None:
                        rec.state = S.AGENT_STATE_LOST
                return
            delay = np.array(matrix.delay_ms, dtype=float).reshape(wanted, wanted)
            bandwidth = np.array(matrix.bandwidth_gbps, dtype=float).reshape(wanted, wanted)
        else:
            delay = np.ones((wanted, wanted))
            bandwidth = np.ones((wanted, wanted))
        np.fill_diagonal(delay, 0.0)
        np.fill_diagonal(bandwidth, 1.0)
        net = Network(delay_ms=delay, bandwidth_gbps=bandwidth)
        layout = choose_layout(wanted, spec.n_layers, cfg.stages, cfg.replicas)
        self._set(S.JOB_STATE_SCHEDULING, f"placing {layout.stages} stages x "
                  f"{layout.replicas} replicas ({placement.label})")
        work = Workload(spec, layout.stages, layout.replicas, cfg.train.global_batch,
                        cfg.train.micro_batches, cfg.train.schedule, cfg.train.dtype,
                        act_dtype=cfg.train.dtype,  # the worker sends activations in it
                        dp_mode=cfg.train.dp_mode)
        try:
            found = await self._place(placement, net, layout, ids, work,
                                      device_figures(members, cfg.train.dtype))
        except DoesNotFit as exc:
            self._set(S.JOB_STATE_FAILED, f"{cfg.model} on {layout.stages} stages x "
                      f"{layout.replicas} replicas does not fit: {exc}")
            return
        except ValueError as exc:
            self._set(S.JOB_STATE_FAILED, f"placement {placement.label}: {exc}")
            return
        self.epoch += 1
        if self.config.train.checkpoint_dir:
            self._trained_splits = list(found["splits"])
        by_rank = layout.devices_by_rank(found["grid"])
        records = [members[int(d)] for d in by_rank]
        self._model = _Prediction(net=net, grid=found["grid"], work=work,
                                  splits=found["splits"], agents=ids,
                                  flops=agent_flops(members, cfg.train.dtype))
        predicted = self._model.predict({})
        self.plan = common_pb2.Plan(
            stages=layout.stages, replicas=layout.replicas,
            grid=[common_pb2.PlanStage(agent_ids=[ids[d] for d in row]) for row in found["grid"]],
            cost=found["cost"], dp_cost=found["dp_cost"], pp_cost=found["pp_cost"],
            seconds=found["seconds"], algorithm=found["algorithm"], epoch=self.epoch,
            placement=placement.label, predicted_step_s=predicted.step_s,
            predicted_comm_s=self._model.comm_s, predicted_compute_s=predicted.compute_s,
            layer_splits=found["splits"],
        )
        assignments = build_assignments(
            job_id=self.job_id, epoch=self.epoch, layout=layout, spec=spec, train=cfg.train,
            master_addr=records[0].info.host, master_port=self._rendezvous_port(),
            backend="nccl" if all(r.info.device.kind == "cuda" for r in records) else "gloo",
            bind_addrs=[r.info.host for r in records], splits=found["splits"],
        )
        self.members = [r.agent_id for r in records]
        self._progress.clear()
        self._steps.clear()
        self._failure, self._failure_kind = "", ""
        for rec, assignment in zip(records, assignments, strict=True):
            self.registry.send(rec.agent_id, coordinator_pb2.Command(assign=assignment))
        self.started_unix_s = time.time()
        self._set(S.JOB_STATE_RUNNING,
                  f"epoch {self.epoch}: {layout.stages} stages x {layout.replicas} replicas, "
                  f"{placement.label} placement, layers {found['split_note']}, predicted "
                  f"cost {found['cost']:.3f} s, predicted step {predicted.step_s:.2f} s")
        await self._follow()

    def _known_links(self, ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The members' rows of the `--links` file (read again: it may have been refreshed)."""
        from coordinator.linkstore import load_links_file

        obj = load_links_file(self.config.links_file)
        index = {a: i for i, a in enumerate(obj["agents"])}
        missing = [a for a in ids if a not in index]
        if missing:
            raise ValueError(f"--links {self.config.links_file} has no row for agent(s) "
                             f"{', '.join(missing)}: measure them with `coordinator links "
                             f"--measure --json`")
        rows = [index[a] for a in ids]
        pick = np.ix_(rows, rows)
        return (np.array(obj["delay_ms"], dtype=float)[pick],
                np.array(obj["bandwidth_gbps"], dtype=float)[pick])

    async def _gather(self, placement: Placement) -> list[AgentRecord]:
        """Wait for the agents the job needs: the pinned plan's, or any `--agents` live ones.

        Members are in address order, the order a network-blind launcher would use."""
        wanted = self.config.agents
        pinned = placement.pinned.agents if placement.pinned is not None else []
        while True:
            alive = self.registry.alive()
            if pinned:
                by_id = {a.agent_id: a for a in alive}
                missing = [a for a in pinned if a not in by_id]
                if not missing:
                    return [by_id[a] for a in pinned]
                what = f"the pinned plan's agents: {len(missing)} of {wanted} not alive " \
                       f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
            else:
                if len(alive) >= wanted:
                    return sorted(alive, key=lambda a: address_key(a.info.host,
                                                                   a.info.port))[:wanted]
                what = f"agents: {len(alive)} of {wanted} alive"
            if self.state != S.JOB_STATE_RECOVERING or alive:
                self._set(S.JOB_STATE_RECOVERING if self.state == S.JOB_STATE_RECOVERING
                          else S.JOB_STATE_WAITING, f"waiting for {what}")
            await self._wait()

    async def _place(self, placement: Placement, net: Network, layout: Layout,
                     ids: list[str], work: Workload, dev: Devices) -> dict[str, Any]:
        """The grid (searched or fixed), its layer split, and the paper's cost of the grid.

        Raises `DoesNotFit` when some member cannot hold its stage under that split."""
        cfg = self.config
        from coordinator.scheduler import comm_gb

        dp_gb, pp_gb = comm_gb(work.spec, layout.stages, layout.replicas,
                               cfg.train.global_batch,
                               dtype="fp32" if cfg.train.dtype == "fp32" else "fp16")
        grid = fixed_grid(placement, layout.stages, layout.replicas, ids)
        if grid is None:
            found = {**await self._in_pool(_search, net.delay_ms, net.bandwidth_gbps,
                                           layout.stages, layout.replicas, dp_gb, pp_gb,
                                           cfg.seed, cfg.search_seconds),
                     "algorithm": "hybrid-ga"}
        else:
            found = {"grid": grid, "seconds": 0.0, "algorithm": placement.kind}
        found["grid"], found["splits"], why = await self._choose_split(
            net, found["grid"], work, dev, move=grid is None)
        found["split_note"] = f"{','.join(map(str, found['splits']))} ({why})"
        check_fit(found["grid"], stages_bytes(work.memory(), found["splits"]), dev.memory,
                  names=ids)
        return {**found, **score(net, found["grid"], dp_gb, pp_gb)}

    async def _choose_split(self, net: Network, grid: list[list[int]], work: Workload,
                            dev: Devices, move: bool) -> tuple[list[list[int]], list[int], str]:
        """`--layer-split`: as given, even, or chosen for speed and memory (auto)."""
        cfg, n = self.config, work.spec.n_layers
        if cfg.layer_split != "auto":
            return grid, layer_splits(n, work.stages, cfg.parsed_split()), cfg.layer_split
        kept = self._trained_splits
        if kept is not None and len(kept) == work.stages:
            # checkpoints hold these layer ranges: a new split could not resume from them
            return grid, list(kept), f"kept from epoch {self.epoch}: checkpoints hold it"
        if even_is_enough(grid, work, dev):
            return grid, layer_splits(n, work.stages), "even: the devices are alike"
        return await self._in_pool(_split, net.delay_ms, net.bandwidth_gbps, grid, work, dev,
                                   move, cfg.search_seconds)

    @staticmethod
    async def _in_pool(fn: Any, *args: Any) -> Any:
        """Run a CPU-bound scheduler call in a spawned process (a fork of grpc is unsafe)."""
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def _rendezvous_port(self) -> int:
        """Rank 0's store port for this epoch: drawn per epoch from 29500-30498 (even ports;
        the store's neighbour is left free), so a stranger cannot know it in advance; the
        assignment carries it."""
        if self._port_epoch != self.epoch:
            self._port_epoch, self._port = self.epoch, 29500 + 2 * secrets.randbelow(500)
        return self._port

    async def _follow(self) -> None:
        while True:
            if self._failure:
                failure = self._failure
                await self._stop_members(f"recovering: {failure}")
                self.restarts += 1
                permanent = self._permanent(failure)
                if permanent:
                    self._set(S.JOB_STATE_FAILED, permanent)
                elif self.restarts > self.config.max_restarts:
                    self._set(S.JOB_STATE_FAILED,
                              f"{failure}; gave up after {self.config.max_restarts} restarts")
                else:
                    self._set(S.JOB_STATE_RECOVERING,
                              f"{failure}; rescheduling (restart {self.restarts} of "
                              f"{self.config.max_restarts})")
                return
            done = [a for a in self.members
                    if (p := self._progress.get(a)) is not None and p.worker_state == "done"]
            if len(done) == len(self.members):
                self._set(S.JOB_STATE_DONE, f"trained {self.config.train.steps} steps")
                return
            await self._wait()

    def _permanent(self, failure: str) -> str:
        """Why `failure` will repeat the same way on every retry ('' when a retry may help).

        A rejected assignment or configuration fails identically every time; workers that
        cannot join their world in two epochs running, without training a step in either,
        point at addresses or ports that a retry will not fix (a lost agent would have been
        reported as lost instead)."""
        kind = self._failure_kind
        steps = max((r.step for r in self._progress.values()), default=0)
        last, self._last_epoch_failure = self._last_epoch_failure, (kind, steps)
        if kind == "config":
            return (f"{failure} (the job's configuration is invalid and would fail the same "
                    f"way again: fix it and restart the coordinator)")
        if kind == "rendezvous" and steps == 0 and last == ("rendezvous", 0):
            return (f"{failure} (workers could not join their world twice in a row: check that "
                    f"every agent's --advertise address is reachable from the others, that TCP "
                    f"ports 29500-30499 are open between them, or set the "
                    f"agents' --bind-interface)")
        return ""

    async def _stop_members(self, reason: str) -> None:
        for agent_id in self.members:
            rec = self.registry.get(agent_id)
            if rec is not None and rec.state == S.AGENT_STATE_ALIVE:
                self.registry.send(agent_id, coordinator_pb2.Command(
                    stop=coordinator_pb2.StopCommand(job_id=self.job_id, reason=reason)))

    async def shutdown(self) -> None:
        if self.state == S.JOB_STATE_RUNNING:
            await self._stop_members("coordinator shutting down")
