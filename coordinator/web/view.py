"""The JSON behind the web page: `coordinator status --json`, plus what only a page needs.

`status_json` IS the `status --json` document (the same function, `status_to_json`, on the
same `GetStatus` answer), so the page and the CLI cannot drift apart; tests pin that their key
sets are equal. Beyond it the page gets what status has no room for, built here:
- `history`: loss, step time and tokens/s by step (`GetHistory`'s answer, thinned to at most
  `MAX_POINTS` points before it is built, the newest always kept);
- `events`: a timeline (joins, losses, returns, job states, recoveries, re-plans with their
  predicted gain, checkpoints, new plans), found by comparing successive status snapshots;
- `plans`: the plans the job ran before the current one, for the planner tab;
- `relays`: each relay agent's load (`agent start --relay-port`), which status sums into
  `job.relay` with the coordinator's own.
Both lists are bounded (`MAX_EVENTS`, `MAX_PLANS`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from coordinator.daemon.history import history_to_json
from coordinator.daemon.statusjson import status_to_json
from protos.dtfm.v1 import coordinator_pb2

MAX_POINTS = 400
MAX_EVENTS = 500
MAX_PLANS = 20

StatusSource = Callable[[], tuple[coordinator_pb2.ClusterStatus, int]]
HistorySource = Callable[[int], coordinator_pb2.JobHistory]  # at most this many points


def status_json(status: coordinator_pb2.ClusterStatus, omitted: int) -> dict[str, Any]:
    """Exactly what `coordinator status --json` prints for this answer."""
    return {**status_to_json(status), "agents_omitted": omitted}


class Timeline:
    """Events found by comparing each status snapshot with the one before."""

    def __init__(self) -> None:
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self.plans: deque[dict[str, Any]] = deque(maxlen=MAX_PLANS)
        self._agents: dict[str, str] = {}  # id -> state last seen
        self._states: dict[str, str] = {}  # job id -> state last seen, of the jobs shown
        self._checkpoint = 0
        self._recoveries: set[float] = set()
        self._replans: dict[float, str] = {}  # at -> outcome
        self._plan: dict[str, Any] | None = None

    def _add(self, at: float, kind: str, text: str, **extra: Any) -> None:
        self.events.append({"at": at, "kind": kind, "text": text, **extra})

    def observe(self, status: dict[str, Any]) -> None:
        now = status["time"]
        self._observe_agents(status["agents"], now)
        self._observe_states([status["job"], *status.get("jobs", ())], now)
        self._observe_job(status["job"], now)
        self._observe_plan(status["plan"], now)

    def _observe_agents(self, agents: list[dict[str, Any]], now: float) -> None:
        for a in agents:
            before = self._agents.get(a["id"])
            state = a["state"]
            if before is None:
                self._add(a["joined"] or now, "join", f"{a['id']} joined ({a['address']}, "
                          f"{a['device']['kind']})", agent=a["id"])
            elif before != state:
                kind = {"lost": "lost", "left": "left", "alive": "back"}.get(state, "agent")
                self._add(now, kind, f"{a['id']} {state} (was {before})", agent=a["id"])
            self._agents[a["id"]] = state

    def _observe_states(self, jobs: list[dict[str, Any]], now: float) -> None:
        """A job's state changes: every running job's (side by side), and the one shown."""
        states = {}
        for job in jobs:
            if job["id"] and job["id"] not in states:
                if self._states.get(job["id"]) != job["state"]:
                    self._add(now, "job", f"job {job['id']} {job['state']}"
                              + (f": {job['message']}" if job["message"] else ""))
                states[job["id"]] = job["state"]
        self._states = states  # only the jobs shown now: bounded by the answer

    def _observe_job(self, job: dict[str, Any], now: float) -> None:
        if job["checkpoint_step"] > self._checkpoint:
            self._add(now, "checkpoint", f"checkpoint at step {job['checkpoint_step']}")
        self._checkpoint = job["checkpoint_step"]
        for r in job["recoveries"]:
            if r["at_unix_s"] in self._recoveries:
                continue
            self._recoveries.add(r["at_unix_s"])
            what = "grew back" if r["planned"] else "recovery"
            self._add(r["at_unix_s"], "recovery", f"{what} {r['layout_before']} -> "
                      f"{r['layout_after'] or '?'}: {r['reason']}")
        for r in job["replans"]:
            at, outcome = r["at_unix_s"], r["outcome"] or r["decision"] or "weighing"
            if self._replans.get(at) == outcome:
                continue
            self._replans[at] = outcome
            self._add(at, "replan", f"re-plan at step {r['at_step']}: {outcome}, predicted "
                      f"gain {r['gain_s']:.1f} s vs cost {r['cost_s']:.1f} s ({r['trigger']})",
                      gain_s=r["gain_s"], cost_s=r["cost_s"])

    def _observe_plan(self, plan: dict[str, Any] | None, now: float) -> None:
        if plan is None or (self._plan is not None and self._plan["epoch"] == plan["epoch"]
                            and self._plan["grid"] == plan["grid"]):
            return
        if self._plan is not None:
            self.plans.append({**self._plan, "until": now})
        self._plan = {**plan, "since": now}
        self._add(now, "plan", f"plan for epoch {plan['epoch']}: {plan['stages']} stages x "
                  f"{plan['replicas']} replicas, predicted step {plan['predicted_step_s']:.2f} s")


def relay_loads(status: coordinator_pb2.ClusterStatus) -> list[dict[str, Any]]:
    """The relay agents among `status`'s agents and what each forwarded and refused (as its
    last heartbeat said)."""
    return [{"agent": a.info.agent_id, "port": a.info.relay_port,
             "forwarded_bytes": a.progress.relay_forwarded_bytes,
             "refused_bytes": a.progress.relay_refused_bytes}
            for a in status.agents if a.info.relay_port]


class View:
    """Builds the page's document from the coordinator's live answers, on its event loop."""

    def __init__(self, status: StatusSource, history: HistorySource) -> None:
        self._status = status
        self._history = history
        self.timeline = Timeline()

    def _answer(self) -> tuple[coordinator_pb2.ClusterStatus, dict[str, Any]]:
        answer, omitted = self._status()
        data = status_json(answer, omitted)
        self.timeline.observe(data)
        return answer, data

    def status(self) -> dict[str, Any]:
        """The `status --json` document; feeds the timeline on the way."""
        return self._answer()[1]

    def page(self) -> dict[str, Any]:
        answer, status = self._answer()
        history = history_to_json(self._history(MAX_POINTS))
        return {"status": status, "history": history, "relays": relay_loads(answer),
                "events": sorted(self.timeline.events, key=lambda e: e["at"])[-100:],
                "plans": list(self.timeline.plans), "server_time": time.time()}
