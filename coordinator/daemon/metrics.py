"""What the coordinator exports to Prometheus (`coordinator start --metrics-listen HOST:PORT`).

Owns the series names and labels (docs/operations.md lists them). One collector reads the
registry, the running jobs, their plans and the link store at scrape time, on the event loop
(see `dtfm/metrics.py`), so the numbers are exactly what `coordinator status` would show then.
Jobs running side by side each have their own series, told apart by the `job_id` label.
Units are Prometheus base units: seconds and bytes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from coordinator.daemon.history import traffic_per_step
from coordinator.daemon.registry import ALIVE, STATE_NAMES, Registry
from coordinator.integrity.dispute import APART, CANNOT, PENDING
from coordinator.job.machine import Job
from coordinator.links.store import LinkStore
from protos.dtfm.v1 import coordinator_pb2

# a job, or (the daemon's) what returns the jobs running now
Jobs = Job | Callable[[], Job] | Callable[[], list[Job]]
JOB_STATES = [n.removeprefix("JOB_STATE_").lower() for n in coordinator_pb2.JobState.keys()
              if n != "JOB_STATE_UNSPECIFIED"]
# Per-link series go up to this many links (64 agents, all pairs); past it a scrape would carry
# N^2 series (4 of them per link: 260,000 lines and 20 s at 256 agents, bench/scale.py), so
# only the counts by state are exported and `coordinator links --json` has the matrix.
MAX_LINK_SERIES = 64 * 63
# The per-job gauges: (series, help, the JobStatus field), one sample per running job
JOB_GAUGES = (
    ("dtfm_job_epoch", "Job epoch (one per (re)schedule)", "epoch"),
    ("dtfm_job_step", "Newest step any member reported", "step"),
    ("dtfm_job_total_steps", "Steps the job runs", "total_steps"),
    ("dtfm_job_loss", "Training loss at the newest step", "loss"),
    ("dtfm_job_tokens_per_second", "Global tokens per second, from the measured step time",
     "tokens_per_s"),
    ("dtfm_job_predicted_step_seconds", "The cost model's step time for the running plan",
     "predicted_step_s"),
    ("dtfm_job_measured_step_seconds", "Median step time over the members' recent steps",
     "measured_step_s"),
    ("dtfm_job_state_save_failures", "Saves of the job's state in --state-dir that failed in "
     "a row (0: the newest worked; a restart adopts the last saved state)",
     "state_save_failures"),
    ("dtfm_job_state_saved_timestamp_seconds", "When the job's state was last saved in "
     "--state-dir (unix time; 0: never or no --state-dir)", "state_saved_unix_s"),
)
STEP_PARTS = (("total", "step_s"), ("compute", "compute_s"), ("pipeline_wait", "pp_wait_s"),
              ("data_parallel", "dp_s"))


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels or [])


class CoordinatorCollector(Collector):
    """Reads the coordinator's live objects on every scrape."""

    def __init__(self, registry: Registry, jobs: Jobs, links: LinkStore) -> None:
        self.registry = registry
        # the daemon's: the jobs running now, the oldest first (side by side, on disjoint
        # agents: coordinator/daemon/share.py), each with series of its own by `job_id`
        self._current = jobs
        self.links = links

    @property
    def jobs(self) -> list[Job]:
        jobs = self._current() if callable(self._current) else self._current
        return jobs if isinstance(jobs, list) else [jobs]

    def collect(self) -> Iterator[Metric]:
        yield from self._agents()
        yield from self._workers()
        yield from self._job()
        yield from self._plan()
        yield from self._links()

    def _agents(self) -> Iterator[Metric]:
        counts = _gauge("dtfm_cluster_agents", "Agents by liveness state", ["state"])
        records = self.registry.all()
        for code, name in STATE_NAMES.items():
            counts.add_metric([name], sum(r.state == code for r in records))
        up = _gauge("dtfm_agent_up", "1 while the agent's heartbeats arrive, else 0", ["agent"])
        age = _gauge("dtfm_agent_heartbeat_age_seconds", "Seconds since the agent's last "
                     "heartbeat", ["agent"])
        now = time.time()
        for r in records:
            up.add_metric([r.agent_id], float(r.state == ALIVE))
            age.add_metric([r.agent_id], max(0.0, now - r.last_seen))
        yield from (counts, up, age)

    def _workers(self) -> Iterator[Metric]:
        step = _gauge("dtfm_worker_step", "Last step the agent's worker reported", ["agent"])
        loss = _gauge("dtfm_worker_loss", "Worker's last loss (last stage only)", ["agent"])
        tokens = _gauge("dtfm_worker_tokens_per_second", "Worker's reported throughput",
                        ["agent"])
        split = _gauge("dtfm_worker_step_seconds", "Worker's last step time and where it went: "
                       "compute, waiting on pipeline neighbours, data-parallel sync",
                       ["agent", "part"])
        sent = CounterMetricFamily("dtfm_worker_sent_bytes", "Bytes the agent's worker sent "
                                   "this epoch as compressed on the wire, by traffic: pipeline "
                                   "or data_parallel", labels=["agent", "traffic"])
        per_step = _gauge("dtfm_worker_bytes_per_step", "Bytes the agent's worker sent per "
                          "step this epoch, by traffic: pipeline or data_parallel (local steps: "
                          "the sync points' bytes spread over their rounds)", ["agent", "traffic"])
        rounds = _gauge("dtfm_worker_sync_round", "Local steps (--sync-every > 1): the round "
                        "of the worker's last step", ["agent"])
        drift = _gauge("dtfm_worker_drift", "Local steps: the norm of the worker's "
                       "pseudo-gradient at the last sync point (how far its replica drifted)",
                       ["agent"])
        for r in self.registry.all():
            p = r.progress
            if not p.job_id:
                continue
            traffic = traffic_per_step(p)
            per_step.add_metric([r.agent_id, "pipeline"], traffic["pp_bytes_per_step"])
            per_step.add_metric([r.agent_id, "data_parallel"], traffic["dp_bytes_per_step"])
            if p.sync_every > 1:
                rounds.add_metric([r.agent_id], p.sync_round)
                drift.add_metric([r.agent_id], p.drift)
            step.add_metric([r.agent_id], p.step)
            loss.add_metric([r.agent_id], p.loss)
            tokens.add_metric([r.agent_id], p.tokens_per_s)
            for part, attr in STEP_PARTS:
                split.add_metric([r.agent_id, part], getattr(p, attr))
            sent.add_metric([r.agent_id, "pipeline"], float(p.pp_bytes_sent))
            sent.add_metric([r.agent_id, "data_parallel"], float(p.dp_bytes_sent))
        yield from (step, loss, tokens, split, sent, per_step, rounds, drift)

    def _job(self) -> Iterator[Metric]:
        jobs = [(job, job.status()) for job in self.jobs]
        state = _gauge("dtfm_job_state", "1 for the job's current state, 0 for the others",
                       ["job_id", "model", "state"])
        for _, status in jobs:
            current = coordinator_pb2.JobState.Name(status.state).removeprefix("JOB_STATE_")
            for name in JOB_STATES:
                state.add_metric([status.job_id, status.model, name],
                                 float(name == current.lower()))
        yield state
        jobs = [(job, status) for job, status in jobs if status.job_id]
        if not jobs:
            return
        for name, doc, field in JOB_GAUGES:
            g = _gauge(name, doc, ["job_id", "model"])
            for _, status in jobs:
                g.add_metric([status.job_id, status.model], float(getattr(status, field)))
            yield g
        restarts = CounterMetricFamily("dtfm_job_restarts", "Recoveries: times the job was "
                                       "stopped and rescheduled", labels=["job_id", "model"])
        relayed = CounterMetricFamily("dtfm_relay_forwarded_bytes", "Payload bytes the "
                                      "data-plane relays (the coordinator's, its relay agents') "
                                      "forwarded for the job since the coordinator started",
                                      labels=["job_id", "model"])
        for job, status in jobs:
            restarts.add_metric([status.job_id, status.model], len(job.recoveries.items))
            relayed.add_metric([status.job_id, status.model], float(status.relayed_bytes))
        # the relay's own, every job's together (they share it): the first job's figure
        refused = CounterMetricFamily("dtfm_relay_refused_bytes", "Bytes the relay read from "
                                      "connections it dropped (no key, not a member, a frame "
                                      "naming another job or rank): none is forwarded")
        refused.add_metric([], float(jobs[0][1].relay_refused_bytes))
        stale = CounterMetricFamily("dtfm_relay_stale_dials", "Dials the relay refused after "
                                    "their hello for an epoch it retired (members of an ending "
                                    "epoch, or of the epoch a restarted coordinator adopted): "
                                    "not intrusions, so not in dtfm_relay_refused_bytes")
        stale.add_metric([], float(jobs[0][0].dataplane.stale_dials))
        yield from (restarts, relayed, refused, stale)
        yield from self._replans(jobs)
        yield from self._integrity(jobs)

    def _integrity(self, jobs: list[tuple[Job, coordinator_pb2.JobStatus]]
                   ) -> Iterator[Metric]:
        """Agents each job excluded for a confirmed integrity fault, and the evidence held,
        by kind, every job's together (coordinator/integrity/)."""
        excluded = CounterMetricFamily("dtfm_integrity_exclusions", "Agents the job excluded "
                                       "for a confirmed integrity fault since it began",
                                       labels=["job_id", "model"])
        kinds: dict[str, int] = {}
        for job, status in jobs:
            ledger = job.integrity.ledger
            excluded.add_metric([status.job_id, status.model], float(ledger.total_exclusions))
            for agent_id in ledger.suspects():
                for e in ledger.evidence(agent_id):
                    kinds[e.kind] = kinds.get(e.kind, 0) + 1
        held = _gauge("dtfm_integrity_evidence", "Pieces of integrity evidence the "
                      "coordinator holds against agents, by kind", ["kind"])
        for kind, count in sorted(kinds.items()):
            held.add_metric([kind], float(count))
        disputes = _gauge("dtfm_integrity_disputes", "R = 2 disagreements the job remembers "
                          "(coordinator/integrity/dispute.py), by what was done: pending (to "
                          "be placed apart), apart, cannot (no placement parts the pair)",
                          ["job_id", "model", "done"])
        for job, status in jobs:
            done = [d.done for d in job.integrity.disputes.disputes]
            for state in (PENDING, APART, CANNOT):
                disputes.add_metric([status.job_id, status.model, state],
                                    float(done.count(state)))
        yield from (excluded, held, disputes)

    def _replans(self, jobs: list[tuple[Job, coordinator_pb2.JobStatus]]) -> Iterator[Metric]:
        """Every re-plan each job weighed (coordinator/job/replan.py), by outcome; the
        newest's predicted gain and cost, and the step it measured before, during and after."""
        count = CounterMetricFamily("dtfm_job_replans", "Re-plans weighed while training, by "
                                    "outcome (pending, moved, declined, dropped)",
                                    labels=["job_id", "model", "outcome"])
        g = _gauge("dtfm_job_replan_seconds", "The newest re-plan: predicted gain and cost of "
                   "moving, and the step before the drift, during it and after the move",
                   ["job_id", "model", "figure"])
        for job, status in jobs:
            labels, records = [status.job_id, status.model], job.replan.records
            for outcome in ("pending", "moved", "declined", "dropped"):
                count.add_metric([*labels, outcome], sum(r.outcome == outcome for r in records))
            if not records:
                continue
            last = records[-1]
            for figure, value in (("gain", last.gain_s), ("cost", last.cost_s),
                                  ("step_before", last.step_before_s),
                                  ("step_drifted", last.step_drifted_s),
                                  ("step_after", last.step_after_s)):
                g.add_metric([*labels, figure], value)
        yield count
        if g.samples:
            yield g

    def _plan(self) -> Iterator[Metric]:
        member = _gauge("dtfm_plan_member", "1 per agent of each running job's plan, labelled "
                        "with its stage and replica", ["job_id", "agent", "stage", "replica"])
        cost = _gauge("dtfm_plan_cost_seconds", "The scheduler's cost of each running job's "
                      "plan: total = dp + 2 x pp", ["job_id", "part"])
        predicted = _gauge("dtfm_plan_predicted_seconds", "The step-time model's prediction "
                           "for each running job's plan, by part", ["job_id", "part"])
        for job in self.jobs:
            plan = job.plan
            if plan is None or not plan.stages:
                continue
            for s, row in enumerate(plan.grid):
                for r, agent in enumerate(row.agent_ids):
                    member.add_metric([job.job_id, agent, str(s), str(r)], 1.0)
            for part, value in (("total", plan.cost), ("dp", plan.dp_cost),
                                ("pp", plan.pp_cost)):
                cost.add_metric([job.job_id, part], value)
            for part, value in (("step", plan.predicted_step_s),
                                ("comm", plan.predicted_comm_s),
                                ("compute", plan.predicted_compute_s)):
                predicted.add_metric([job.job_id, part], value)
        if member.samples:
            yield from (member, cost, predicted)

    def _links(self) -> Iterator[Metric]:
        entries = self.links.entries
        counts = _gauge("dtfm_links", "Measured directed links, by state", ["state"])
        counts.add_metric(["reachable"], sum(e.reachable for e in entries.values()))
        counts.add_metric(["unreachable"], sum(not e.reachable for e in entries.values()))
        counts.add_metric(["estimated"], sum(bool(e.estimate) for e in entries.values()))
        yield counts
        if len(entries) > MAX_LINK_SERIES:
            return
        delay = _gauge("dtfm_link_delay_seconds", "Measured one-way delay of a directed link",
                       ["src", "dst"])
        bandwidth = _gauge("dtfm_link_bandwidth_bytes_per_second", "Measured bandwidth of a "
                           "directed link", ["src", "dst"])
        reachable = _gauge("dtfm_link_reachable", "1 if the last measurement of the link "
                           "succeeded", ["src", "dst"])
        when = _gauge("dtfm_link_measured_timestamp_seconds", "Unix time of the link's last "
                      "measurement", ["src", "dst"])
        for (src, dst), e in sorted(self.links.entries.items()):
            pair = [src, dst]
            reachable.add_metric(pair, float(e.reachable))
            when.add_metric(pair, e.measured_unix_s)
            if e.reachable and math.isfinite(e.delay_ms):
                delay.add_metric(pair, e.delay_ms / 1e3)
            if e.reachable and math.isfinite(e.bandwidth_gbps):
                bandwidth.add_metric(pair, e.bandwidth_gbps * 1e9 / 8)
        yield from (delay, bandwidth, reachable, when)


def coordinator_registry(registry: Registry, jobs: Jobs, links: LinkStore
                         ) -> CollectorRegistry:
    """A registry of its own (not the process-global default), so tests can run several."""
    out = CollectorRegistry()
    out.register(CoordinatorCollector(registry, jobs, links))
    return out
