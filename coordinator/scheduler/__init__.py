"""The scheduler: the paper's cost model and the search for a placement of tasklets on devices.

This package owns everything that turns a link matrix (latency and bandwidth per ordered pair
of devices) and two message sizes (c_DP, c_PP) into a plan `grid[stage][replica] -> device`:
the cost model (`costmodel`), the hybrid genetic algorithm (`evolutionary`), the structured
candidates that seed it (`structured`), the baselines (`baselines`) and the validated
`Network` type (`network`); and, for devices of uneven speed and memory, the step model
(`steptime`), the layer split and compute-aware placement (`compute`) and the memory model
(`memory`). It is a pure library: numpy only. It never imports torch, grpc or
protobuf, so the coordinator can plan without them and tests run anywhere.
"""

from coordinator.scheduler.costmodel import CostModel, comm_gb, plan_cost
from coordinator.scheduler.evolutionary import PlanResult, search_plan
from coordinator.scheduler.network import Network

__all__ = ["CostModel", "Network", "PlanResult", "comm_gb", "plan_cost", "search_plan"]
