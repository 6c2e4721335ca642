"""What the workers of a cluster job wrote in their progress files, for tests that compare
runs loss by loss (`<job>-e<epoch>-r<rank>.progress.jsonl` under each agent's work folder)."""

from __future__ import annotations

import json
from pathlib import Path


def step_losses(workdir: Path, job_id: str, epoch: int | None = None
                ) -> dict[int, dict[int, float]]:
    """rank -> step -> loss under `workdir` (any depth of agent folder), from one epoch's files,
    or with `epoch=None` from every epoch's, the newest epoch's where a step ran twice (before
    and after a recovery)."""
    found: dict[int, dict[int, tuple[int, float]]] = {}
    pattern = f"*/work/{job_id}-e{'*' if epoch is None else epoch}-r*.progress.jsonl"
    for path in workdir.glob(pattern):
        run = int(path.name.split(f"{job_id}-e", 1)[1].split("-r", 1)[0])
        rank = int(path.name.rsplit("-r", 1)[1].split(".")[0])
        steps = found.setdefault(rank, {})
        for line in path.read_text().splitlines():
            ev = json.loads(line)
            if ev.get("event") == "step" and steps.get(ev["step"], (-1, 0.0))[0] <= run:
                steps[ev["step"]] = (run, ev["loss"])
    return {rank: {step: loss for step, (_, loss) in steps.items()}
            for rank, steps in found.items()}


def job_losses(workdir: Path, job_id: str, epoch: int | None = None) -> dict[int, float]:
    """step -> loss of the job (`step_losses`, ranks merged): every rank reports the step's
    global loss, so any rank's is the job's."""
    return {step: loss for steps in step_losses(workdir, job_id, epoch).values()
            for step, loss in steps.items()}
