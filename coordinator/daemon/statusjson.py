"""The `coordinator status --json` document, built from one `GetStatus` answer.

A library module, not the status command's own, because two readers must share it exactly:
the command (`coordinator/commands/status.py`, which prints it and renders its text from it)
and the coordinator's web view (`coordinator/web/view.py`), whose JSON must not drift from
it. The shape is an interface other tools rely on (`agents[].id`, `.state`).
"""

from __future__ import annotations

from typing import Any

from coordinator.daemon.history import traffic_per_step
from coordinator.daemon.registry import STATE_NAMES
from coordinator.integrity.status import agent_integrity_json
from coordinator.job.replanlog import replans_to_json
from coordinator.links.store import matrix_to_json
from dtfm.core.breakdown import Breakdown, mean
from dtfm.core.workerstate import WorkerState
from dtfm.net import reach
from protos.dtfm.v1 import common_pb2, coordinator_pb2


def job_state_name(state: int) -> str:
    return coordinator_pb2.JobState.Name(state).removeprefix("JOB_STATE_").lower()


def status_to_json(status: coordinator_pb2.ClusterStatus) -> dict[str, Any]:
    agents = []
    for a in status.agents:
        p = a.progress
        agents.append({
            "id": a.info.agent_id,
            "address": f"{a.info.host}:{a.info.port}",
            "state": STATE_NAMES.get(a.state, "unknown"),
            "last_seen": a.last_seen_unix_s,
            "last_seen_ago_s": round(max(0.0, status.now_unix_s - a.last_seen_unix_s), 3),
            "joined": a.joined_unix_s,
            "device": {"kind": a.info.device.kind, "name": a.info.device.name,
                       "memory_bytes": a.info.device.memory_bytes,
                       "free_memory_bytes": a.info.device.free_memory_bytes,
                       "flops": a.info.device.flops, "flops_bf16": a.info.device.flops_bf16,
                       "cores": a.info.device.cores},
            "version": a.info.version,
            "worker": {"state": WorkerState.label(p.worker_state), "job_id": p.job_id,
                       "epoch": p.epoch, "step": p.step, "loss": p.loss,
                       "tokens_per_s": p.tokens_per_s, "error": p.error,
                       "error_kind": p.error_kind, "step_s": p.step_s,
                       "compute_s": p.compute_s, "pp_wait_s": p.pp_wait_s, "dp_s": p.dp_s,
                       # its last step in parts that add up to it (None: an older agent)
                       "breakdown": Breakdown.from_proto(p.breakdown).to_json()
                       if p.HasField("breakdown") else None,
                       **newest_validation(p),
                       **traffic_per_step(p)},
            # whether peers can dial it back (dtfm/net/reach.py): everywhere, some-peers, nowhere
            "reach": reach_to_json(a.reach),
            # why its relay is used no more: it altered a frame it forwarded ("": it is not)
            "relay_distrusted": a.relay_distrusted,
            # kernel settings of its host that slow long links (agent/probing/tuning.py); [] = tuned
            "tuning": [{"setting": t.setting, "current": t.current, "wanted": t.wanted,
                        "why": t.why, "line": f"{t.setting} = {t.wanted}"} for t in p.tuning],
            # integrity (coordinator/integrity/): why it is excluded, and evidence against it
            **agent_integrity_json(a),
        })
    j = status.job
    plan = None
    if status.plan.stages:
        plan = {"stages": status.plan.stages, "replicas": status.plan.replicas,
                "grid": [list(row.agent_ids) for row in status.plan.grid],
                "dp_shares": [list(row.dp_shares) for row in status.plan.grid],
                "cost": status.plan.cost, "dp_cost": status.plan.dp_cost,
                "pp_cost": status.plan.pp_cost, "seconds": status.plan.seconds,
                "epoch": status.plan.epoch, "placement": status.plan.placement,
                "algorithm": status.plan.algorithm,
                "predicted_step_s": status.plan.predicted_step_s,
                "predicted_comm_s": status.plan.predicted_comm_s,
                "predicted_compute_s": status.plan.predicted_compute_s,
                "layer_splits": list(status.plan.layer_splits),
                "sync_every": status.plan.sync_every or 1,
                "outer_delay": status.plan.outer_delay,
                "pipeline_delay": status.plan.pipeline_delay,
                "predicted_breakdown": Breakdown.from_proto(
                    status.plan.predicted_breakdown).to_json()
                if status.plan.HasField("predicted_breakdown") else None,
                "sync_note": status.plan.sync_note}
    return {
        "agents": agents,
        "job": job_to_json(j, agents),
        # every running job, oldest first (the first is `job`), each with the agents it holds
        "jobs": [job_to_json(r, agents) for r in status.jobs],
        "jobs_omitted": status.jobs_omitted,
        "plan": plan,
        "local_steps": local_steps(status.job.job_id, agents),
        "breakdown": job_breakdown(status.job.job_id, agents),
        "links": matrix_to_json(status.links) if status.links.agent_ids else None,
        "time": status.now_unix_s,
    }


def job_to_json(j: coordinator_pb2.JobStatus, agents: list[dict[str, Any]]) -> dict[str, Any]:
    """One job of a status answer (`job`, and each of `jobs`); `agents`: the answer's agents
    as `status_to_json` lists them (the job's newest validation loss is its members')."""
    return {"id": j.job_id, "state": job_state_name(j.state), "model": j.model,
            "agents_wanted": j.agents_wanted, "epoch": j.epoch, "step": j.step,
            "total_steps": j.total_steps, "loss": j.loss, "tokens_per_s": j.tokens_per_s,
            **validation(j.job_id, agents),
            "message": j.message, "placement": j.placement,
            "predicted_step_s": j.predicted_step_s, "measured_step_s": j.measured_step_s,
            "agents_min": j.agents_min, "stages": j.stages, "replicas": j.replicas,
            "checkpoint_step": j.checkpoint_step, "restarts": j.restarts,
            # integrity: agents excluded now; the next epoch resumes before this step
            "exclusions": j.exclusions, "rollback_before": j.rollback_before,
            "recoveries": [{f.name: getattr(r, f.name) for f in r.DESCRIPTOR.fields}
                           for r in j.recoveries],
            "replans": replans_to_json(j.replans),
            # saving the job's state in --state-dir (coordinator/reconcile.py)
            "state_saves": {"failures": j.state_save_failures, "error": j.state_save_error,
                            "saved_unix_s": j.state_saved_unix_s},
            # the coordinator's relay since it started (dtfm/net/relay.py): forwarded for
            # this job, and read from connections it dropped (never forwarded)
            "relay": {"forwarded_bytes": j.relayed_bytes,
                      "refused_bytes": j.relay_refused_bytes},
            # stages pushed to the coordinator: no member of the job can be dialled
            # (coordinator/job/checkpointcopies.py)
            "coordinator_checkpoints": [
                {"stage": c.stage, "step": c.step, "bytes": c.bytes}
                for c in j.coordinator_checkpoints],
            # the agents it holds while it runs, and why (coordinator/daemon/share.py)
            "held_agents": list(j.held_agents), "share": j.share}


def reach_to_json(r: common_pb2.ReachStatus) -> dict[str, Any]:
    return {"verdict": reach.NAMES.get(r.verdict, "unknown"), "address": r.address,
            "overridden": r.overridden, "summary": r.summary,
            "dials": [{"dialer": d.dialer, "ok": d.ok, "error": d.error,
                       "outvoted": d.outvoted} for d in r.dials]}


def local_steps(job_id: str, agents: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The job's rounds of local steps, over its training workers: H, the newest round, the
    bytes every worker sends per step by traffic kind (summed), and the largest drift at the
    last sync point; None for a synchronous job (or none running)."""
    workers = [a["worker"] for a in agents
               if a["worker"]["job_id"] == job_id and a["worker"]["sync_every"] > 1]
    if not job_id or not workers:
        return None
    return {"every": max(w["sync_every"] for w in workers),
            "round": max(w["sync_round"] for w in workers),
            "dp_bytes_per_step": sum(w["dp_bytes_per_step"] for w in workers),
            "pp_bytes_per_step": sum(w["pp_bytes_per_step"] for w in workers),
            "drift": max(w["drift"] for w in workers)}


def job_breakdown(job_id: str, agents: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The mean of the job's training workers' last-step breakdowns (each adds up to its
    step, so the mean adds up to the mean step); None before any reported one."""
    splits = [Breakdown(**a["worker"]["breakdown"]) for a in agents
              if job_id and a["worker"]["job_id"] == job_id and a["worker"]["breakdown"]]
    return mean(splits).to_json() if splits else None


def newest_validation(p: coordinator_pb2.ProgressReport) -> dict[str, Any]:
    """A worker's newest validation loss and the step it evaluated; 0 and 0 before any."""
    v = p.validations[-1] if p.validations else coordinator_pb2.Validation()
    return {"val_loss": v.loss, "val_step": v.step}


def validation(job_id: str, agents: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's newest validation loss and the step it evaluated, over its members' reports
    (`--eval-every`; they agree: every rank reports the one value); 0 and 0 before any."""
    evaluated = [a["worker"] for a in agents
                 if job_id and a["worker"]["job_id"] == job_id and a["worker"]["val_step"]]
    newest = max(evaluated, key=lambda w: (w["epoch"], w["val_step"]), default=None)
    return {"val_loss": newest["val_loss"] if newest else 0.0,
            "val_step": newest["val_step"] if newest else 0}
