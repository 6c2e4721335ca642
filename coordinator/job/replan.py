"""Re-planning a running job when its network or devices drift, and only when it pays.

Owns what happens after the drift watch (`coordinator/job/drift.py`) fires, kept out of the
job's state machine (`coordinator/job/machine.py`), which calls in at four points: a new epoch
trains (`start_epoch`), a member reported a steady step (`observe`), the follow loop turns
(`tick`), and every member passed a fresh checkpoint (`move_reason`). It reads the job through
`ReplanHost` and the job's `EpochPlanner`, never the job's own state.

On a verdict it starts one background evaluation while the job trains on:

1. re-measure only what can explain the gap: a latency sweep of every member pair (pings are
   a few hundred bytes, paced) and the bandwidth of the links whose delay moved (one probe
   for each group that moved alike between the same two places, the rest inferred from it)
   or, where none moved, of the plan's links that touch the suspects, with short probes
   (`--remeasure-probe-seconds`), through the job's `LinkMeasurer` into the link store (with
   `--links FILE` the file is read again instead: whoever refreshes it); a relayed link's
   probe is replaced by its pair's hops to its relay agent, the hops to the coordinator's
   relay are measured by the sweep, and relayed links are priced again from them; the
   running plan is weighed with each relayed pair through the relay it meets at now
   (`as_routed`), a new one through the cheapest;
2. search and polish again on the updated matrix (the job's `EpochPlanner.place`), with a slowed
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
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from google.protobuf import json_format

from coordinator.daemon.config import JobConfig
from coordinator.daemon.registry import AgentRecord, Registry
from coordinator.job.drift import Drift, DriftWatch, Sample
from coordinator.job.epochplan import EpochPlanner, split
from coordinator.job.prediction import Prediction, agent_flops, device_figures
from coordinator.job.recovery import Recoveries
from coordinator.job.weigh import (
    changed_links,
    copy_seconds,
    grid_text,
    links_to_probe,
    move_verdict,
    probe_representatives,
    request_lead,
    settle_remeasured,
    through_relays,
    with_links,
)
from coordinator.links import relayed
from coordinator.links.infer import to_measure
from coordinator.links.measure import LinkMeasurer, Pings
from coordinator.links.store import LinkStore, matrix_arrays
from coordinator.scheduler import Network
from coordinator.scheduler.compute import Devices, tasklet_seconds
from coordinator.scheduler.memory import FP32, param_state_bytes
from dtfm.core.layout import layer_ranges
from dtfm.core.rounds import requested_checkpoint
from protos.dtfm.v1 import coordinator_pb2

log = logging.getLogger(__name__)

SPARES_TRIED = 2  # spares weighed in place of the member whose links degraded most
RESTART_OVERHEAD_S = 5.0  # stopping the members and planning, on top of a start-up's stall
# bandwidth probes at once while the job trains: each takes a link's capacity from the training
# traffic for its probe, so few at a time (bench/drift.py measures what they cost a step)
BACKGROUND_PROBES = 2
# pings per peer while the job trains, spread over one step or longer (measure.PING_RATE):
# enough that one of them likely falls between the job's bursts, few enough not to load the
# agents' event loops (10 within 2 s read 16 agents' links 51-76 ms long; 5, paced, 2-3 ms)
BACKGROUND_PINGS = 5


class ReplanHost(Protocol):
    """What the re-planner asks of the job it serves (`coordinator.job.machine.Job` is one).

    Through this and the job's `EpochPlanner` (its layout, grid by agent id, step-time model
    and H, and the search and split a move is planned with) the re-planner reads the running
    epoch; the job's own state stays the job's. The job calls the re-planner back at the four
    points the module docstring names."""

    config: JobConfig
    registry: Registry
    measurer: LinkMeasurer
    links: LinkStore
    recoveries: Recoveries
    planner: EpochPlanner
    job_id: str
    epoch: int
    members: list[str]

    @property
    def checkpoint_step(self) -> int: ...

    def last_step(self) -> int:
        """The newest step a member reported (the checkpoint's before any)."""
        ...

    def spares(self) -> list[AgentRecord]:
        """Live agents outside the job."""
        ...

    def recent_steps(self) -> Mapping[str, Sequence[coordinator_pb2.ProgressReport]]:
        """Each member's last few steady steps' reports."""
        ...

    def persist(self) -> None:
        """Save the job's state (with the re-planner's records) in the state directory."""
        ...

    def poke(self) -> None:
        """Wake the job's follow loop."""
        ...



class Replanner:
    """The job's drift watch and re-planning, one epoch at a time."""

    def __init__(self, job: ReplanHost) -> None:
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
            self._moving.grid_after = grid_text(self.job.planner.grid_ids)
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
        model = job.planner.model
        if model is None or job.planner.layout is None:
            return
        rec = coordinator_pb2.Replan(
            at_unix_s=time.time(), at_step=drift.at_step, trigger=drift.describe(),
            suspects=drift.suspects, step_before_s=drift.settled_s,
            step_drifted_s=drift.measured_s, grid_before=grid_text(job.planner.grid_ids))
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
        job.persist()
        job.poke()

    async def _weigh(self, rec: coordinator_pb2.Replan, drift: Drift,
                     model: Prediction) -> None:
        job = self.job
        ids = list(model.agents)
        started = time.monotonic()
        net = await self._remeasured(ids, model, drift)
        rec.measure_s = time.monotonic() - started
        running, net = self.as_routed(net, ids, model.grid)
        rec.links.extend(changed_links(model.net, running, ids, self.cfg.threshold))
        compute = self._compute_now(ids)
        flops = self._scaled_flops(model, drift)
        stay = _prediction_like(model, running, model.grid, model.splits, flops).predict(compute)
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
        figures = device_figures(records, job.config.train.dtype)
        dev = Devices.of(flops, figures.memory.tolist(), figures.pools or None)
        found = await job.planner.place(placement, net, job.planner.layout, ids, model.work,
                                        dev, flops, epoch=job.epoch)
        grid, splits = found["grid"], found["splits"]
        if drift.devices:  # a slower device: let the uneven-split planner take layers off it
            grid, splits, _ = await job.planner.in_pool(
                split, net.delay_ms, net.bandwidth_gbps, grid, model.work, dev, True,
                job.config.search_seconds)
        routes = job.planner.relay_routes(net, ids, grid, job.planner.layout,
                                          model.work.step_shape(splits))
        new = _prediction_like(model, job.planner.relay_priced(net, ids, grid, routes), grid,
                               splits, flops).predict(
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
        step = requested_checkpoint(job.checkpoint_step, job.last_step(), lead,
                                    train.checkpoint_every, job.planner.sync_every or 1,
                                    train.steps)
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

    async def _with_spares(self, rec: coordinator_pb2.Replan, model: Prediction,
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
        if not touched or job.planner.layout is None:
            return []
        worst = max(touched, key=lambda a: touched[a])
        if touched[worst] < 2 or worst not in model.agents:
            return []
        at = model.agents.index(worst)
        out = []
        for spare in job.spares()[:SPARES_TRIED]:
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
                found = await job.planner.place(job.config.parsed_placement(), net,
                                                job.planner.layout, ids, model.work, dev,
                                                spare_flops, epoch=job.epoch)
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
                delay, bandwidth = job.planner.known_links(ids)
            except ValueError:
                return None
        elif job.config.measure_links and job.links.complete_for(ids):
            delay, bandwidth = matrix_arrays(job.links.matrix(ids))
        else:
            return None
        return Network.measured(delay, bandwidth)

    async def _remeasured(self, ids: list[str], model: Prediction, drift: Drift) -> Network:
        """The members' links as they are now: the `--links` file read again, or a latency
        sweep and then the bandwidth of the links `links_to_probe` picks from it, measured in
        the background. Each
        peer's pings are spread over one (drifted) step: pings fired together queue behind the
        job's bursts and read links tens of milliseconds longer than they are (bench/drift.py:
        93 of 95 links read as changed were delays, where one city pair had changed)."""
        job = self.job
        if job.config.links_file:
            delay, bandwidth = job.planner.known_links(ids)
        elif job.config.measure_links and len(ids) > 1:
            records = [r for a in ids if (r := job.registry.get(a)) is not None]
            swept = await job.measurer.measure(records, bandwidth_links=set(),
                                               pings=Pings(BACKGROUND_PINGS, drift.measured_s))
            sweep = settle_remeasured(model.net, *matrix_arrays(swept), self.cfg.threshold)
            delay_moved = sweep.delay_moved
            links = through_relays(
                links_to_probe(model.grid, ids, delay_moved, set(drift.links) or set(ids)),
                {(a, b) for a, _, b in (n.partition("->") for n in job.planner.relayed)},
                job.planner.relays, relayed.RELAY)
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

    def as_routed(self, net: Network, ids: list[str], grid: list[list[int]]
                      ) -> tuple[Network, Network]:
        """The re-measured links as the running plan pays for them, and as a new plan would.

        A relayed link's figure in the store is its cheapest relay's (re-priced by the
        re-measurement from the hops it just measured), but the running epoch's pairs meet at
        the relays its data plane chose (`EpochPlanner.relays`): when that relay slowed, the
        running plan pays its slow hops until the job moves, and pricing it through the
        cheapest would predict staying as fast as moving. So: the running plan with each
        relayed link through its pair's relay, each relay's uplink shared by the flows it
        carries, as the epoch's prediction had them; and `net` with each relayed link at the
        cheapest relay's price, which the next epoch's data plane chooses afresh
        (`DataPlanes.plan`)."""
        planner, store = self.job.planner, self.job.links
        links = [(a, b) for a, _, b in (name.partition("->") for name in planner.relayed)]

        def routed(base: Network, routes: dict[tuple[str, str], str] | None) -> Network:
            figures = relayed.relayed_figures(store, links, routes)
            return with_links(base, ids, {k: (p.delay_ms, p.gbps) for k, p in figures.items()})

        cheapest = routed(net, None)
        running = routed(cheapest, planner.relays)
        return planner.relay_priced(running, ids, grid, planner.relays), cheapest

    def _compute_now(self, ids: list[str]) -> dict[str, float]:
        """Each member's compute per step over the recent steps."""
        out = {}
        for agent, steps in self.job.recent_steps().items():
            if agent in ids and steps:
                out[agent] = statistics.median(r.compute_s for r in steps)
        return out

    @staticmethod
    def _compute_for(compute: dict[str, float], model: Prediction, grid: list[list[int]],
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
    def _scaled_flops(model: Prediction, drift: Drift) -> list[float]:
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
    def _stage_checkpoint_bytes(model: Prediction) -> list[int]:
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


def _prediction_like(model: Prediction, net: Network, grid: list[list[int]],
                     splits: list[int], flops: list[float],
                     agents: list[str] | None = None) -> Prediction:
    return Prediction(net=net, grid=grid, work=model.work, splits=list(splits),
                       agents=list(agents or model.agents), flops=flops)
