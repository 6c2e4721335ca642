"""The job state machine: waiting -> measuring -> scheduling -> running -> done/failed.

One job per coordinator. It waits for enough live agents, has them measure their links, runs
the scheduler off the event loop (it is CPU-bound), pushes one assignment per agent, follows
their progress and, when an agent is lost or a worker fails mid-run, stops everyone and goes
round again with a new epoch (recovering), resuming from checkpoints when the job has them.

`Job` keeps the states and the transitions between them, the members' progress, and the
state directory's snapshot; it delegates the rest, each to a collaborator beside it in
`coordinator/job/`:

- `membership.Membership`: which live agents it may use, spares, hold-outs, growing back;
- `epochplan.EpochPlanner`: an epoch's layout, grid (the search), layer split and H;
- `epochlinks.EpochLinkSource`: the links an epoch plans on (the file, the store, a
  measurement), and dead links planned around;
- `checkpoints.CheckpointTracker`: the newest checkpoint every member holds, and its split;
- `replan.Replanner`: the drift watch and re-planning while the job trains (it asks the job
  for what it needs through `replan.ReplanHost`, which `Job` implements);
- `recovery.Recoveries`: the record of each recovery, shown by status;
- `jobsnapshot`: what the state directory keeps of the job, and putting it back;
- `failedpairs.FailedPairs`: pairs whose connection failed, relayed or placed apart next time;
- `dataplane.DataPlanes`: each epoch's backend and peer table, and the relay;
- `integrity.exclusion.JobIntegrity`: the evidence ledger, the agents a confirmed fault
  excluded (lost to the job as a silent agent is) and the rollback bound of the next epoch;
- `jobstatus`: the `JobStatus` answer read off all of them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence

import numpy as np

from coordinator.daemon.config import JobConfig
from coordinator.daemon.jobstore import JobSnapshot, JobStore
from coordinator.daemon.reconcile import (
    adopt_deadline,
    adopted_silence,
    shutdown_note,
    stale_snapshot,
)
from coordinator.daemon.registry import AgentRecord, Registry
from coordinator.integrity.dispute import separate, swaps_part, unsettled
from coordinator.integrity.exclusion import JobIntegrity
from coordinator.job import failedpairs, jobsnapshot, jobstatus, rootcause
from coordinator.job.checkpoints import CheckpointTracker
from coordinator.job.dataplane import DataPlanes
from coordinator.job.epochlinks import EpochLinkSource, NoLinks, avoid_dead_links
from coordinator.job.epochplan import EpochPlanner, with_sync
from coordinator.job.jobsnapshot import STATE_NAMES, job_fingerprint
from coordinator.job.membership import Membership
from coordinator.job.prediction import Prediction, agent_flops, device_figures
from coordinator.job.recovery import Recoveries, layout_text, out_of_restarts, permanent_failure
from coordinator.job.replan import Replanner
from coordinator.links import failure as linkfailure
from coordinator.links.measure import LinkMeasurer
from coordinator.links.reachability import ReachChecker
from coordinator.links.store import LinkStore
from coordinator.scheduler import Network
from coordinator.scheduler.compression import Compression
from coordinator.scheduler.compute import Workload
from coordinator.scheduler.memory import DoesNotFit
from coordinator.scheduler.placement import Placement
from dtfm.core.assignment import build_assignments
from dtfm.core.spec import SYNC_AUTO
from dtfm.core.verify import Verify
from dtfm.core.verify import resolve as resolve_verify
from dtfm.core.workerstate import WorkerState
from protos.dtfm.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)
S = coordinator_pb2  # state constants live in the generated module
INTERNAL_RETRY_S = 5.0  # before an epoch that hit a coordinator error is planned again
STEP_WINDOW = 5  # measured step time: the median over the members' last steps
# Every join and heartbeat pokes the job; its loops (each pass O(agents)) run at most this
# often, or a thousand agents' joins and heartbeats cost O(N^2) a second: bench/scale.py's
# coordinator answered heartbeats too late and marked every agent lost.
FOLLOW_EVERY_S = 0.1


class Job:
    def __init__(self, config: JobConfig, registry: Registry, measurer: LinkMeasurer,
                 links: LinkStore, store: JobStore | None = None,
                 reach: ReachChecker | None = None, job_id: str = "") -> None:
        self.config = config
        self.registry = registry
        self.measurer = measurer
        self.links = links
        self.state = S.JOB_STATE_WAITING if config.model else S.JOB_STATE_IDLE
        self.job_id = job_id or (f"job-{uuid.uuid4().hex[:8]}" if config.model else "")
        self.epoch = 0
        self.plan: common_pb2.Plan | None = None
        self.message = "" if config.model else "no job: `coordinator submit --model ...` queues one"
        self.members: list[str] = []
        # `members` as a set, for the list it was made of: each report asks "a member?"
        self._member_set: tuple[list[str], frozenset[str]] = (self.members, frozenset())
        self.restarts = 0
        self._wake = asyncio.Event()
        self._waited = 0.0  # when `_wait` last returned (monotonic)
        self._progress: dict[str, coordinator_pb2.ProgressReport] = {}
        self._failure: str = ""
        self._failure_kind: str = ""
        self._failure_at = 0.0  # when this epoch's first failure arrived (rootcause.hold_s)
        self._last_epoch_failure: tuple[str, int] = ("", 0)  # (kind, steps done) of the last
        self._steps: dict[str, deque[coordinator_pb2.ProgressReport]] = {}
        self.started_unix_s = 0.0
        # when a recovery began (by the registry's clock: agents that have not heartbeated
        # since may be dead and are not planned on)
        self._settle_after = -math.inf
        self._adopt_deadline = 0.0
        self._first_steps: dict[str, int] = {}  # each member's first step this epoch
        self.checkpoints = CheckpointTracker(config)  # what the checkpoints hold
        self.dataplane = DataPlanes(config.transport, config.hole_punch, config.frames)
        self.planner = EpochPlanner(config, self.checkpoints,  # layout, grid, split, H
                                    self.dataplane.router(registry, links))  # relay routes
        self.membership = Membership(config, registry, measurer, links, reach)  # usable agents
        self.integrity = JobIntegrity(registry, self.checkpoints)  # evidence, exclusions
        self.integrity.checkpoint_every = config.train.checkpoint_every
        self._name_collaborators()
        self.link_source = EpochLinkSource(config, measurer, links, self.planner, self.membership)
        self.recoveries = Recoveries()
        self.failed_pairs = failedpairs.FailedPairs()  # what recoveries learnt of pairs
        self.replan = Replanner(self)  # drift watch and re-planning while training
        self.store = store
        self.integrity.ledger.on_change = self.persist
        if store is not None and config.model:
            self._adopt(store.unfinished_job(job_id) if job_id
                        else store.unfinished(job_fingerprint(config)))

    def _name_collaborators(self) -> None:
        """The collaborators name the job in what they log."""
        self.checkpoints.job_id = self.planner.job_id = self.membership.job_id = self.job_id
        self.integrity.job_id = self.job_id

    @property
    def checkpoint_step(self) -> int:
        """The newest step every member has passed a checkpoint at."""
        return self.checkpoints.step

    # --- what the re-planner asks of the job (`replan.ReplanHost`) ---
    def last_step(self) -> int:
        return max((r.step for r in self._progress.values()), default=self.checkpoint_step)

    def spares(self) -> list[AgentRecord]:
        """Live agents outside the job that a recovery or a grow-back could use."""
        return self.membership.spares(self.members)

    def recent_steps(self) -> Mapping[str, Sequence[coordinator_pb2.ProgressReport]]:
        """Each member's last few steady steps' reports."""
        return self._steps

    def progress(self) -> Mapping[str, coordinator_pb2.ProgressReport]:
        """Each member's newest report this epoch."""
        return self._progress

    # --- the coordinator's state directory ---
    def _adopt(self, snap: JobSnapshot | None) -> None:
        """Continue a job a previous coordinator process drove: same id (the agents'
        checkpoints are keyed by it), epoch, plan and recoveries."""
        if snap is None:
            return
        self.job_id, self.epoch, self.restarts = snap.job_id, snap.epoch, snap.restarts
        self._name_collaborators()
        self.dataplane.adopted(self.job_id, self.epoch)
        jobsnapshot.restore(self, snap)
        if snap.state == "running" and snap.members:
            jobsnapshot.resume_running(self, snap)
            self._adopt_deadline = adopt_deadline()
        log.info("job %s: adopted from the state directory after a coordinator restart "
                 "(epoch %d, %s, newest checkpoint step %d)", self.job_id, self.epoch,
                 snap.state, self.checkpoint_step)

    def persist(self, finished: bool = False) -> None:
        if self.store is None or not self.config.model:
            return
        snap = jobsnapshot.snapshot(self)
        try:
            self.store.save(snap, finished=finished)
        except Exception as exc:  # a full disk must not stop training; say so loudly
            log.error("job %s: could not save its state in %s: %s", self.job_id,
                      self.store.path, exc)

    # --- events from the server ---
    def poke(self) -> None:
        self._wake.set()

    def on_join(self, rec: AgentRecord) -> None:
        # a re-join may come with a corrected --advertise: measure it again
        self.membership.rejoined(rec.agent_id)
        self.poke()

    def on_progress(self, rec: AgentRecord, report: coordinator_pb2.ProgressReport) -> None:
        """Take a member's report for this epoch; `rec` is the agent its secret proved, so
        no one else's report can mark a member done or fail the job."""
        if self._adopt_deadline and (stale := stale_snapshot(self.job_id, self.epoch, report)):
            log.warning("job %s: %s", self.job_id, stale)
            self.epoch, self._adopt_deadline = report.epoch, 0.0  # the next epoch is newer
            self.dataplane.adopted(self.job_id, self.epoch)
            self.members = list(dict.fromkeys([*self.members, rec.agent_id]))  # to stop
            self._failure, self._failure_kind = stale, "stale"
            self.poke()
        if self._member_set[0] is not self.members:  # a new epoch's (members is replaced)
            self._member_set = (self.members, frozenset(self.members))
        if (report.job_id and report.job_id == self.job_id and report.epoch == self.epoch
                and rec.agent_id in self._member_set[1]):
            self._progress[rec.agent_id] = report
            self.dataplane.observe(rec.agent_id, report)
            if report.step > 0:
                self._first_steps.setdefault(rec.agent_id, report.step)
            if report.step > 0 and self.recoveries.pending and self.state == S.JOB_STATE_RUNNING:
                self.recoveries.trained(report.resumed_step + 1
                                        if report.HasField("resumed_step") else report.step)
                self.persist()
            steps = self._steps.setdefault(rec.agent_id, deque(maxlen=STEP_WINDOW))
            if report.step >= 2 and report.step_s > 0 and (
                    not steps or steps[-1].step != report.step):
                steps.append(report)  # step 1 carries warm-up; later ones are steady
                self.replan.observe(rec.agent_id, report)
            failed = WorkerState.from_wire(report.worker_state) is WorkerState.FAILED
            why, kind = (rootcause.worker_failure(
                rec.agent_id, report, self.members, self.registry,
                lambda culprit, why: self.integrity.ledger.record(
                    culprit, "tampered_frame", report.step, why, reporter=rec.agent_id))
                if failed else ("", ""))
            if failed and (not self._failure or rootcause.outranks(kind, self._failure_kind)):
                self._failure_at = self._failure_at if self._failure else time.monotonic()
                self._failure, self._failure_kind = why, kind
            self.poke()

    def on_lost(self, lost: list[AgentRecord]) -> None:
        ids = rootcause.lost_members(lost, self.members)  # an excluded one says why
        if ids and self.state == S.JOB_STATE_RUNNING and (
                not self._failure or rootcause.outranks(rootcause.LOST, self._failure_kind)):
            self._failure = rootcause.lost_reason(ids, self._failure)
            self._failure_kind = rootcause.LOST
        elif ids and self.state == S.JOB_STATE_RECOVERING:  # the errors it caused came first
            self.recoveries.explain(rootcause.lost_reason(ids, self._failure))
            self.failed_pairs.forget(len(self.recoveries.items))
            self.dataplane.relay_only = self.failed_pairs.relay_only()
        self.poke()

    def checkpoint_floor(self) -> int:
        """The oldest checkpoint step every agent must keep (0: no floor, `write_floor`;
        `CheckpointTracker.floor` says why)."""
        reports = [self._progress.get(a) for a in self.members]
        return self.integrity.keep_floor(self.checkpoints.floor(  # and the known-good one
            self.state == S.JOB_STATE_RUNNING, self.planner.train, self.planner.layout,
            self.planner.grid_ids, self._progress),
            [(r.step, r.integrity_through) if r is not None else None for r in reports])

    def busy_training(self) -> bool:
        return self.state in (S.JOB_STATE_RUNNING, S.JOB_STATE_SCHEDULING, S.JOB_STATE_MEASURING)

    def measured_step_s(self) -> float:
        """Median step time over the members' last few steady steps (0 before any)."""
        times = [r.step_s for steps in self._steps.values() for r in steps]
        return statistics.median(times) if times else 0.0

    def status(self) -> coordinator_pb2.JobStatus:
        return jobstatus.job_status(self)

    # --- the machine ---
    def _set(self, state: int, message: str) -> None:
        if (state, message) == (self.state, self.message):
            return  # the same wait, woken again: say it once
        self.state = state
        self.message = message
        log.info("job %s: %s — %s", self.job_id,
                 coordinator_pb2.JobState.Name(state).removeprefix("JOB_STATE_").lower(),
                 message)

    async def _wait(self, timeout: float = 1.0) -> None:
        """Until poked (or `timeout`), and at least FOLLOW_EVERY_S after the last wait."""
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            pass
        if (rest := self._waited + FOLLOW_EVERY_S - time.monotonic()) > 0:
            await asyncio.sleep(rest)
        self._waited = time.monotonic()

    async def run(self) -> None:
        if not self.config.model:
            return
        if self._adopt_deadline:
            self._set(S.JOB_STATE_RUNNING, f"epoch {self.epoch}: adopted after a coordinator "
                      f"restart; waiting for its {len(self.members)} members to report")
            await self._follow()
        errors = 0
        while self.state not in (S.JOB_STATE_DONE, S.JOB_STATE_FAILED):
            try:
                await self._run_epoch()
                errors = 0
            except Exception as exc:  # noqa: BLE001 - any bug here must not hang the job
                # e.g. the scheduler's search process killed (BrokenProcessPool): without
                # this the task died silently and the job sat in "scheduling" for ever
                errors += 1
                state = coordinator_pb2.JobState.Name(self.state).removeprefix("JOB_STATE_")
                log.exception("job %s: coordinator error while %s", self.job_id, state.lower())
                what = f"coordinator error while {state.lower()}: {exc!r}"
                if errors > max(self.config.max_restarts, 1):
                    self._set(S.JOB_STATE_FAILED, f"{what}; gave up after {errors} tries "
                              "(the coordinator log has the traceback; please report it)")
                    self.persist(finished=True)
                    return
                self._set(S.JOB_STATE_WAITING, f"{what}; trying again in "
                          f"{INTERNAL_RETRY_S:.0f} s ({errors} of "
                          f"{max(self.config.max_restarts, 1)})")
                await asyncio.sleep(INTERNAL_RETRY_S)

    async def _run_epoch(self) -> None:
        cfg = self.config
        spec = cfg.model_spec()
        placement = cfg.parsed_placement()
        members = await self.membership.with_verdicts(await self._gather(placement))
        ids = [m.agent_id for m in members]
        links = await self.link_source.gather(members, self.epoch, self._set)
        if isinstance(links, NoLinks):
            if links.hold_out:
                self.membership.hold_out(links.hold_out)
            self._set(links.state, links.message)
            return
        delay, bandwidth, failures = failedpairs.keep_apart(  # pairs that failed, relayed
            links.delay, links.bandwidth, links.failures, ids, self.failed_pairs.apart())
        net = Network.measured(delay, bandwidth)
        layout, train = self.planner.epoch_layout(members, spec.n_layers)
        self._set(S.JOB_STATE_SCHEDULING, f"placing {layout.text} "
                  f"({placement.label})")
        work = Workload(spec, layout.stages, layout.replicas, train.global_batch,
                        train.micro_batches, cfg.train.schedule, cfg.train.dtype,
                        act_dtype=cfg.train.dtype,  # the worker sends activations in it
                        dp_mode=cfg.train.dp_mode, moments_dtype=cfg.train.moments_dtype,
                        sync_every=self.planner.sync_every or 1,  # local steps: exchange every H
                        outer_delay=cfg.train.outer_delay,  # ... overlapping the next round
                        pipeline_delay=cfg.train.pipeline_delay,  # flushing at sync points
                        lora_rank=cfg.train.lora_rank, lora_targets=cfg.train.lora_targets,
                        compression=Compression.for_job(  # --pp/--dp-compress, counted per link
                            cfg.train.pp_compress, cfg.train.dp_compress, dtype=cfg.train.dtype,
                            dp_mode=cfg.train.dp_mode,
                            device_kinds=[m.info.device.kind for m in members]),
                        verify=cfg.train.verify)  # replica checks priced into the step
        flops = agent_flops(members, cfg.train.dtype)
        try:
            warm = self.planner.warm_grid(layout, ids, placement,
                                          self.replan.planned_grid(ids), self.plan, self.epoch)
            found = await self.planner.place(
                placement, net, layout, ids, work, device_figures(members, cfg.train.dtype),
                flops, warm=warm, planned_splits=self.replan.planned_splits(layout.stages),
                epoch=self.epoch)
            if isinstance(grid := avoid_dead_links(found, failures, ids, placement), NoLinks):
                self.membership.hold_out(grid.hold_out)
                self._set(grid.state, grid.message)
                return
            how = [f"{found['algorithm']}, swapped off dead links"] if grid else []
            # R = 2 replicas that disagree go to different stages (integrity/dispute.py)
            if (apart := self.integrity.disputes.apart(ids)) and placement.kind == "scheduled":
                base = grid or found["grid"]
                if (parted_grid := separate(base, apart)) is not None and parted_grid != base:
                    grid = parted_grid
                    how = [*(how or [found["algorithm"]]), "disputing replicas placed apart"]
            if grid is not None:
                found = await self.planner.place(
                    placement, net, layout, ids, work, device_figures(members, cfg.train.dtype),
                    flops, warm=(grid, ", ".join(how)),
                    planned_splits=self.replan.planned_splits(layout.stages), epoch=self.epoch)
        except DoesNotFit as exc:
            self._set(S.JOB_STATE_FAILED, f"{cfg.model} on {layout.text} "
                      f"does not fit: {exc}")
            return
        except ValueError as exc:
            self._set(S.JOB_STATE_FAILED, f"placement {placement.label}: {exc}")
            return
        net = found.get("net", net)  # relayed links priced with the flows this grid shares
        if self.planner.sync_every == SYNC_AUTO:
            try:
                work = self.planner.choose_sync(net, found, work, flops, members, ids,
                                                train.steps)
            except DoesNotFit as exc:
                self._set(S.JOB_STATE_FAILED, f"{cfg.model} with --sync-every "
                          f"{self.planner.sync_every} (auto) does not fit: {exc}")
                return
        train = with_sync(train, self.planner.sync_every,  # auto's H = 1: no delay
                          layout.replicas)
        self.epoch += 1
        self.planner.layout, self.planner.train = layout, train
        self.planner.grid_ids = [[ids[d] for d in row] for row in found["grid"]]
        self.recoveries.placed(layout_text(layout.stages, layout.replicas))
        self.checkpoints.epoch_splits = list(found["splits"])
        if self.checkpoints.trained_splits is None and (cfg.train.checkpoint_dir
                                                        or cfg.train.checkpoint_every):
            # the first epoch: nothing re-cut
            self.checkpoints.trained_splits = list(found["splits"])
        resplit = (self.checkpoints.trained_splits
                   if self.checkpoints.trained_splits != self.checkpoints.epoch_splits else None)
        by_rank = layout.devices_by_rank(found["grid"])
        ranked = [int(d) for d in by_rank]
        records = [members[d] for d in ranked]
        self.planner.model = Prediction(net=net, grid=found["grid"], work=work,
                                        splits=found["splits"], agents=ids, flops=flops)
        predicted = self.planner.model.predict({})
        self.plan = self.planner.plan_message(found, ids, placement, self.epoch, predicted)
        plane = self.dataplane.plan(self.job_id, self.epoch, records, (  # as priced: routes
            net, ranked, layout, self.planner.model.shape), self.links, found.get("routes"))
        self.planner.relays = plane.routes
        if plane.unsupported:
            self._set(S.JOB_STATE_FAILED, plane.unsupported)
            return
        assignments = build_assignments(
            job_id=self.job_id, epoch=self.epoch, layout=layout, spec=spec, train=train,
            master_addr=records[0].info.host,
            master_port=self.planner.rendezvous_port(self.epoch),
            backend=plane.backend, data_plane=plane.plane,
            bind_addrs=[r.info.host for r in records], splits=found["splits"],
            codecs=found["codecs"],
            members=[(r.info.host, r.info.port) for r in records],
            checkpoint_splits=resplit, dp_shares=found["dp_shares"], init_hash=cfg.init_hash,
            member_gbps=net.bandwidth_gbps[np.ix_(ranked, ranked)].tolist(),
            member_ids=[r.agent_id for r in records],
            member_dialable=[r.reach.verdict != common_pb2.REACHABILITY_NOWHERE for r in records],
        )
        swaps = swaps_part(placement.kind, layout.stages)
        why = unsettled(placement.kind, layout.stages, placement.pinned is not None,
                        bool(self.membership.spares([r.agent_id for r in records])))
        settle = "" if resolve_verify(cfg.train.verify, cfg.train.dp_mode) == Verify.OFF \
            else why
        self.integrity.plan_epoch(  # a rollback's bound; disputes parted or not
            assignments, train.sync_every, rows=self.planner.grid_ids, by_spare=not swaps,
            members=[r.agent_id for r in records], unsettled=settle, separable=not why)
        self.members = [r.agent_id for r in records]
        self._progress.clear()
        self._steps.clear()
        self._first_steps.clear()
        self._failure, self._failure_kind = "", ""
        for rec, assignment in zip(records, assignments, strict=True):
            self.registry.send(rec.agent_id, coordinator_pb2.Command(assign=assignment))
        self.started_unix_s = time.time()
        self._set(S.JOB_STATE_RUNNING,
                  f"epoch {self.epoch}: {layout.text}, "
                  f"{placement.label} placement, layers {found['split_note']}, predicted "
                  f"cost {found['cost']:.3f} s"  # the step: JobStatus.predicted_step_s, live
                  + (f", compression {found['codecs'].summary()}"
                     if work.compression and work.compression.active else "")
                  + (f", {train.micro_batches} micro-batches per replica (shrunk from "
                     f"{layout_text(self.planner.wanted.stages, self.planner.wanted.replicas)})"
                     if self.planner.wanted and layout != self.planner.wanted else "")
                  + (f", resuming from checkpoints cut as "
                     f"{','.join(map(str, resplit))} layers per stage" if resplit else "")
                  + (f", around dead link(s) {linkfailure.describe(failures.dead)}"
                     if failures.dead else "")
                  + (f"; {settle}" if settle and self.integrity.checked else ""))
        self.replan.start_epoch(predicted.step_s)
        self.persist()
        await self._follow()

    async def _gather(self, placement: Placement) -> list[AgentRecord]:
        """Wait for the agents the job needs: the pinned plan's, or any `--agents` live ones
        (`Membership.pick`)."""
        while True:
            # after a fault, only agents heard from since count: a dead one is swept by its
            # missed heartbeats instead of being planned on (and probed for a minute)
            picked, what, alive = self.membership.pick(
                placement, self.planner, self._settle_after, self.replan.planned_members(),
                benched=() if swaps_part(placement.kind, self.planner.layout.stages
                                         if self.planner.layout else self.config.stages)
                else self.integrity.disputes.benched(self.members))
            if picked is not None:
                return picked
            if self.state != S.JOB_STATE_RECOVERING or alive:
                self._set(S.JOB_STATE_RECOVERING if self.state == S.JOB_STATE_RECOVERING
                          else S.JOB_STATE_WAITING, f"waiting for {what}")
            await self._wait()

    async def _follow(self) -> None:
        while True:
            fresh_checkpoint = self._note_checkpoint()
            self._check_adopted()
            if self._failure:
                if hold := rootcause.hold_s(self._failure_kind, self._failure_at,
                                            time.monotonic(),
                                            self.registry.heartbeat_interval_s):
                    await self._wait(hold)  # other members' reports may name the cause
                    continue
                await self._recover(self._failure)
                return
            self.membership.measure_spares(self.members, self.poke)
            self.replan.tick()
            if why := self.integrity.disputes.replan_reason or (fresh_checkpoint and (
                    self.membership.grow_reason(  # onto more agents, or moved
                        self.members, self.planner, self.checkpoint_step)
                    or self.replan.move_reason())):
                self.recoveries.begin(why, self.planner.layout_text(), self.last_step(),
                                      planned=True)
                await self._stop_members(f"recovering: {why}")
                self._set(S.JOB_STATE_RECOVERING, why)
                self.persist()
                return
            done = [a for a in self.members
                    if (p := self._progress.get(a)) is not None
                    and WorkerState.from_wire(p.worker_state) is WorkerState.DONE]
            if len(done) == len(self.members):
                self._set(S.JOB_STATE_DONE, f"trained {self.config.train.steps} steps")
                self.persist(finished=True)
                return
            await self._wait()

    async def _recover(self, failure: str) -> None:
        self.replan.cancel()  # a re-plan in the making is moot: the recovery plans anew
        self.recoveries.begin(failure, self.planner.layout_text(), self.last_step())
        if self._failure_kind == "peer":  # the next epoch re-measures what the errors blame
            self.link_source.blame_peer_errors(self.planner.grid_ids,
                                               linkfailure.peer_failed(self._progress))
        self._settle_after = self.registry.now()
        gave_up = (self.failed_pairs.after_epoch(  # relay, or place apart, pairs failed before
            len(self.recoveries.items), self.members, self._progress, self.dataplane,
            self.registry) if self._failure_kind == "peer" else "")
        await self._stop_members(f"recovering: {failure}")
        self.restarts += 1
        permanent = self._permanent(failure)
        budget = self.config.max_restarts
        if permanent or gave_up:
            self._set(S.JOB_STATE_FAILED, permanent or f"{failure}; {gave_up}")
        elif self.restarts > budget:
            self._set(S.JOB_STATE_FAILED, out_of_restarts(failure, budget))
        else:
            self._set(S.JOB_STATE_RECOVERING,
                      f"{failure}; rescheduling (restart {self.restarts} of {budget} "
                      f"without progress)")
        self.persist(finished=self.state == S.JOB_STATE_FAILED)

    def _note_checkpoint(self) -> bool:
        """Whether every member has just passed a new checkpoint step this epoch wrote
        (`CheckpointTracker.note`). Progress refills the restart budget: faults days apart on
        a long job are not a failing job."""
        changed, fresh = self.checkpoints.note(self.members, self._progress, self._first_steps,
                                               self.planner.sync_every)
        if fresh:
            self.restarts = 0
            self.integrity.checkpointed()
        if changed:
            self.persist()
        return fresh

    def _check_adopted(self) -> None:
        """An adopted epoch goes on only if its members report again in time."""
        self._adopt_deadline, silence = adopted_silence(
            self.job_id, self.epoch, self.members, self._progress, self._adopt_deadline)
        if silence and not self._failure:
            self._failure = silence

    def _permanent(self, failure: str) -> str:
        """Why `failure` will repeat the same way on every retry ('' when a retry may help;
        `recovery.permanent_failure`)."""
        kind = self._failure_kind
        steps = max((r.step for r in self._progress.values()), default=0)
        last, self._last_epoch_failure = self._last_epoch_failure, (kind, steps)
        return permanent_failure(failure, kind, steps, last)

    async def _stop_members(self, reason: str) -> None:
        for agent_id in self.members:
            rec = self.registry.get(agent_id)
            if rec is not None and rec.state == S.AGENT_STATE_ALIVE:
                self.registry.send(agent_id, coordinator_pb2.Command(
                    stop=coordinator_pb2.StopCommand(job_id=self.job_id, reason=reason)))

    async def cancel(self, reason: str) -> None:
        """`coordinator cancel`: stop the members and end the job as cancelled (the caller
        stops the task that drives it)."""
        self.membership.cancel_spare_measurement()
        self.replan.cancel()
        await self._stop_members(f"cancelled: {reason}")
        self._set(S.JOB_STATE_CANCELLED, reason)
        self.persist(finished=True)

    async def shutdown(self) -> None:
        """Stop the members, unless the job is kept in a state directory: then the workers
        train on and the next coordinator process adopts them."""
        self.membership.cancel_spare_measurement()
        self.replan.cancel()
        if self.state == S.JOB_STATE_RUNNING and self.store is None:
            await self._stop_members("coordinator shutting down")
        elif self.store is not None:
            self.persist()
            log.info("job %s: %s", self.job_id,
                     shutdown_note(STATE_NAMES.get(self.state, ""), self.store.path))
