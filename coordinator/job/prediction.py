"""The running plan's step-time model, and the device figures a plan is made for.

`Prediction` is what the job shows as its predicted step and what the re-planner
(`coordinator/job/replan.py`) weighs a move with; `agent_flops` and `device_figures` turn
the agents' reports into the scheduler's `Devices`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from coordinator.daemon.registry import AgentRecord
from coordinator.scheduler import Network
from coordinator.scheduler.compute import Devices, Workload, tasklet_seconds
from coordinator.scheduler.steptime import StepShape, StepTime, simulate_step, step_breakdown
from protos.dtfm.v1 import common_pb2


def agent_flops(records: list[AgentRecord], dtype: str) -> list[float]:
    """Each agent's FLOP/s in the training dtype (0: unknown)."""
    return [r.info.device.flops_bf16 if dtype == "bf16" and r.info.device.flops_bf16 > 0
            else r.info.device.flops for r in records]


def device_figures(records: list[AgentRecord], dtype: str) -> Devices:
    """Each agent's FLOP/s in the training dtype, its memory free for training, and the
    memory pool it shares with agents on the same machine (`EpochPlanner.place` checks a
    pool once)."""
    memory = [min(r.info.device.free_memory_bytes or r.info.device.memory_bytes, 2**62)
              for r in records]  # uint64 on the wire; 4 EiB is plenty
    return Devices.of(agent_flops(records, dtype), memory,
                      [r.info.device.memory_pool for r in records])


@dataclass
class Prediction:
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

    def _compute(self, compute_per_step: dict[str, float]) -> list[list[float]]:
        m = self.work.micro_batches
        known = [f if f > 0 else math.inf for f in self.flops]  # unknown speed: no estimate
        estimate = tasklet_seconds(self.work, self.grid, known, self.splits)
        return [[compute_per_step[self.agents[d]] / m if self.agents[d] in compute_per_step
                 else float(estimate[j, k]) for k, d in enumerate(row)]
                for j, row in enumerate(self.grid)]

    def predict(self, compute_per_step: dict[str, float]) -> StepTime:
        """`compute_per_step[agent]`: its measured compute seconds per step, where known."""
        return simulate_step(self.net, self.grid, self.shape, self._compute(compute_per_step))

    def refresh(self, plan: common_pb2.Plan, compute_per_step: dict[str, float]) -> None:
        """Set `plan`'s predicted step, its compute and its breakdown (`step_breakdown`) from
        the compute the members measured (`predict`)."""
        compute = self._compute(compute_per_step)
        predicted = simulate_step(self.net, self.grid, self.shape, compute)
        plan.predicted_step_s = predicted.step_s
        plan.predicted_compute_s = predicted.compute_s
        plan.predicted_breakdown.CopyFrom(
            step_breakdown(self.net, self.grid, self.shape, compute).to_proto())


# The measured step this far from the plan's prediction (either way) is worth a word.
FAR_OFF = 1.5


def prediction_gap(predicted_s: float, measured_s: float, compute_s: float,
                   compute_measured: bool) -> str:
    """Why the measured step is far from the plan's prediction, in words; "" when within
    `FAR_OFF` either way (or either figure is missing).

    `compute_s`: the compute the prediction holds (0: no device speed known, so it is the
    communication alone); `compute_measured`: whether that compute is the members' own
    measured figure (`Prediction.predict` with their reports) or estimated from FLOP/s."""
    if predicted_s <= 0 or measured_s <= 0:
        return ""
    ratio = measured_s / predicted_s
    if 1 / FAR_OFF <= ratio <= FAR_OFF:
        return ""
    how = (f"the step measures {ratio:.1f}x the plan's prediction" if ratio > 1 else
           f"the step measures {1 / ratio:.1f}x faster than the plan's prediction")
    if compute_s <= 0:
        why = ("the agents reported no device speed, so the prediction is communication "
               "alone")
    elif not compute_measured:
        why = ("the plan's compute is a guess from the devices' reported FLOP/s, not "
               "measured; the workers' own figure replaces it once they report steps")
    elif ratio > 1:
        why = ("its compute is the workers' own, so the rest is waiting the cost model does "
               "not price: workers sharing CPU cores, the first steps' start-up, or links "
               "slower than measured")
    else:
        why = "the links carried more than measured, or communication overlapped compute"
    return f"{how}: {why}"
