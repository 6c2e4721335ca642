"""The job state machine: waiting -> measuring -> scheduling -> running -> done/failed.

One job per coordinator. It waits for enough live agents, has them measure their links, runs
the scheduler off the event loop (it is CPU-bound), pushes one assignment per agent, follows
their progress and, when an agent is lost or a worker fails mid-run, stops everyone and goes
round again with a new epoch (recovering), resuming from checkpoints when the job has them.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from coordinator.catalogue import get_preset
from coordinator.config import JobConfig
from coordinator.links import LinkStore
from coordinator.measure import LinkMeasurer
from coordinator.registry import AgentRecord, Registry
from protos.assignment import build_assignments
from protos.dtfm.v1 import common_pb2, coordinator_pb2
from protos.layout import Layout

log = logging.getLogger(__name__)
S = coordinator_pb2  # state constants live in the generated module


def choose_layout(agents: int, n_layers: int, stages: int = 0, replicas: int = 0) -> Layout:
    """stages x replicas for `agents` devices: as given, else as `coordinator plan` picks."""
    from coordinator.plan import pick_shape

    if stages and replicas:
        return Layout(stages, replicas)
    if stages:
        return Layout(stages, agents // stages)
    if replicas:
        return Layout(agents // replicas, replicas)
    return Layout(*pick_shape(agents, max_stages=n_layers))


def _search(delay: np.ndarray, bandwidth: np.ndarray, stages: int, replicas: int,
            dp_gb: float, pp_gb: float, seed: int, seconds: float) -> dict[str, Any]:
    """Runs in a worker process: the scheduler is pure numpy and CPU-bound."""
    from coordinator.scheduler import Network, search_plan

    result = search_plan(Network(delay_ms=delay, bandwidth_gbps=bandwidth), stages=stages,
                         replicas=replicas, dp_gb=dp_gb, pp_gb=pp_gb, seed=seed,
                         seconds=seconds)
    return {"grid": result.grid, "cost": result.cost, "dp_cost": result.dp_cost,
            "pp_cost": result.pp_cost, "seconds": result.seconds}


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
        self.started_unix_s = 0.0

    # --- events from the server ---
    def poke(self) -> None:
        self._wake.set()

    def on_join(self, rec: AgentRecord) -> None:
        self.poke()

    def on_progress(self, rec: AgentRecord, report: coordinator_pb2.ProgressReport) -> None:
        if report.job_id and report.job_id == self.job_id and report.epoch == self.epoch:
            self._progress[rec.agent_id] = report
            if report.worker_state == "failed" and not self._failure:
                self._failure = f"worker on {rec.agent_id} failed: {report.error or 'no reason'}"
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

    def status(self) -> coordinator_pb2.JobStatus:
        reports = list(self._progress.values())
        step = max((r.step for r in reports), default=0)
        with_loss = [r for r in reports if r.step == step and r.loss > 0]
        tps = sum(r.tokens_per_s for r in reports if r.step == step and r.loss > 0)
        return coordinator_pb2.JobStatus(
            job_id=self.job_id, state=self.state, model=self.config.model,
            agents_wanted=self.config.agents, epoch=self.epoch, step=step,
            total_steps=self.config.train.steps,
            loss=with_loss[0].loss if with_loss else 0.0,
            tokens_per_s=tps, message=self.message,
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
        wanted = cfg.agents
        while len(self.registry.alive()) < wanted:
            have = len(self.registry.alive())
            if self.state != S.JOB_STATE_RECOVERING or have:
                self._set(S.JOB_STATE_WAITING if self.state != S.JOB_STATE_RECOVERING
                          else S.JOB_STATE_RECOVERING,
                          f"waiting for agents: {have} of {wanted} alive")
            await self._wait()
        members = self.registry.alive()[:wanted]
        ids = [m.agent_id for m in members]
        if cfg.measure_links and wanted > 1:
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
        layout = choose_layout(wanted, spec.n_layers, cfg.stages, cfg.replicas)
        self._set(S.JOB_STATE_SCHEDULING,
                  f"searching {layout.stages} stages x {layout.replicas} replicas")
        from coordinator.scheduler import comm_gb

        dp_gb, pp_gb = comm_gb(spec, layout.stages, layout.replicas, cfg.train.global_batch,
                               dtype="fp32" if cfg.train.dtype == "fp32" else "fp16")
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            found = await asyncio.get_running_loop().run_in_executor(
                pool, _search, delay, bandwidth, layout.stages, layout.replicas, dp_gb, pp_gb,
                cfg.seed, cfg.search_seconds)
        self.epoch += 1
        self.plan = common_pb2.Plan(
            stages=layout.stages, replicas=layout.replicas,
            grid=[common_pb2.PlanStage(agent_ids=[ids[d] for d in row]) for row in found["grid"]],
            cost=found["cost"], dp_cost=found["dp_cost"], pp_cost=found["pp_cost"],
            seconds=found["seconds"], algorithm="hybrid-ga", epoch=self.epoch,
        )
        by_rank = layout.devices_by_rank(found["grid"])
        records = [members[int(d)] for d in by_rank]
        assignments = build_assignments(
            job_id=self.job_id, epoch=self.epoch, layout=layout, spec=spec, train=cfg.train,
            master_addr=records[0].info.host, master_port=self._rendezvous_port(),
            backend="nccl" if all(r.info.device.kind == "cuda" for r in records) else "gloo",
        )
        self.members = [r.agent_id for r in records]
        self._progress.clear()
        self._failure = ""
        for rec, assignment in zip(records, assignments, strict=True):
            self.registry.send(rec.agent_id, coordinator_pb2.Command(assign=assignment))
        self.started_unix_s = time.time()
        self._set(S.JOB_STATE_RUNNING,
                  f"epoch {self.epoch}: {layout.stages} stages x {layout.replicas} replicas, "
                  f"predicted cost {found['cost']:.3f} s")
        await self._follow()

    def _rendezvous_port(self) -> int:
        return 29500 + (self.epoch % 500) * 2

    async def _follow(self) -> None:
        while True:
            if self._failure:
                failure = self._failure
                await self._stop_members(f"recovering: {failure}")
                self.restarts += 1
                if self.restarts > self.config.max_restarts:
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

    async def _stop_members(self, reason: str) -> None:
        for agent_id in self.members:
            rec = self.registry.get(agent_id)
            if rec is not None and rec.state == S.AGENT_STATE_ALIVE:
                self.registry.send(agent_id, coordinator_pb2.Command(
                    stop=coordinator_pb2.StopCommand(job_id=self.job_id, reason=reason)))

    async def shutdown(self) -> None:
        if self.state == S.JOB_STATE_RUNNING:
            await self._stop_members("coordinator shutting down")
