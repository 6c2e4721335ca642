"""What the workers of a cluster job wrote in their progress files, for tests that compare
runs loss by loss (`<job>-e<epoch>-r<rank>.progress.jsonl` under each agent's work folder).

A run that recovered (a killed relay, coordinator or peer) may hold one honest gap: a rank
cut off in a step's last exchange while its peers finished the step and checkpointed it. The
next epoch resumes after that step, so no run of that rank reports its loss (its peers' step
events carry it). `cut_off` finds those from the error events' `step`; `assert_same_losses`
excuses exactly those and nothing else."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from dtfm.core.events import DoneEvent, ErrorEvent, ProgressEvent, StepEvent, parse_event

Losses = dict[tuple[int, int], float]  # (step, rank) -> loss


def _runs(workdir: Path, job_id: str, epoch: int | None = None
          ) -> Iterator[tuple[int, int, list[ProgressEvent]]]:
    """(epoch, rank, events) of each progress file of the job under `workdir`."""
    pattern = f"*/work/{job_id}-e{'*' if epoch is None else epoch}-r*.progress.jsonl"
    for path in workdir.glob(pattern):
        run = int(path.name.split(f"{job_id}-e", 1)[1].split("-r", 1)[0])
        rank = int(path.name.rsplit("-r", 1)[1].split(".")[0])
        events = [ev for line in path.read_text().splitlines() if (ev := parse_event(line))]
        yield run, rank, events


def step_losses(workdir: Path, job_id: str, epoch: int | None = None
                ) -> dict[int, dict[int, float]]:
    """rank -> step -> loss under `workdir` (any depth of agent folder), from one epoch's files,
    or with `epoch=None` from every epoch's, the newest epoch's where a step ran twice (before
    and after a recovery)."""
    found: dict[int, dict[int, tuple[int, float]]] = {}
    for run, rank, events in _runs(workdir, job_id, epoch):
        steps = found.setdefault(rank, {})
        for ev in events:
            if isinstance(ev, StepEvent) and steps.get(ev.step, (-1, 0.0))[0] <= run:
                steps[ev.step] = (run, ev.loss)
    return {rank: {step: loss for step, (_, loss) in steps.items()}
            for rank, steps in found.items()}


def step_events(workdir: Path, job_id: str, epoch: int) -> dict[int, list[StepEvent]]:
    """rank -> its step events of one epoch, in the order written."""
    return {rank: [ev for ev in events if isinstance(ev, StepEvent)]
            for _, rank, events in _runs(workdir, job_id, epoch)}


def job_losses(workdir: Path, job_id: str, epoch: int | None = None) -> dict[int, float]:
    """step -> loss of the job (`step_losses`, ranks merged): every rank reports the step's
    global loss, so any rank's is the job's."""
    return {step: loss for steps in step_losses(workdir, job_id, epoch).values()
            for step, loss in steps.items()}


def cut_off(workdir: Path, job_id: str) -> dict[tuple[int, int], str]:
    """(step, rank) -> why no run of that rank reports that step: its run of one epoch failed
    in it (the error event's `step`) and a later epoch resumed after it (`resumed_step` at or
    past it), which only a checkpoint its peers wrote after finishing the step allows."""
    runs = list(_runs(workdir, job_id))
    reported = {(ev.step, rank) for _, rank, events in runs for ev in events
                if isinstance(ev, StepEvent)}
    resumed = {run: ev.resumed_step for run, _, events in runs for ev in events
               if isinstance(ev, StepEvent | DoneEvent) and ev.resumed_step >= 0}
    found: dict[tuple[int, int], str] = {}
    for run, rank, events in runs:
        for ev in events:
            if not isinstance(ev, ErrorEvent) or ev.step < 1 or (ev.step, rank) in reported:
                continue
            after = [(later, at) for later, at in resumed.items() if later > run and at >= ev.step]
            if after:
                found[(ev.step, rank)] = (
                    f"rank {rank} failed in step {ev.step} of epoch {run} ({ev.message[:200]}); "
                    f"epoch {after[0][0]} resumed after step {after[0][1]}")
    return found


def assert_same_losses(got: Losses, ref: Losses, cut: dict[tuple[int, int], str]) -> None:
    """`got` (a run that may have recovered) has `ref`'s losses bit for bit: every (step, rank)
    of `ref` but those `cut` names (see `cut_off`), whose steps some other rank of `got`
    reports, and nothing else."""
    extra = sorted(set(got) - set(ref))
    assert not extra, f"(step, rank) losses the reference lacks: {extra}"
    missing = set(ref) - set(got)
    unexplained = sorted(missing - set(cut))
    assert not unexplained, (
        f"(step, rank) losses missing, and no error event of that rank's run in that step with "
        f"a later epoch resumed after it explains them: {unexplained}; explained: {cut}")
    assert set(cut) <= missing, f"cut off yet reported: {sorted(set(cut) - missing)}"
    steps = {step for step, _ in got}
    assert all(step in steps for step, _ in cut), f"no rank reports a step cut off: {cut}"
    differ = {key: (got[key], ref[key]) for key in got if got[key] != ref[key]}
    assert not differ, f"(step, rank): (got, reference) losses differ: {differ}"
