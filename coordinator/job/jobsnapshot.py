"""The job's durable state: what the coordinator's state directory keeps of a `Job`, and how a
restarted coordinator puts it back (coordinator/daemon/jobstore.py stores it).

Kept apart from the state machine (`coordinator/job/machine.py`) because the snapshot is a
field-by-field copy of the collaborators' state (the planner's grid and layouts, the
checkpoints' splits, the recoveries, the re-plans, the failed pairs), not a transition; the
machine decides when to save and what an adopted epoch does next.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from coordinator.daemon.config import JobConfig
from coordinator.daemon.jobstore import JobSnapshot, fingerprint
from coordinator.job.epochplan import with_sync
from coordinator.job.failedpairs import FailedPairs
from coordinator.job.recovery import Recoveries
from dtfm.core.fingerprint import fingerprinted
from dtfm.core.layout import Layout
from dtfm.core.spec import SYNC_AUTO
from protos.dtfm.v1 import common_pb2, coordinator_pb2

if TYPE_CHECKING:
    from coordinator.job.machine import Job

S = coordinator_pb2  # state constants live in the generated module
STATE_NAMES = {S.JOB_STATE_WAITING: "waiting", S.JOB_STATE_MEASURING: "measuring",
               S.JOB_STATE_SCHEDULING: "scheduling", S.JOB_STATE_RUNNING: "running",
               S.JOB_STATE_RECOVERING: "recovering", S.JOB_STATE_DONE: "done",
               S.JOB_STATE_FAILED: "failed", S.JOB_STATE_IDLE: "idle",
               S.JOB_STATE_CANCELLED: "cancelled"}


def job_fingerprint(cfg: JobConfig) -> str:
    """What makes a stored job the same job: its model, shape, training and placement flags
    (not operational ones such as --max-restarts or --min-agents)."""
    return fingerprint({"model": cfg.model, "agents": cfg.agents, "stages": cfg.stages,
                        "replicas": cfg.replicas, "train": fingerprinted(cfg.train),
                        "placement": cfg.placement, "layer_split": cfg.layer_split,
                        "seed": cfg.seed,
                        **({"init_hash": cfg.init_hash} if cfg.init_hash else {})})


def snapshot(job: Job) -> JobSnapshot:
    """What the state directory keeps of `job` now."""
    planner = job.planner
    return JobSnapshot(
        job_id=job.job_id, fingerprint=job_fingerprint(job.config),
        state=STATE_NAMES.get(job.state, "waiting"), epoch=job.epoch,
        restarts=job.restarts, members=list(job.members), grid=planner.grid_ids,
        splits=list(job.checkpoints.epoch_splits),
        checkpoint_splits=list(job.checkpoints.trained_splits or []),
        checkpoint_step=job.checkpoint_step,
        recoveries=job.recoveries.to_json(), replans=job.replan.to_json(),
        started_unix_s=job.started_unix_s,
        micro_batches=planner.train.micro_batches,
        wanted_replicas=planner.wanted.replicas if planner.wanted else 0,
        wanted_stages=planner.wanted.stages if planner.wanted else 0,
        sync_every=planner.sync_every, failed_pairs=job.failed_pairs.to_json(),
        integrity=job.integrity.to_json())


def restore(job: Job, snap: JobSnapshot) -> None:
    """Put back into `job`'s collaborators what `snap` kept: the checkpoints, the recoveries
    and re-plans, the planner's grid, layouts and H (the machine restores its own epoch)."""
    job.checkpoints.step = snap.checkpoint_step
    job.recoveries = Recoveries(snap.recoveries)
    job.replan.restore(snap.replans)
    job.failed_pairs = FailedPairs(snap.failed_pairs)  # not retried after a restart
    job.dataplane.relay_only = job.failed_pairs.relay_only()
    job.integrity.restore(snap.integrity)  # evidence and exclusions outlive a restart
    planner = job.planner
    planner.grid_ids = snap.grid
    if snap.grid:
        planner.wanted = Layout(snap.wanted_stages or len(snap.grid),
                                max(snap.wanted_replicas, len(snap.grid[0])))
        planner.layout = Layout(len(snap.grid), len(snap.grid[0]))
    job.checkpoints.epoch_splits = list(snap.splits)
    if snap.checkpoint_splits or snap.splits:  # older snapshots: one split for both
        job.checkpoints.trained_splits = list(snap.checkpoint_splits or snap.splits)
    job.started_unix_s = snap.started_unix_s
    if planner.sync_every == SYNC_AUTO and snap.sync_every:
        planner.sync_every = snap.sync_every
        planner.sync_note = f"auto: every {snap.sync_every} steps, chosen on the first plan"


def resume_running(job: Job, snap: JobSnapshot) -> None:
    """`snap`'s running epoch as `job` goes on with it: its members, its training config,
    and the plan status shows (with the job's H and `--outer-delay`, as the epoch had them)."""
    job.members = list(snap.members)
    sync, train = job.planner.sync_every, job.config.train  # `restore` put back auto's H
    job.planner.train = with_sync(replace(train, micro_batches=snap.micro_batches
                                          or train.micro_batches), sync, len(snap.grid[0]))
    job.plan = common_pb2.Plan(
        stages=len(snap.grid), replicas=len(snap.grid[0]), epoch=job.epoch,
        grid=[common_pb2.PlanStage(agent_ids=row) for row in snap.grid],
        placement="adopted", layer_splits=snap.splits, sync_every=sync,
        sync_note=job.planner.sync_note, outer_delay=job.planner.train.outer_delay,
        pipeline_delay=job.planner.train.pipeline_delay)
