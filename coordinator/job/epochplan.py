"""Epoch planning: the layout, grid, layer split and H a new epoch trains on.

The job's state machine (`coordinator/job/machine.py`) calls in once per epoch: which layout
the agents it gathered can hold (`epoch_layout`, shrunk when agents are missing), where each
agent goes (`place`: the scheduler's search in a spawned process, then the step-time polish;
or a fixed placement, or the previous epoch's grid kept by `warm_grid`), how the layers are
cut (`choose_split`), and, for `--sync-every auto`, H (`choose_sync`). The re-planner
(`coordinator/job/replan.py`) calls `place` and `known_links` too, to weigh a move.

It keeps what the epoch runs on (the wanted and the current layout, the training config,
the grid by agent id, H and the step-time model); what the checkpoints hold lives in
`coordinator/job/checkpoints.py`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import secrets
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from coordinator.daemon.config import JobConfig
from coordinator.daemon.registry import AgentRecord
from coordinator.job.checkpoints import CheckpointTracker
from coordinator.job.prediction import Prediction, device_figures
from coordinator.job.recovery import layout_text
from coordinator.scheduler import Network, relay, sync_auto
from coordinator.scheduler.compute import (
    Devices,
    Workload,
    even_is_enough,
    plan_split,
)
from coordinator.scheduler.memory import check_fit, packs, stages_bytes
from coordinator.scheduler.placement import Placement, fixed_grid, score
from coordinator.scheduler.steptime import dp_shares
from dtfm.core.layout import Layout, layer_splits
from dtfm.core.shape import choose_layout, elastic_layout
from dtfm.core.spec import TrainConfig
from dtfm.net import reach
from dtfm.rpc import RENDEZVOUS_PORTS
from protos.dtfm.v1 import common_pb2

if TYPE_CHECKING:
    from coordinator.job.dataplane import AgentRoutes, Router
    from coordinator.scheduler.steptime import StepShape

log = logging.getLogger(__name__)


def search(delay: np.ndarray, bandwidth: np.ndarray, stages: int, replicas: int,
           dp_gb: float, pp_gb: float, seed: int, seconds: float, work: Workload,
           flops: list[float]) -> dict[str, Any]:
    """Runs in a worker process (the scheduler is pure numpy and CPU-bound): the paper's
    search, then its grid polished against the step model for half as long again
    (`placement.polished_grid`; `flops`: each agent's FLOP/s, 0 where unknown)."""
    from coordinator.scheduler import Network, search_plan
    from coordinator.scheduler.placement import polished_grid

    net = Network(delay_ms=delay, bandwidth_gbps=bandwidth)
    result = search_plan(net, stages=stages, replicas=replicas, dp_gb=dp_gb, pp_gb=pp_gb,
                         seed=seed, seconds=seconds, compression=work.compression)
    grid, before, after = polished_grid(net, result.grid, work, flops, seed,
                                        max(1.0, seconds / 2))
    return {"grid": grid, "seconds": result.seconds, "searched_step_s": before,
            "polished_step_s": after}


def split(delay: np.ndarray, bandwidth: np.ndarray, grid: list[list[int]], work: Workload,
          dev: Devices, move: bool, seconds: float) -> tuple[list[list[int]], list[int], str]:
    """Runs in a worker process: the grid and layer split for the devices' speed and memory."""
    placed = plan_split(Network(delay_ms=delay, bandwidth_gbps=bandwidth), grid, work, dev,
                        move=move, seconds=seconds)
    return placed.best.grid, placed.best.splits, placed.reason


def with_sync(train: TrainConfig, sync_every: int, replicas: int) -> TrainConfig:
    """`train` as an epoch of `replicas` replicas runs it at H = `sync_every` (0: auto not
    chosen yet, `train`'s own H kept): H = 1 leaves no round to delay an outer step into, so
    no `--outer-delay`, and replicas that average every step flush the pipeline every step,
    so no `--pipeline-delay` (agent/worker/delayed.py) unless there is one replica."""
    h = sync_every or train.sync_every
    return replace(train, sync_every=h, outer_delay=train.outer_delay if sync_every > 1 else 0,
                   pipeline_delay=train.pipeline_delay if h != 1 or replicas == 1 else 0)


class EpochPlanner:
    """What each epoch trains on, and how the job finds it."""

    def __init__(self, config: JobConfig, checkpoints: CheckpointTracker,
                 router: Router | None = None) -> None:
        self.config = config
        # which relay each relayed pair of a grid would meet at: the data plane's own choice
        # (`DataPlanes.router`), so the flows priced per relay are the flows run per relay;
        # None: not known (every relayed flow shares one uplink)
        self.router = router
        self.checkpoints = checkpoints
        self.job_id = ""  # for the log; the job sets it
        # Churn: the layout the job wants (set by its first epoch; replicas shrink below it when
        # agents are lost and grow back at a checkpoint), and this epoch's layout and training
        # config (more micro-batches per replica when shrunk)
        self.wanted: Layout | None = None
        self.layout: Layout | None = None
        self.train: TrainConfig = config.train
        # --sync-every: the job's H for its life; with auto (SYNC_AUTO) chosen on the first
        # plan (coordinator/scheduler/sync_auto.py), with the reason the plan shows
        self.sync_every, self.sync_note = config.train.sync_every, ""
        self.grid_ids: list[list[str]] = []  # this epoch's grid, stage x replica -> agent id
        self.model: Prediction | None = None  # this epoch's step-time model
        self._port_epoch, self._port = -1, 0
        # rendezvous ports not to draw: the daemon's other running jobs' (jobcalls.py)
        self.taken_ports: Callable[[], Collection[int]] = tuple
        # "from->to" links of the members that go through a relay (LinkMatrix.relayed), as
        # the epoch's links were gathered (coordinator/job/epochlinks.py): `place` prices each
        # relay's uplink shared among the grid's flows it carries (coordinator/scheduler/relay.py)
        self.relayed: list[str] = []
        # the relay each dial-only pair of this epoch meets at ({(agent, agent): a relay
        # agent's id or the coordinator's, coordinator/job/dataplane.py}): a re-plan prices
        # the running plan through these, not through the relay that is cheapest now
        self.relays: dict[tuple[str, str], str] = {}

    def plan_message(self, found: dict[str, Any], ids: list[str], placement: Placement,
                     epoch: int, predicted: Any) -> common_pb2.Plan:
        """The Plan status shows for an epoch placed as `found` (`predicted`: its step)."""
        assert self.layout is not None and self.model is not None
        return common_pb2.Plan(
            stages=self.layout.stages, replicas=self.layout.replicas,
            grid=[common_pb2.PlanStage(agent_ids=[ids[d] for d in row],
                                       dp_shares=found["dp_shares"][j] if found["dp_shares"]
                                       else [])
                  for j, row in enumerate(found["grid"])],
            cost=found["cost"], dp_cost=found["dp_cost"], pp_cost=found["pp_cost"],
            seconds=found["seconds"], algorithm=found["algorithm"], epoch=epoch,
            placement=placement.label, predicted_step_s=predicted.step_s,
            predicted_comm_s=self.model.comm_s, predicted_compute_s=predicted.compute_s,
            layer_splits=found["splits"], sync_every=self.sync_every,
            sync_note=self.sync_note,
            outer_delay=self.train.outer_delay,  # the epoch's: already 0 where H = 1
            pipeline_delay=self.train.pipeline_delay,  # the epoch's: 0 where replicas sync
        )

    def rendezvous_port(self, epoch: int) -> int:
        """Rank 0's store port for this epoch: drawn per epoch from 29500-30498 (even ports;
        the store's neighbour is left free), so a stranger cannot know it in advance; the
        assignment carries it. Never one `taken_ports` names (another job's running beside
        this one, whose rank 0 may share a host with this one's)."""
        if self._port_epoch != epoch:
            taken = set(self.taken_ports())
            free = [p for p in RENDEZVOUS_PORTS[::2] if p not in taken] or [RENDEZVOUS_PORTS[0]]
            self._port_epoch, self._port = epoch, free[secrets.randbelow(len(free))]
        return self._port

    @property
    def port(self) -> int:
        """The rendezvous port of the newest epoch (0 before any)."""
        return self._port

    def layout_text(self) -> str:
        return layout_text(self.layout.stages, self.layout.replicas) if self.layout else ""

    def choose_sync(self, net: Network, found: dict[str, Any], work: Workload,
                    flops: list[float], members: Sequence[AgentRecord], ids: list[str],
                    steps: int) -> Workload:
        """`--sync-every auto`, on the first plan: H by the step model on this grid
        (`sync_auto.choose`), checked to fit with the outer state H > 1 keeps per parameter.
        Raises `DoesNotFit`."""
        choice = sync_auto.choose(net, found["grid"], work, flops, found["splits"], steps,
                                  self.config.sync_overhead, measured=bool(
                                      self.config.measure_links or self.config.links_file))
        self.sync_every, self.sync_note = choice.every, choice.note
        log.info("job %s: --sync-every %s", self.job_id, choice.note)
        work = replace(work, sync_every=choice.every)
        dev = device_figures(list(members), self.config.train.dtype)
        check_fit(found["grid"], stages_bytes(work.memory(), found["splits"]), dev.memory,
                  names=ids, pools=dev.pools or None, moments_dtype=work.moments_dtype)
        return work

    def epoch_layout(self, members: Sequence[AgentRecord],
                     n_layers: int) -> tuple[Layout, TrainConfig]:
        """The first epoch's layout is the job's; later ones take fewer replicas, then fewer
        stages, when agents are missing (`elastic`), with more micro-batches each, so the
        global batch and the loss curve stay the same."""
        cfg = self.config
        if self.wanted is None:
            self.wanted = choose_layout(len(members), n_layers, cfg.stages, cfg.replicas)
            return self.wanted, cfg.train
        shrunk = self.elastic(members)
        assert shrunk is not None, "the job gathered agents no layout fits on"
        layout, micro = shrunk
        if layout == self.wanted:
            return layout, cfg.train
        return layout, replace(cfg.train, micro_batches=micro)

    def elastic(self, agents: Sequence[AgentRecord]) -> tuple[Layout, int] | None:
        """The layout `elastic_layout` picks for these agents, checked against their memory."""
        assert self.wanted is not None
        cfg = self.config
        dev = device_figures(list(agents), cfg.train.dtype)
        return elastic_layout(len(agents), self.wanted.stages, self.wanted.replicas,
                              cfg.train.global_batch, cfg.train.micro_batches,
                              fits=lambda layout, micro: self.fits(layout, micro, dev))

    def fits(self, layout: Layout, micro: int, dev: Devices) -> bool:
        """Whether `layout` with `micro` micro-batches per replica fits the devices' memory
        (0: unknown, taken to fit), agents on one machine sharing its memory: the kept split,
        or an even one when the stages are re-cut (`memory.packs`). `place` checks the
        placement it makes again (`check_fit`)."""
        cfg = self.config
        work = Workload(cfg.model_spec(), layout.stages, layout.replicas,
                        cfg.train.global_batch, micro, cfg.train.schedule, cfg.train.dtype,
                        moments_dtype=cfg.train.moments_dtype, sync_every=self.sync_every or 1,
                        outer_delay=cfg.train.outer_delay,
                        pipeline_delay=cfg.train.pipeline_delay,
                        lora_rank=cfg.train.lora_rank, lora_targets=cfg.train.lora_targets)
        trained = self.checkpoints.trained_splits
        kept = trained if trained and len(trained) == layout.stages else None
        needs = [n for n in stages_bytes(work.memory(), kept) for _ in range(layout.replicas)]
        return packs(needs, dev.memory.tolist(), dev.pools or None)

    def shrink_to(self, alive: Sequence[AgentRecord]) -> int:
        """How many of the `alive` agents a shrunk layout uses (0: wait for more instead)."""
        if self.wanted is None or len(alive) < (self.config.min_agents or self.config.agents):
            return 0
        shrunk = self.elastic(alive)
        return shrunk[0].stages * shrunk[0].replicas if shrunk else 0

    def warm_grid(self, layout: Layout, ids: list[str], placement: Placement,
                  planned: list[list[int]] | None, plan: common_pb2.Plan | None, epoch: int
                  ) -> tuple[list[list[int]], str] | None:
        """The previous epoch's grid when the same agents form the same layout again (a
        coordinator restart, a worker crash): no search, and every agent keeps the stage
        whose checkpoints it holds. A re-plan's move (coordinator/job/replan.py) brings its
        grid (`planned`). With it, how it was found (the plan's `algorithm`)."""
        if planned is not None and layout == Layout(len(planned), len(planned[0])):
            return planned, "re-planned on re-measured links (hybrid-ga + step-time polish)"
        if placement.kind != "scheduled" or len(self.grid_ids) != layout.stages:
            return None
        index = {a: i for i, a in enumerate(ids)}
        rows = [[index[a] for a in row if a in index][:layout.replicas]
                for row in self.grid_ids]
        newcomers = iter(sorted(set(range(len(ids))) - {d for row in rows for d in row}))
        for row in rows:  # a grow-back: new agents fill the new replicas (and fetch)
            row.extend(itertools.islice(newcomers, layout.replicas - len(row)))
        if any(len(row) != layout.replicas for row in rows):
            return None
        # kept: still say which search first found it (a user reading status after a restart)
        found = (plan.algorithm if plan is not None else "").split(", kept from")[0]
        return rows, (f"{found}, kept from epoch {epoch}" if found
                      else f"kept from epoch {epoch}")

    def known_links(self, ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The members' rows of the `--links` file (read again: it may have been refreshed)."""
        from coordinator.links.store import load_links_file

        obj = load_links_file(self.config.links_file)
        index = {a: i for i, a in enumerate(obj["agents"])}
        missing = [a for a in ids if a not in index]
        if missing:
            raise ValueError(f"--links {self.config.links_file} has no row for agent(s) "
                             f"{', '.join(missing)}: measure them with `coordinator links "
                             f"--measure --json`")
        members = set(ids)
        punched = [link for link in obj.get("punched", [])
                   if set(link.split("->")) <= members]
        if punched and not self.config.hole_punch:
            log.warning("--links %s prices %d links of the members direct through a hole "
                        "punch (%s), but this job runs with --hole-punch off: those pairs go "
                        "through the relay, slower than priced. Measure the links with the "
                        "coordinator started with --hole-punch off, or drop that flag",
                        self.config.links_file, len(punched), ", ".join(punched[:4]))
        rows = [index[a] for a in ids]
        pick = np.ix_(rows, rows)
        return (np.array(obj["delay_ms"], dtype=float)[pick],
                np.array(obj["bandwidth_gbps"], dtype=float)[pick])

    async def place(self, placement: Placement, net: Network, layout: Layout,
                    ids: list[str], work: Workload, dev: Devices,
                    flops: list[float], warm: tuple[list[list[int]], str] | None = None,
                    *, planned_splits: list[int] | None = None, epoch: int = 0
                    ) -> dict[str, Any]:
        """The grid (searched, then polished against the step model; or fixed), its layer
        split, and the paper's cost of the grid. `flops`: each agent's measured FLOP/s as
        reported (0: unknown), for the polish's compute; `planned_splits`: a re-plan's move's
        split; `epoch`: the job's epoch so far (a kept split's note names it).

        Raises `DoesNotFit` when some member cannot hold its stage under that split."""
        cfg = self.config
        from coordinator.scheduler import comm_gb

        dp_gb, pp_gb = comm_gb(work.spec, layout.stages, layout.replicas,
                               cfg.train.global_batch, dtype=cfg.train.dtype,
                               lora_rank=cfg.train.lora_rank, lora_targets=cfg.train.lora_targets)
        grid = warm[0] if warm else fixed_grid(placement, layout.stages, layout.replicas, ids)
        if warm is not None:
            found = {"grid": warm[0], "seconds": 0.0, "algorithm": warm[1]}
        elif grid is None:
            found = {**await self.in_pool(search, net.delay_ms, net.bandwidth_gbps,
                                          layout.stages, layout.replicas, dp_gb, pp_gb,
                                          cfg.seed, cfg.search_seconds, work, flops),
                     "algorithm": "hybrid-ga + step-time polish"}
            log.info("job %s: the step-time polish took the searched grid's predicted step "
                     "from %.3f s to %.3f s", self.job_id, found["searched_step_s"],
                     found["polished_step_s"])
        else:
            found = {"grid": grid, "seconds": 0.0, "algorithm": placement.kind}
        solo = net  # relayed links as for one flow alone: what the relay choice weighs
        net = self.relay_priced(solo, ids, found["grid"], self.relay_routes(
            solo, ids, found["grid"], layout, work.step_shape(planned_splits)), say=False)
        found["grid"], found["splits"], why = await self.choose_split(
            net, found["grid"], work, dev, move=grid is None, planned=planned_splits,
            epoch=epoch)
        # the split may move devices and changes what pairs move: the grid as it runs, its
        # relayed pairs routed as the data plane will run them (it takes these routes)
        found["routes"] = self.relay_routes(solo, ids, found["grid"], layout,
                                            work.step_shape(found["splits"]))
        net = self.relay_priced(solo, ids, found["grid"], found["routes"])
        found["net"] = net  # the links as this grid sees them: its prediction's
        found["split_note"] = f"{','.join(map(str, found['splits']))} ({why})"
        check_fit(found["grid"], stages_bytes(work.memory(), found["splits"]), dev.memory,
                  names=ids, pools=dev.pools or None, moments_dtype=work.moments_dtype)
        assert work.compression is not None
        found["codecs"] = work.compression.choose(net, found["grid"])  # per link, for auto
        found["dp_shares"] = None
        if work.dp_mode == "sharded" and layout.replicas > 1:
            found["dp_shares"] = dp_shares(net, found["grid"], work.step_shape(found["splits"]))
            log.info("job %s: data-parallel shares per stage (replica order): %s", self.job_id,
                     "; ".join(",".join(f"{x:.2f}" for x in row) for row in found["dp_shares"]))
        return {**found, **score(net, found["grid"], dp_gb, pp_gb, work.compression)}

    def relay_routes(self, net: Network, ids: list[str], grid: list[list[int]],
                     layout: Layout, shape: StepShape | None) -> AgentRoutes | None:
        """The relay each relayed pair of `grid` would meet at (by agent ids), as the data
        plane chooses it (`router`) on the solo-priced `net` and what a step moves
        (`shape`); None where not known (no router, no relayed link among the members)."""
        if self.router is None or not relay.mask(ids, self.relayed).any():
            return None
        ranked = [int(d) for d in layout.devices_by_rank(grid)]
        return self.router([ids[d] for d in ranked], (net, ranked, layout, shape))

    def relay_priced(self, net: Network, ids: list[str], grid: list[list[int]],
                     routes: dict[tuple[str, str], str] | None = None, *,
                     say: bool = True) -> Network:
        """`net` with each relay's uplink shared among the flows of `grid` it carries, by
        `routes` ({(agent, agent): relay}, either order; `relay_routes`, or a running
        epoch's `relays`): the search priced each relayed link as if it ran alone (two hops,
        the narrower one's rate). Without routes for every relayed flow of the grid, all of
        them share one uplink (exact with one relay). `say`: log the sharing."""
        mask = relay.mask(ids, self.relayed)
        if not mask.any():
            return net
        index = {a: i for i, a in enumerate(ids)}
        by_device = {(index[a], index[b]): via for (a, b), via in (routes or {}).items()
                     if a in index and b in index}
        per_relay = relay.flows_by_relay(grid, mask, by_device) if routes is not None else None
        flows = relay.relayed_flows(grid, mask)
        if say:
            at = ": " + ", ".join(
                f"{n} at {'the coordinator' if v == reach.COORDINATOR else 'agent ' + v}'s"
                for v, n in sorted(per_relay.items())) if per_relay else ""
            how = ("each gets its relay's rate over that relay's flows" if per_relay is not None
                   else f"which relay each takes is not known: each gets 1/{max(flows, 1)} of "
                   "a relayed link's rate, as through one uplink")
            log.info("job %s: %d of the grid's flows go through relays%s (%d relayed links "
                     "among the members); %s", self.job_id, flows, at, int(mask.sum()), how)
        return relay.priced_for(net, mask, grid, by_device if per_relay is not None else None)

    async def choose_split(self, net: Network, grid: list[list[int]], work: Workload,
                           dev: Devices, move: bool, planned: list[int] | None = None,
                           epoch: int = 0) -> tuple[list[list[int]], list[int], str]:
        """`--layer-split`: as given, even, or chosen for speed and memory (auto); `planned`:
        a re-plan's move's split for these stages."""
        cfg, n = self.config, work.spec.n_layers
        given = cfg.parsed_split()
        if given is not None and len(given) != work.stages:  # shrunk to fewer stages
            return grid, layer_splits(n, work.stages), (
                f"even: --layer-split {cfg.layer_split} is for {len(given)} stages")
        if cfg.layer_split != "auto":
            return grid, layer_splits(n, work.stages, given), cfg.layer_split
        if planned is not None:
            return grid, planned, "re-planned for the devices' measured speed"
        kept = self.checkpoints.trained_splits
        if kept is not None and len(kept) == work.stages:
            # checkpoints hold these layer ranges: the workers resume without re-cutting
            return grid, list(kept), f"kept from epoch {epoch}: checkpoints hold it"
        if even_is_enough(grid, work, dev):
            return grid, layer_splits(n, work.stages), "even: the devices are alike"
        return await self.in_pool(split, net.delay_ms, net.bandwidth_gbps, grid, work, dev,
                                  move, cfg.search_seconds)

    @staticmethod
    async def in_pool(fn: Any, *args: Any) -> Any:
        """Run a CPU-bound scheduler call in a spawned process (a fork of grpc is unsafe)."""
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

