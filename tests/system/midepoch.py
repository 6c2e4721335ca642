"""Emulated-WAN tests that change the network once mid-epoch: the pipeline job they run (one
agent a stage, agent 1 behind a NAT dials its neighbours; rank order, no measurement) and the
status callback that acts once training has reached a step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtfm.wan import WanEmulator
from dtfm.wan.cluster import WanCluster

STEPS = 150  # enough steps after the change even where a step takes 10 ms


def links(agents: int, value: float) -> list[list[float]]:
    """Every pair of agents' link at `value` (10 ms, 100 Mbit/s)."""
    return [[0 if i == j else value for j in range(agents)] for i in range(agents)]


def pipeline_job(agents: int = 2, steps: int = STEPS) -> list[str]:
    return ["--model", "gpt-tiny", "--agents", str(agents), "--stages", str(agents),
            "--replicas", "1",
            "--steps", str(steps), "--batch", "8", "--micro-batches", "2", "--seed", "3",
            "--search-seconds", "1", "--no-measure", "--eval-batches", "0",
            "--heartbeat-interval", "0.5", "--layer-split", "even", "--placement", "rank-order"]


def once_at(step: int, act: Callable[[], Any]) -> tuple[Callable[[dict[str, Any]], None],
                                                          list[Any]]:
    """A `WanCluster.wait_job` status callback that calls `act` once the job runs at `step`
    or later, and the list its result is put in (empty: never reached)."""
    done: list[Any] = []

    def on_status(status: dict[str, Any]) -> None:
        job = status.get("job", {})
        if not done and job.get("state") == "running" and job.get("step", 0) >= step:
            done.append(act())

    return on_status, done


def run_changing(wan: WanEmulator, tmp_path: Path, step: int, act: Callable[[], Any],
                 agents: int = 2) -> tuple[dict[str, Any], list[Any]]:
    """Run `pipeline_job(agents)` on `wan`, calling `act` once at `step`; the job's last
    status and `act`'s result (in a list, empty where the step was never reached)."""
    cluster = WanCluster(wan, tmp_path, agents=agents, coordinator_args=pipeline_job(agents))
    on_status, done = once_at(step, act)
    try:
        cluster.start(timeout=90)
        return cluster.wait_job(300, on_status=on_status), done
    finally:
        cluster.stop()


def trained_in_one_epoch(status: dict[str, Any]) -> None:
    """The job finished every step in its first epoch: the change cost no recovery."""
    job = status["job"]
    assert job["state"] == "done" and job["step"] == STEPS, job
    assert job["recoveries"] == [], job["recoveries"]
    assert job["epoch"] == 1, job


def worker_logs(tmp_path: Path, agents: int = 2) -> dict[int, str]:
    """Each agent's workers' logs, by agent number."""
    return {i: "".join(p.read_text(errors="replace")
                       for p in tmp_path.glob(f"agent-{i}/work/*.log")) for i in range(agents)}
