"""Re-planning a running job when its network or devices drift, and only when it pays.

Owns what happens after the drift watch (`coordinator/drift.py`) fires, kept out of the job's
state machine (`coordinator/job.py`), which calls in at four points: a new epoch trains
(`start_epoch`), a member reported a steady step (`observe`), the follow loop turns (`tick`),
and every member passed a fresh checkpoint (`move_reason`).

On a verdict it starts one background evaluation while the job trains on:

1. re-measure only what can explain the gap: a latency sweep of every member pair (pings are
   a few hundred bytes, paced) and the bandwidth of the links whose delay moved (one probe
   for each group that moved alike between the same two places, the rest inferred from it)
   or, where none moved, of the plan's links that touch the suspects, with short probes
   (`--remeasure-probe-seconds`), through the job's `LinkMeasurer` into the link store (with
   `--links FILE` the file is read again instead: whoever refreshes it);
2. search and polish again on the updated matrix (the job's own `_place`), with a slowed
   device's FLOP/s scaled by its measured compute and the uneven-split planner given a go;
3. weigh the predicted step saved over the remaining steps against the cost of moving: the
   stall this job saw in its earlier recoveries (or its own start-up, before it had any) plus
   the stage checkpoints the members that change stage must fetch, over the measured links;
4. move when the gain exceeds `--replan-margin` times the cost: at the next checkpoint the job
   stops its members through its planned-recovery path (as a grow-back does) and the next
   epoch takes the new grid, resuming from that checkpoint, so no step is lost beyond it and
   the losses are those of an undisturbed run. That checkpoint is asked for a few steps
   ahead (`CheckpointCommand`, `dtfm.core.requests`) rather than waited for at the degraded
   speed, up to `--checkpoint-every` steps; if some member did not write it, the regular one
   serves. Either way the watch accepts the drifted figures as the new normal (hysteresis:
   a flapping link does not make flapping plans).

Every evaluation becomes a `Replan` record (status, history, `coordinator report`, metrics):
the links and devices that changed (old and new figures), the predicted gain, the cost, the
decision and why, and, after a move, the stall it really cost and the step measured after.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from google.protobuf import json_format

from coordinator.job.drift import Drift, DriftWatch, Sample
from coordinator.links.infer import latency_clusters, representatives, to_measure
from coordinator.links.measure import Pings
from coordinator.links.store import matrix_arrays
from coordinator.scheduler import Network
from coordinator.scheduler.compute import Devices, tasklet_seconds
from coordinator.scheduler.memory import FP32, param_state_bytes
from dtfm.core.layout import layer_ranges
from dtfm.core.rounds import requested_checkpoint
from protos.dtfm.v1 import coordinator_pb2

if TYPE_CHECKING:
    from coordinator.job.machine import Job, _Prediction

log = logging.getLogger(__name__)

SPARES_TRIED = 2  # spares weighed in place of the member whose links degraded most
RESTART_OVERHEAD_S = 5.0  # stopping the members and planning, on top of a start-up's stall
# How far past the newest reported step (seconds, on top of a heartbeat interval: the newest
# report may be that old) a requested checkpoint lies: the command must reach every agent
# before its worker ends that step
REQUEST_MARGIN_S = 1.0
LINK_CHANGE_MS = 5.0  # a delay that moved less than this (and the threshold) did not change
# a sweep taken while the job trains reads many links high by a similar amount; a delay moved
# only past that sweep's own noise: twice the shift that 3 in 4 of its links stay under ...
SWEEP_NOISE_QUANTILE = 0.75
SWEEP_NOISE_FACTOR = 2.0
SWEEP_NOISE_CAP_MS = 50.0  # ... but a delay that moved by 50 ms always changed
SWEEP_NOISE_MIN_LINKS = 8  # fewer readings cannot tell a sweep's noise from a change
# bandwidth probes at once while the job trains: each takes a link's capacity from the training
# traffic for its probe, so few at a time (bench/drift.py measures what they cost a step)
BACKGROUND_PROBES = 2
# pings per peer while the job trains, spread over one step or longer (measure.PING_RATE):
# enough that one of them likely falls between the job's bursts, few enough not to load the
# agents' event loops (10 within 2 s read 16 agents' links 51-76 ms long; 5, paced, 2-3 ms)
BACKGROUND_PINGS = 5


def grid_text(grid: list[list[str]]) -> str:
    return ";".join(",".join(row) for row in grid)


def plan_links(grid: list[list[int]]) -> set[tuple[int, int]]:
    """The directed links a grid's traffic uses: pipeline neighbours and data-parallel
    groups, both ways."""
    links: set[tuple[int, int]] = set()
    for j in range(len(grid) - 1):
        for a, b in zip(grid[j], grid[j + 1], strict=True):
            links |= {(a, b), (b, a)}
    for row in grid:
        links |= {(a, b) for a in row for b in row if a != b}
    return links


def moved(old: Network, new: Network, threshold: float, floor_ms: float = LINK_CHANGE_MS
          ) -> tuple[np.ndarray, np.ndarray]:
    """Per directed link: did its delay, did its bandwidth move by more than the threshold (a
    fraction; delays also by more than `floor_ms`)? Less than that is measurement noise."""
    d0, d1 = old.delay_ms, new.delay_ms
    b0, b1 = old.bandwidth_gbps, new.bandwidth_gbps
    with np.errstate(divide="ignore", invalid="ignore"):
        delay = np.abs(d1 - d0) > np.maximum(floor_ms, threshold * d0)
        rate = (b0 > 0) & (b1 > 0) & (np.maximum(b0 / b1, b1 / b0) > 1.0 + threshold)
    np.fill_diagonal(delay, False)
    np.fill_diagonal(rate, False)
    return delay, rate


def request_lead(step_s: float, heartbeat_s: float) -> int:
    """Steps past the newest reported one to ask a checkpoint for: the report may be a
    heartbeat old, and the ask needs `REQUEST_MARGIN_S` more to reach every worker before it
    ends that step (a sparse `--heartbeat-interval` asks further ahead, so workers still hear
    in time rather than the move falling back to the regular checkpoint)."""
    return 1 + math.ceil((heartbeat_s + REQUEST_MARGIN_S) / max(step_s, 1e-3))


def changed_links(old: Network, new: Network, ids: list[str], threshold: float
                  ) -> list[coordinator_pb2.LinkChange]:
    """The links whose delay or bandwidth moved by more than the threshold (a fraction)."""
    delay, rate = moved(old, new, threshold)
    return [coordinator_pb2.LinkChange(
        src=ids[i], dst=ids[j], delay_ms_before=float(old.delay_ms[i, j]),
        delay_ms_after=float(new.delay_ms[i, j]), gbps_before=float(old.bandwidth_gbps[i, j]),
        gbps_after=float(new.bandwidth_gbps[i, j]))
        for i, j in zip(*np.nonzero(delay | rate), strict=True)]


class Settled(NamedTuple):
    """A settled re-measurement and which of its links moved past the threshold."""

    net: Network
    delay_moved: np.ndarray  # bool [i, j]
    rate_moved: np.ndarray
    noise_ms: float  # the sweep's noise floor: a delay moved by less did not change


def sweep_noise_ms(old_delay_ms: np.ndarray, delay_ms: np.ndarray) -> float:
    """How far a sweep moved the delays of links that did not change, from the sweep itself.

    Pings taken beside training traffic on busy hosts read high, and by much the same for
    many links at once: bench/drift.py's run 4 read 85 unchanged links 14-16 ms high, past
    the fixed 5 ms floor, where the 8 degraded links had moved 125-157 ms, and probing the
    bandwidth of every pair whose delay "moved" took 95 s. A change is the exception among a
    sweep's links, so twice the shift that 3 in 4 links stay under bounds the noise as long
    as fewer than a quarter of the links changed (one degraded city pair of 8 cities moves 3 %
    of them); a mode of noise that only some links share (a third of them there) stays under
    it too, where the median and its deviation would call it a change. Capped, so a move of
    `SWEEP_NOISE_CAP_MS` always counts; never below `LINK_CHANGE_MS`."""
    seen = np.isfinite(delay_ms) & np.isfinite(old_delay_ms) & ~np.eye(len(delay_ms), dtype=bool)
    shift = np.abs(delay_ms - old_delay_ms)[seen]
    if shift.size < SWEEP_NOISE_MIN_LINKS:
        return LINK_CHANGE_MS
    return float(np.clip(SWEEP_NOISE_FACTOR * np.quantile(shift, SWEEP_NOISE_QUANTILE),
                         LINK_CHANGE_MS, SWEEP_NOISE_CAP_MS))


def settle_remeasured(old: Network, delay_ms: np.ndarray, bandwidth_gbps: np.ndarray,
                      threshold: float) -> Settled:
    """The figures a re-plan weighs, from a re-measurement taken while the job trains.

    Pings then queue behind the training traffic and wait for busy cores, so they read high,
    and more on one end of a pair than the other. Both ends time the same round trip, so the
    lesser of the two readings is the better one for both directions. A link whose figure
    stayed within the threshold of the plan's, or within the sweep's own noise
    (`sweep_noise_ms`), keeps the plan's: noise must not re-route a plan (a link that failed
    to measure keeps it too)."""
    delay = np.fmin(delay_ms, delay_ms.T)
    noise = sweep_noise_ms(old.delay_ms, delay)
    delay = np.where(np.isnan(delay), old.delay_ms, delay)
    bandwidth = np.where(np.isnan(bandwidth_gbps), old.bandwidth_gbps, bandwidth_gbps)
    delay_moved, rate_moved = moved(old, Network.measured(delay, bandwidth), threshold, noise)
    return Settled(Network.measured(np.where(delay_moved, delay, old.delay_ms),
                                    np.where(rate_moved, bandwidth, old.bandwidth_gbps)),
                   delay_moved, rate_moved, noise)


def links_to_probe(grid: list[list[int]], ids: list[str], delay_moved: np.ndarray,
                   suspects: set[str]) -> set[tuple[str, str]]:
    """The links whose bandwidth a re-measurement probes, after its latency sweep.

    Those whose delay moved (both directions of the pair, in the plan or not): a congested,
    throttled or re-routed path shows in its round trip, and a link the plan does not use yet
    keeping its old rate would draw the new plan onto it. Where no delay moved, the plan's
    links that touch a suspect: a link can lose rate without its delay moving. Probing every
    plan link instead took 48 s on the 16-agent world (72 links, two at a time) and slowed the
    steps meanwhile (bench/drift.py)."""
    n = len(ids)
    pairs = {(a, b) for a in range(n) for b in range(n)
             if a != b and (delay_moved[a, b] or delay_moved[b, a])}
    if not pairs:
        pairs = {(a, b) for a, b in plan_links(grid) if ids[a] in suspects or ids[b] in suspects}
    return {(ids[a], ids[b]) for a, b in pairs}


def probe_representatives(links: set[tuple[str, str]], ids: list[str], net: Network
                          ) -> dict[tuple[str, str], tuple[str, str]]:
    """Which of the links whose delay moved stand for which (`linkinfer.representatives`,
    over latency clusters of the sweep's settled delays): links that moved alike between the
    same two places share one probe. Only where delays moved: a link that lost rate and kept
    its delay looks like its neighbours, so the suspects' plan links are each probed."""
    at = {a: i for i, a in enumerate(ids)}

    def delay(a: str, b: str) -> float | None:
        value = float(net.delay_ms[at[a], at[b]])
        return value if np.isfinite(value) else None

    return representatives(links, latency_clusters(ids, delay), delay)


def copy_seconds(old_grid: list[list[int]], new_grid: list[list[int]], stage_bytes: list[int],
                 net: Network, newcomers: frozenset[int] = frozenset()) -> float:
    """Seconds for the members that change stage to fetch their new stage's checkpoint from
    the best-connected member that holds it (fetches run in parallel: the slowest counts).
    `newcomers`: devices that hold nothing (a spare put in a member's place, at its index)."""
    worst = 0.0
    for j, row in enumerate(new_grid):
        holders = [h for h in old_grid[j] if h not in newcomers] or old_grid[j]
        for d in row:
            if d in holders:
                continue
            gbps = max(float(net.bandwidth_gbps[h, d]) for h in holders)
            delay_s = min(float(net.delay_ms[h, d]) for h in holders) / 1e3
            worst = max(worst, 8.0 * stage_bytes[j] / (max(gbps, 1e-9) * 1e9) + delay_s)
    return worst


def move_verdict(stay_s: float, new_s: float, steps_left: int, cost_s: float,
                 margin: float) -> tuple[bool, float, str]:
    """(move?, predicted gain in seconds, why)."""
    gain = (stay_s - new_s) * steps_left
    if new_s >= stay_s:
        return False, gain, (f"no better plan: the new one predicts {new_s:.2f} s/step, "
                             f"staying {stay_s:.2f} s")
    if gain <= margin * cost_s:
        return False, gain, (f"the gain, {stay_s - new_s:.2f} s x {steps_left} steps = "
                             f"{gain:.0f} s, is under {margin:g} x the {cost_s:.0f} s a move "
                             f"costs")
    return True, gain, (f"{stay_s - new_s:.2f} s/step x {steps_left} steps left = {gain:.0f} s "
                        f"saved, over {margin:g} x the {cost_s:.0f} s a move costs")


class Replanner:
    """The job's drift watch and re-planning, one epoch at a time."""

    def __init__(self, job: Job) -> None:
        self.job = job
        cfg = job.config.drift
        self.cfg = cfg
        self.watch = DriftWatch(cfg.threshold, cfg.window)
        self.records: list[coordinator_pb2.Replan] = []
        self._task: asyncio.Task[None] | None = None
        self._pending: coordinator_pb2.Replan | None = None  # decided "move", not yet moved
        self._moving: coordinator_pb2.Replan | None = None  # stopped for it; next epoch
        self._after: coordinator_pb2.Replan | None = None  # moved; awaiting its figures
        self._planned: tuple[list[list[str]], list[int]] | None = None  # the grid, split
        self._epoch_started = 0.0
        self.startup_s = 0.0  # this epoch's assignment to first step

    # --- the job's calls ---
    def start_epoch(self, predicted_step_s: float) -> None:
        self.cancel()
        self.watch.start_epoch(predicted_step_s)
        self._epoch_started = time.monotonic()
        self.startup_s = 0.0
        if self._moving is not None:
            self._moving.outcome = "moved"
            self._moving.grid_after = grid_text(self.job._grid_ids)
            self._after, self._moving = self._moving, None
        self._planned = None

    def observe(self, agent: str, report: coordinator_pb2.ProgressReport) -> None:
        if not self.startup_s and self._epoch_started:
            self.startup_s = time.monotonic() - self._epoch_started
        self.watch.observe(agent, report.step, Sample(report.step_s, report.compute_s,
                                                      report.pp_wait_s, report.dp_s))
        if self._after is not None:
            if not self._after.stalled_s and self.job.recoveries.items:
                self._after.stalled_s = self.job.recoveries.items[-1].stalled_s
            if self.watch.settled_s:
                self._after.step_after_s = self.watch.settled_s
                log.info("job %s: after the re-plan the step settled at %.2f s (%.2f s "
                         "drifted, %.2f s predicted)", self.job.job_id, self.watch.settled_s,
                         self._after.step_drifted_s, self._after.predicted_new_s)
                self._after = None

    def tick(self) -> None:
        """Start an evaluation when the watch fires and none is running or decided."""
        if (self._task is not None and not self._task.done()) or self._pending is not None:
            return
        drift = self.watch.check()
        if drift is None:
            return
        log.warning("job %s: drift: %s", self.job.job_id, drift.describe())
        self.watch.accept(hold_steps=self.cfg.window)
        self._task = asyncio.get_running_loop().create_task(self._evaluate(drift))

    def move_reason(self) -> str:
        """At a fresh checkpoint: why to stop and move now ('' to train on)."""
        rec = self._pending
        if rec is None or not self.cfg.replan:
            return ""
        self._pending, self._moving = None, rec
        return (f"re-planning at the checkpoint of step {self.job.checkpoint_step}: "
                f"{rec.why}")

    def planned_grid(self, ids: list[str]) -> list[list[int]] | None:
        """The grid the evaluation chose, over these agents (None: no move, or it no longer
        fits them)."""
        if self._moving is None or self._planned is None:
            return None
        index = {a: i for i, a in enumerate(ids)}
        grid = self._planned[0]
        if any(a not in index for row in grid for a in row):
            return None
        return [[index[a] for a in row] for row in grid]

    def planned_members(self) -> list[str]:
        """The agents a move puts in the plan (a spare may replace a member), else []."""
        if self._moving is None or self._planned is None:
            return []
        return [a for row in self._planned[0] for a in row]

    def planned_splits(self, stages: int) -> list[int] | None:
        if self._moving is None or self._planned is None or len(self._planned[1]) != stages:
            return None
        return list(self._planned[1])

    def cancel(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._task = None
        if self._pending is not None:
            self._pending.outcome = "dropped"
            self._pending.why += " (dropped: the epoch ended before the next checkpoint)"
            self._pending = None

    # --- the evaluation ---
    async def _evaluate(self, drift: Drift) -> None:
        job = self.job
        model = job._model
        if model is None or job._layout is None:
            return
        rec = coordinator_pb2.Replan(
            at_unix_s=time.time(), at_step=drift.at_step, trigger=drift.describe(),
            suspects=drift.suspects, step_before_s=drift.settled_s,
            step_drifted_s=drift.measured_s, grid_before=grid_text(job._grid_ids))
        rec.devices.extend(coordinator_pb2.DeviceChange(
            agent=a, compute_s_before=b, compute_s_after=n) for a, (b, n) in drift.devices.items())
        self.records.append(rec)
        try:
            await self._weigh(rec, drift, model)
        except asyncio.CancelledError:
            rec.outcome, rec.why = "dropped", rec.why or "the epoch ended during the evaluation"
            raise
        except Exception as exc:  # noqa: BLE001 - an evaluation must never stop training
            log.exception("job %s: the re-plan evaluation failed", job.job_id)
            rec.decision, rec.outcome = "stay", "declined"
            rec.why = f"the evaluation failed: {exc!r} (the coordinator log has the traceback)"
        job._persist()
        job.poke()

    async def _weigh(self, rec: coordinator_pb2.Replan, drift: Drift,
                     model: _Prediction) -> None:
        job = self.job
        ids = list(model.agents)
        started = time.monotonic()
        net = await self._remeasured(ids, model, drift)
        rec.measure_s = time.monotonic() - started
        rec.links.extend(changed_links(model.net, net, ids, self.cfg.threshold))
        compute = self._compute_now(ids)
        flops = self._scaled_flops(model, drift)
        stay = _prediction_like(model, net, model.grid, model.splits, flops).predict(compute)
        rec.predicted_stay_s = stay.step_s
        placement = job.config.parsed_placement()
        if placement.kind != "scheduled":
            rec.decision, rec.outcome = "stay", "declined"
            rec.why = f"the placement is fixed ({placement.label}): reported, never moved"
            return
        records = [r for a in ids if (r := job.registry.get(a)) is not None]
        if len(records) != len(ids):
            rec.decision, rec.outcome = "stay", "declined"
            rec.why = "a member left during the evaluation; its recovery re-plans anyway"
            return
        from coordinator.job.machine import _split, device_figures

        figures = device_figures(records, job.config.train.dtype)
        dev = Devices.of(flops, figures.memory.tolist(), figures.pools or None)
        found = await job._place(placement, net, job._layout, ids, model.work, dev, flops)
        grid, splits = found["grid"], found["splits"]
        if drift.devices:  # a slower device: let the uneven-split planner take layers off it
            grid, splits, _ = await job._in_pool(
                _split, net.delay_ms, net.bandwidth_gbps, grid, model.work, dev, True,
                job.config.search_seconds)
        new = _prediction_like(model, net, grid, splits, flops).predict(
            self._compute_for(compute, model, grid, splits, flops))
        steps_left = max(job.config.train.steps - drift.at_step, 0)
        checkpoint_every = job.config.train.checkpoint_every
        stage_bytes = self._stage_checkpoint_bytes(model)
        cost = self._stall_s() + copy_seconds(model.grid, grid, stage_bytes, net)
        for swap in await self._with_spares(rec, model, compute, flops):
            swap_cost = self._stall_s() + copy_seconds(
                model.grid, swap["grid"], stage_bytes, swap["net"], frozenset({swap["at"]}))
            if (new.step_s - swap["step_s"]) * steps_left > swap_cost - cost:
                log.info("job %s: spare %s in place of %s predicts %.2f s/step", job.job_id,
                         swap["ids"][swap["at"]], ids[swap["at"]], swap["step_s"])
                ids, grid, splits, cost = swap["ids"], swap["grid"], swap["splits"], swap_cost
                new = swap["prediction"]
        rec.predicted_new_s = new.step_s
        rec.cost_s = cost
        if checkpoint_every <= 0:
            rec.decision, rec.outcome = "stay", "declined"
            rec.why = ("the job writes no checkpoints (--checkpoint-every 0), so a move would "
                       "lose every step trained")
            return
        move, gain, why = move_verdict(stay.step_s, new.step_s, steps_left, cost,
                                       self.cfg.margin)
        rec.gain_s, rec.why = gain, why
        if move and not self.cfg.replan:
            move, rec.why = False, why + "; --no-replan: reported only"
        rec.decision = "move" if move else "stay"
        rec.outcome = "pending" if move else "declined"
        log.warning("job %s: re-plan %s: %s (measured in %.1f s; %d links changed)",
                    job.job_id, rec.decision, rec.why, rec.measure_s, len(rec.links))
        if move:
            self._planned = ([[ids[d] for d in row] for row in grid], list(splits))
            rec.grid_after = grid_text(self._planned[0])
            self._pending = rec
            self._ask_checkpoint(rec, drift.measured_s)

    def _ask_checkpoint(self, rec: coordinator_pb2.Replan, step_s: float) -> None:
        """Ask every member for a checkpoint a few steps ahead, so the move need not wait for
        the next regular one (up to `--checkpoint-every` steps at the drifted speed). Far
        enough ahead that the ask reaches every worker before it ends that step (a report up
        to a heartbeat old, the command's way); a worker that hears too late writes nothing
        extra, and the move waits for the regular checkpoint as before."""
        job, train = self.job, self.job.config.train
        lead = request_lead(step_s, job.registry.heartbeat_interval_s)
        step = requested_checkpoint(job.checkpoint_step, job._last_step(), lead,
                                    train.checkpoint_every, job._sync_every or 1, train.steps)
        if not step:
            return
        why = f"re-planning: {rec.why}"
        for agent_id in job.members:
            job.registry.send(agent_id, coordinator_pb2.Command(
                checkpoint=coordinator_pb2.CheckpointCommand(
                    job_id=job.job_id, epoch=job.epoch, step=step, reason=why)))
        rec.why += f"; asked the members for a checkpoint after step {step}"
        log.info("job %s: asked every member for a checkpoint after step %d, to move there",
                 job.job_id, step)

    async def _with_spares(self, rec: coordinator_pb2.Replan, model: _Prediction,
                           compute: dict[str, float], flops: list[float]
                           ) -> list[dict[str, Any]]:
        """Plans with a spare in place of the member most of the changed links touch (a
        member whose own uplink degraded): for up to SPARES_TRIED live spares whose links to
        the other members are known (measured in the background as they joined, or in the
        `--links` file)."""
        job = self.job
        worse = [c for c in rec.links if c.gbps_after < c.gbps_before
                 or c.delay_ms_after > c.delay_ms_before]
        touched: dict[str, int] = {}
        for c in worse:
            for a in (c.src, c.dst):
                touched[a] = touched.get(a, 0) + 1
        if not touched or job._layout is None:
            return []
        worst = max(touched, key=lambda a: touched[a])
        if touched[worst] < 2 or worst not in model.agents:
            return []
        at = model.agents.index(worst)
        out = []
        from coordinator.job.machine import agent_flops, device_figures

        for spare in job._spares()[:SPARES_TRIED]:
            ids = [spare.agent_id if a == worst else a for a in model.agents]
            net = self._known(ids)
            if net is None:
                continue
            records = [r for a in ids if (r := job.registry.get(a)) is not None]
            if len(records) != len(ids):
                continue
            figures = device_figures(records, job.config.train.dtype)
            spare_flops = list(flops)
            spare_flops[at] = agent_flops([spare], job.config.train.dtype)[0]
            dev = Devices.of(spare_flops, figures.memory.tolist(), figures.pools or None)
            try:
                found = await job._place(job.config.parsed_placement(), net, job._layout, ids,
                                         model.work, dev, spare_flops)
            except ValueError as exc:  # DoesNotFit included: this spare cannot hold it
                log.info("job %s: spare %s cannot replace %s: %s", job.job_id,
                         spare.agent_id, worst, exc)
                continue
            # the old grid with the spare at the member's index: it has no measured compute
            before = _prediction_like(model, model.net, model.grid, model.splits, spare_flops,
                                      ids)
            measured = self._compute_for(compute, before, found["grid"], found["splits"],
                                         spare_flops)
            prediction = _prediction_like(model, net, found["grid"], found["splits"],
                                          spare_flops, ids).predict(measured)
            out.append({"ids": ids, "grid": found["grid"], "splits": found["splits"],
                        "net": net, "at": at, "step_s": prediction.step_s,
                        "prediction": prediction})
        return out

    def _known(self, ids: list[str]) -> Network | None:
        """These agents' links as stored (or in the `--links` file); None where some are
        not known."""
        job = self.job
        if job.config.links_file:
            try:
                delay, bandwidth = job._known_links(ids)
            except ValueError:
                return None
        elif job.config.measure_links and job.links.complete_for(ids):
            delay, bandwidth = matrix_arrays(job.links.matrix(ids))
        else:
            return None
        return Network.measured(delay, bandwidth)

    async def _remeasured(self, ids: list[str], model: _Prediction, drift: Drift) -> Network:
        """The members' links as they are now: the `--links` file read again, or a latency
        sweep and then the bandwidth of the links `links_to_probe` picks from it, measured in
        the background. Each
        peer's pings are spread over one (drifted) step: pings fired together queue behind the
        job's bursts and read links tens of milliseconds longer than they are (bench/drift.py:
        93 of 95 links read as changed were delays, where one city pair had changed)."""
        job = self.job
        if job.config.links_file:
            delay, bandwidth = job._known_links(ids)
        elif job.config.measure_links and len(ids) > 1:
            records = [r for a in ids if (r := job.registry.get(a)) is not None]
            swept = await job.measurer.measure(records, bandwidth_links=set(),
                                               pings=Pings(BACKGROUND_PINGS, drift.measured_s))
            sweep = settle_remeasured(model.net, *matrix_arrays(swept), self.cfg.threshold)
            delay_moved = sweep.delay_moved
            links = links_to_probe(model.grid, ids, delay_moved, set(drift.links) or set(ids))
            stands_for = probe_representatives(links, ids, sweep.net) if delay_moved.any() \
                else {link: link for link in links}
            probed = to_measure(stands_for)
            log.info("job %s: re-measuring the bandwidth of %d links, %d of them probed (%s; "
                     "the sweep's noise floor %.1f ms)", job.job_id, len(links), len(probed),
                     "their delays moved, one probe for each alike group"
                     if delay_moved.any() else "no delay moved: the suspects' plan links",
                     sweep.noise_ms)
            matrix = await job.measurer.measure(records, bandwidth_links=probed,
                                                latency=False,
                                                probe_seconds=self.cfg.probe_seconds,
                                                max_probes=BACKGROUND_PROBES, infer=stands_for)
            return settle_remeasured(model.net, *matrix_arrays(matrix), self.cfg.threshold).net
        else:
            return model.net
        return Network.measured(delay, bandwidth)

    def _compute_now(self, ids: list[str]) -> dict[str, float]:
        """Each member's compute per step over the recent steps."""
        out = {}
        for agent, steps in self.job._steps.items():
            if agent in ids and steps:
                out[agent] = statistics.median(r.compute_s for r in steps)
        return out

    @staticmethod
    def _compute_for(compute: dict[str, float], model: _Prediction, grid: list[list[int]],
                     splits: list[int], flops: list[float]) -> dict[str, float]:
        """Each member's measured compute per step carried over to its place in `grid`:
        scaled by the model's estimate of its new tasklet against its old one (another
        stage's layers, embedding or head), so a move is judged on measured speed."""
        known = [f if f > 0 else 1.0 for f in flops]
        old = tasklet_seconds(model.work, model.grid, known, model.splits)
        new = tasklet_seconds(model.work, grid, known, splits)
        where_old = {d: (j, k) for j, row in enumerate(model.grid) for k, d in enumerate(row)}
        m = model.work.micro_batches
        # how the members' measured compute compares with the FLOP/s estimate: a device that
        # never trained here (a spare) is estimated and scaled alike
        ratios = [compute[model.agents[d]] / (m * float(old[where_old[d]]))
                  for d in where_old if model.agents[d] in compute and old[where_old[d]] > 0]
        calibration = statistics.median(ratios) if ratios else 1.0
        out = {}
        for j, row in enumerate(grid):
            for k, d in enumerate(row):
                agent = model.agents[d]
                if agent in compute and d in where_old and old[where_old[d]] > 0:
                    out[agent] = compute[agent] * float(new[j, k] / old[where_old[d]])
                else:
                    out[agent] = m * float(new[j, k]) * calibration
        return out

    @staticmethod
    def _scaled_flops(model: _Prediction, drift: Drift) -> list[float]:
        """The plan's FLOP/s per agent, a slowed device's scaled by how much slower it
        computes now than when the epoch settled."""
        flops = list(model.flops)
        for i, agent in enumerate(model.agents):
            if agent in drift.devices and flops[i] > 0:
                before, now = drift.devices[agent]
                flops[i] *= before / now
        return flops

    def _stall_s(self) -> float:
        """What a move stalls training for: the median stall of this job's earlier
        recoveries, or its own start-up (assignment to first step) before it had any."""
        stalls = [r.stalled_s for r in self.job.recoveries.items if r.stalled_s > 0]
        base = statistics.median(stalls) if stalls else self.startup_s
        return base + RESTART_OVERHEAD_S

    @staticmethod
    def _stage_checkpoint_bytes(model: _Prediction) -> list[int]:
        """Bytes of each stage's checkpoint: weights and the optimizer's moments."""
        spec = model.work.spec
        per_param = param_state_bytes(model.work.moments_dtype) - FP32  # no gradient
        return [per_param * spec.stage_params(b, e)
                for b, e in layer_ranges(spec.n_layers, model.work.stages, model.splits)]

    # --- what status, metrics and the state directory keep ---
    def to_json(self) -> list[dict[str, Any]]:
        return [json_format.MessageToDict(r, preserving_proto_field_name=True)
                for r in self.records]

    def restore(self, saved: list[dict[str, Any]]) -> None:
        """The records a previous coordinator process kept (`--state-dir`); one it left
        pending or moving is dropped: the new process re-plans from its own watch."""
        self.records = [json_format.ParseDict(d, coordinator_pb2.Replan()) for d in saved]
        for rec in self.records:
            if rec.outcome in ("pending", ""):
                rec.outcome = "dropped"
                rec.why += " (dropped: the coordinator restarted)"


def _prediction_like(model: _Prediction, net: Network, grid: list[list[int]],
                     splits: list[int], flops: list[float],
                     agents: list[str] | None = None) -> _Prediction:
    from coordinator.job.machine import _Prediction

    return _Prediction(net=net, grid=grid, work=model.work, splits=list(splits),
                       agents=list(agents or model.agents), flops=flops)
