"""What an agent exports to Prometheus (`agent start --metrics-listen HOST:PORT`).

Owns the agent's series names (docs/operations.md lists them): its session with the
coordinator and its worker's progress, read from the live session and supervisor at scrape
time on the agent's event loop (see `dtfm/metrics.py`). Every series carries an `agent`
label so it joins with the coordinator's `dtfm_worker_*` series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from agent.daemon.session import CoordinatorSession
from dtfm.core.workerstate import WorkerState
from protos.dtfm.v1 import common_pb2

# The supervisor's states: measuring belongs to the session, never to a worker process.
WORKER_STATES = tuple(s for s in WorkerState if s is not WorkerState.MEASURING)
STEP_PARTS = (("total", "step_s"), ("compute", "compute_s"), ("pipeline_wait", "pp_wait_s"),
              ("data_parallel", "dp_s"))


class AgentCollector(Collector):
    """Reads the agent's identity, session and worker progress on every scrape."""

    def __init__(self, info: common_pb2.AgentInfo,
                 session: Callable[[], CoordinatorSession | None]) -> None:
        self.info = info
        self.session = session

    def collect(self) -> Iterator[Metric]:
        agent = self.info.agent_id
        info = GaugeMetricFamily("dtfm_agent_info", "1, labelled with the agent's identity",
                                 labels=["agent", "device", "version"])
        info.add_metric([agent, self.info.device.kind, self.info.version], 1.0)
        session = self.session()
        connected = GaugeMetricFamily("dtfm_agent_connected", "1 while joined to the "
                                      "coordinator", labels=["agent"])
        connected.add_metric([agent], float(bool(session and session.connected)))
        yield from (info, connected)
        if session is not None:
            yield from self._worker(agent, session)

    def _worker(self, agent: str, session: CoordinatorSession) -> Iterator[Metric]:
        p = session.supervisor.progress
        state = GaugeMetricFamily("dtfm_agent_worker_state", "1 for the worker's current "
                                  "state, 0 for the others", labels=["agent", "state"])
        for name in WORKER_STATES:
            state.add_metric([agent, name.value], float(p.state is name))
        yield state
        for name, doc, value in (
            ("dtfm_agent_worker_epoch", "Job epoch the worker runs", p.epoch),
            ("dtfm_agent_worker_step", "Last step the worker finished", p.step),
            ("dtfm_agent_worker_loss", "Worker's last loss (last stage only)", p.loss),
            ("dtfm_agent_worker_tokens_per_second", "Worker's throughput", p.tokens_per_s),
        ):
            g = GaugeMetricFamily(name, doc, labels=["agent"])
            g.add_metric([agent], float(value))
            yield g
        split = GaugeMetricFamily("dtfm_agent_worker_step_seconds", "Last step time and where "
                                  "it went: compute, pipeline wait, data-parallel sync",
                                  labels=["agent", "part"])
        for part, attr in STEP_PARTS:
            split.add_metric([agent, part], getattr(p, attr))
        yield split
        sent = CounterMetricFamily("dtfm_agent_worker_sent_bytes", "Bytes the worker sent this "
                                   "epoch, as compressed on the wire, by traffic: pipeline "
                                   "(activations and their gradients) or data_parallel",
                                   labels=["agent", "traffic"])
        sent.add_metric([agent, "pipeline"], float(p.pp_bytes_sent))
        sent.add_metric([agent, "data_parallel"], float(p.dp_bytes_sent))
        yield sent


def agent_registry(info: common_pb2.AgentInfo,
                   session: Callable[[], CoordinatorSession | None]) -> CollectorRegistry:
    """A registry of its own (not the process-global default), so tests can run several."""
    out = CollectorRegistry()
    out.register(AgentCollector(info, session))
    return out
