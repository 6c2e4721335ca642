"""Who may push a stage's checkpoint into the coordinator's copy of last resort (issue 41).

The join token is every volunteer's, so it proves nothing about a push: a bare client holding
it planted "stage 0 at step 99,999,999" for the running job, and stages 40-44 of a two-stage
job until --checkpoint-store-mib was full, after which the real holder's push was refused. A
push (`Coordinator.PushCheckpoint`, coordinator/job/checkpointcopies.py) is taken only

- from a joined agent that proves its id: the pusher sends its id and the `agent_secret` of its
  Welcome as call metadata (`dtfm.checkpoints.push.pusher_metadata`): UNAUTHENTICATED without
  them, PERMISSION_DENIED when they prove nothing;
- for the job this coordinator runs, while it has not ended (FAILED_PRECONDITION: the pusher
  stops);
- for a stage the pusher holds in the job's current epoch, a member in that stage's row of the
  grid (FAILED_PRECONDITION: the pusher stops; its next assignment says what to push);
- for a step the job can have reached: never past the job's steps (INVALID_ARGUMENT), nor
  more than one checkpoint interval (plus `HEARTBEAT_LAG_STEPS`) past the newest step its
  members reported or the newest checkpoint they all hold (OUT_OF_RANGE: a holder whose
  heartbeat is late sends it again next round). Without the lag allowance a fast job's
  newest checkpoint was always ahead of its heartbeats (step 20 pushed, 14 reported), every
  push was refused until the job ended, and the copy of last resort never existed.

All of it is decided from the first message, before a byte is reserved or written, so refused
pushes cannot fill the store: what it holds is one step per stage of the grid, each pushed by
that stage's own holder. Every refusal is logged with its reason (`answer_push`).
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from coordinator.daemon.registry import IdentityError, Registry
from coordinator.daemon.validate import agent_id_problem, secret_problem
from coordinator.job.machine import Job
from dtfm.checkpoints.push import Pusher, Refused
from dtfm.core.checkpoints import Manifest
from dtfm.core.spec import ModelSpec
from protos.dtfm.v1 import coordinator_pb2

ENDED = (coordinator_pb2.JOB_STATE_DONE, coordinator_pb2.JOB_STATE_FAILED,
         coordinator_pb2.JOB_STATE_CANCELLED)



HEARTBEAT_LAG_STEPS = 16  # steps a job may train between a heartbeat and its checkpoint push

class PushGate:
    """The checks a push to the coordinator passes before it is received."""

    def __init__(self, registry: Registry, job: Callable[[str], Job]) -> None:
        """`job`: the job of an id the coordinator runs (its primary job for any other)."""
        self.registry = registry
        self.job = job

    def admit(self, pusher: Pusher, job_id: str, m: Manifest) -> ModelSpec:
        """The model of the job `m` is pushed for, when `pusher` may push step `m` of it;
        Refused (with the status for the pusher) otherwise."""
        agent_id = self._prove(pusher)
        job = self.job(job_id)
        if not job.job_id or job.state in ENDED or job.job_id != job_id:
            running = job.job_id if job.job_id and job.state not in ENDED else "none now"
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"the coordinator keeps checkpoint copies only of the job it runs "
                          f"({running}), not of job {job_id}")
        grid = job.planner.grid_ids
        holds = [s for s, row in enumerate(grid) if agent_id in row]
        if agent_id not in job.members or m.stage not in holds:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"agent {agent_id} does not hold stage {m.stage} of job {job_id} in "
                          f"epoch {job.epoch} (it holds "
                          f"{'stage ' + str(holds[0]) if holds else 'no stage'} of "
                          f"{len(grid)}): only a stage's holder pushes it")
        train = job.config.train
        if m.step > train.steps:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"step {m.step} of stage {m.stage}: job {job_id} trains "
                          f"{train.steps} steps (--steps)")
        reached = max(job.last_step(), job.checkpoint_step)
        if m.step > reached + (train.checkpoint_every or train.steps) + HEARTBEAT_LAG_STEPS:
            raise Refused(grpc.StatusCode.OUT_OF_RANGE,
                          f"step {m.step} of stage {m.stage}: the members of job {job_id} "
                          f"have reported step {reached} at most; a later round pushes it "
                          "again once they report it")
        return job.config.model_spec()

    def _prove(self, pusher: Pusher) -> str:
        """The pusher's agent id once its secret proves it."""
        agent_id, secret = pusher
        if not agent_id or not secret:
            raise Refused(grpc.StatusCode.UNAUTHENTICATED,
                          "a push to the coordinator comes from a joined agent: send its id "
                          "and the agent_secret of its Welcome (metadata dtfm-agent-id and "
                          "dtfm-agent-secret, as `agent start` does); the join token alone "
                          "may not push")
        if problem := agent_id_problem(agent_id, "dtfm-agent-id") or secret_problem(secret):
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, problem)
        try:
            rec = self.registry.authenticate(agent_id, secret)
        except IdentityError as e:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, str(e)) from e
        if rec is None:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          f"agent {agent_id!r} has not joined this coordinator: only a member "
                          "of its job may push a checkpoint")
        return agent_id
