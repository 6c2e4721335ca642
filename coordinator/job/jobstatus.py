"""The job's `JobStatus` answer: what `coordinator status`, the web view, the metrics and the
history read of a `Job` (coordinator/job/machine.py).

Kept apart from the state machine because it is a read of every collaborator's state (the
members' reports, the prediction, the recoveries and re-plans, the data plane, the integrity
ledger), not a transition.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from coordinator.daemon.reconcile import persistence_fields
from protos.dtfm.v1 import coordinator_pb2

if TYPE_CHECKING:
    from coordinator.job.machine import Job


def refresh_prediction(job: Job) -> None:
    """Replace estimated compute by what members measured, once they have."""
    if job.planner.model is None or job.plan is None:
        return
    measured = {a: statistics.median(r.compute_s for r in steps)
                for a, steps in job.recent_steps().items() if steps and a in job.members}
    job.planner.model.refresh(job.plan, measured)  # step, compute and their breakdown


def job_status(job: Job) -> coordinator_pb2.JobStatus:
    """The job's status now."""
    cfg, planner = job.config, job.planner
    reports = list(job.progress().values())
    step = max((r.step for r in reports), default=0)
    with_loss = [r for r in reports if r.step == step and r.loss > 0]
    refresh_prediction(job)
    measured = job.measured_step_s()
    tokens = cfg.train.global_batch * cfg.model_spec().seq_len if cfg.model else 0
    return coordinator_pb2.JobStatus(
        job_id=job.job_id, state=job.state, model=cfg.model,
        model_spec=cfg.model_spec().to_proto() if cfg.model else None,
        agents_wanted=cfg.agents, epoch=job.epoch, step=step,
        total_steps=cfg.train.steps,
        loss=with_loss[0].loss if with_loss else 0.0,
        tokens_per_s=tokens / measured if measured else 0.0, message=job.message,
        placement=job.plan.placement if job.plan else "",
        predicted_step_s=job.plan.predicted_step_s if job.plan else 0.0,
        measured_step_s=measured,
        agents_min=cfg.min_agents or cfg.agents,
        stages=planner.layout.stages if planner.layout else 0,
        replicas=planner.layout.replicas if planner.layout else 0,
        checkpoint_step=job.checkpoint_step, restarts=job.restarts,
        recoveries=job.recoveries.items, replans=job.replan.records,
        rollback_before=job.integrity.ledger.rollback_before,
        exclusions=len(job.integrity.ledger.exclusions),
        **persistence_fields(job.store), **job.dataplane.status_fields(job.job_id))
