"""How often agents report, as their number grows.

Every agent sends one `ReportProgress` per interval, and each costs the coordinator's one
event loop the same: 0.05-0.09 of a core per 100 heartbeats a second (bench/scale.py,
docs/benchmarks.md). A fixed 1 s interval therefore holds 250 agents in a quarter of a core
and costs 0.5-0.9 of a core at 1,000, taking from the loop what the job's plans and
measurements need. So the coordinator takes in at most `budget` heartbeats a second: past
`budget x --heartbeat-interval` agents the interval stretches with their number (the welcome
and every heartbeat's answer carry it), and the liveness timeout stretches by the same
seconds, so that the slack it allows beyond one interval (a busy host's late heartbeat, a
retransmission) stays what `--liveness-timeout` gave at the configured interval.

The count is every registered agent, lost and left ones too until evicted: an interval that
follows the alive count would shrink and grow again with every churn, and each agent would
learn it one heartbeat late.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Heartbeats a second the coordinator takes in by default (--heartbeat-budget): 0.10-0.18 of
# a core by the measurement above, within issue 46's quarter of a core with room for the rest.
DEFAULT_BUDGET = 200.0
MAX_INTERVAL_S = 30.0  # past this a lost agent is noticed too late to be worth the saving


@dataclass(frozen=True)
class HeartbeatPace:
    """The configured interval and liveness timeout, and the budget that stretches them."""

    interval_s: float = 1.0  # --heartbeat-interval: the shortest interval
    liveness_s: float = 15.0  # --liveness-timeout at that interval
    budget: float = DEFAULT_BUDGET  # heartbeats a second; 0: the interval never stretches

    def interval(self, agents: int) -> float:
        """Seconds between one agent's heartbeats when `agents` are registered."""
        if self.budget <= 0:
            return self.interval_s
        return max(self.interval_s, min(MAX_INTERVAL_S, agents / self.budget))

    def liveness(self, agents: int) -> float:
        """Seconds of silence before an agent is lost, at `interval(agents)`."""
        return self.liveness_s + self.interval(agents) - self.interval_s


def check_budget(budget: float) -> str:
    """Why `--heartbeat-budget` is unusable, or ''."""
    if not (math.isfinite(budget) and budget >= 0):
        return (f"--heartbeat-budget must be a number of heartbeats a second >= 0 (0: a "
                f"fixed --heartbeat-interval), got {budget}")
    return ""
