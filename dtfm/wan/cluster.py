"""A dtfm cluster inside an emulated WAN: a coordinator and agents, each in its own host.

Host 0 holds the coordinator (zero delay and no rate limit to everyone by default, so control
traffic does not distort what is measured; `measurement_wan(coordinator_link=)` gives it a
cost); hosts 1..N hold one agent each, with the link matrix the caller gives. Processes are
started through the real command lines, so this rehearses exactly what a deployment runs.
Used by the link-measurement tests and `bench/links.py`.

Agents may sit behind NATs or firewalls (`measurement_wan(..., nat=, shared_nat=, firewall=)`,
in agent numbers): such an agent listens and advertises at its own address as a real one would
(behind a NAT: a private 192.168.1.x that agents behind other NATs share), so agents are told
apart by id, never by address.
"""

from __future__ import annotations

import collections
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from dtfm.procs import terminate_all
from dtfm.wan.harness import WanEmulator
from dtfm.wan.statuswatch import StatusWatch

COORDINATOR_PORT = 7070
AGENT_PORT = 7071
# Hosts tuned as deploy/sysctl.d/60-dtfm-wan.conf tunes agents: big socket buffers so links
# with a large bandwidth-delay product are not window-limited, and no slow start after the
# idle gaps between a step's bursts of traffic.
BUFFER_SYSCTLS = {
    "net.ipv4.tcp_rmem": "4096 131072 33554432",
    "net.ipv4.tcp_wmem": "4096 131072 33554432",
    "net.ipv4.tcp_slow_start_after_idle": "0",
}

# Jumbo frames for clusters whose links get measured: TCP ramps up and counts packets much as
# it does at the Internet's 1500 bytes, and a slow link's rate over a probe window is not
# quantized into a handful of 64 KB packets (5 Mbit/s is 5 of them per half second), while the
# forwarder still handles few enough packets per second.
MEASURED_MTU = 9000


def measurement_wan(delay_ms: Sequence[Sequence[float]],
                    bandwidth_mbps: Sequence[Sequence[float]], *, nat: Sequence[int] = (),
                    shared_nat: Sequence[Sequence[int]] = (),
                    firewall: Sequence[int] = (),
                    coordinator_link: tuple[float, float | None] = (0.0, None)) -> WanEmulator:
    """An emulator for a cluster whose links get measured: agents on hosts 1..N with the given
    links, the coordinator on host 0 with free links to everyone (or, `coordinator_link`, a
    delay in ms and a rate in Mbit/s each way to every agent: a relay on the coordinator that
    costs something, as a real one does), tuned hosts (BUFFER_SYSCTLS) and jumbo frames
    (MEASURED_MTU). `nat` (each behind a NAT of its own), `shared_nat` (groups behind one
    NAT) and `firewall` name agents by number (agent i is host i + 1); the coordinator stays
    public."""
    n = len(delay_ms)
    hop_ms, hop_mbps = float(coordinator_link[0]), coordinator_link[1]
    delay = [[0.0] + [hop_ms] * n] + [[hop_ms, *map(float, row)] for row in delay_ms]
    bandwidth: list[list[float | None]] = [[None] + [hop_mbps] * n] + [
        [hop_mbps, *map(float, row)] for row in bandwidth_mbps]
    return WanEmulator(delay_ms=delay, bandwidth_mbps=bandwidth, sysctls=BUFFER_SYSCTLS,
                       mtu=MEASURED_MTU, nat=[_agent_host(a, n) for a in nat],
                       shared_nat=[[_agent_host(a, n) for a in g] for g in shared_nat],
                       firewall=[_agent_host(a, n) for a in firewall])


def _agent_host(agent: int, agents: int) -> int:
    if not 0 <= agent < agents:
        raise ValueError(f"agent {agent} is not one of the agents 0..{agents - 1}")
    return agent + 1


class WanCluster:
    def __init__(self, wan: WanEmulator, workdir: Path, agents: int,
                 coordinator_args: Sequence[str] = (), agent_args: Sequence[str] = (),
                 agent_modules: Mapping[int, str] = MappingProxyType({})) -> None:
        self.wan = wan
        self.workdir = workdir
        self.agents = agents
        self.token = secrets.token_hex(16)
        self.coordinator_args = list(coordinator_args)
        self.agent_args = list(agent_args)  # extra `agent start` flags, for every agent
        # agent i runs `python -m MODULE start ...` instead of `agent` (a test's patched one)
        self.agent_modules = dict(agent_modules)
        # agent i's own environment on top of `env()` (a bench's one bad agent: DTFM_FAULT)
        self.agent_env: dict[int, dict[str, str]] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.agent_procs: list[subprocess.Popen[bytes]] = []
        self.coordinator_proc: subprocess.Popen[bytes] | None = None
        self.watch = StatusWatch(lambda argv, **kw: wan.popen(0, argv, **kw),
                                 ["--coordinator", self.coordinator_address], self.env())

    @property
    def coordinator_address(self) -> str:
        return f"{self.wan.address(0)}:{COORDINATOR_PORT}"

    def env(self) -> dict[str, str]:
        """The daemons' environment. Every emulated host shares this machine's few cores, so
        each worker computes on one thread: N workers with a thread per core each would
        oversubscribe the cores and starve the emulator's forwarder, adding delay that no real
        link has."""
        return {**{k: v for k, v in os.environ.items() if not k.startswith("DTFM_")},
                "DTFM_TOKEN": self.token, "PYTHONUNBUFFERED": "1", "DTFM_NUM_THREADS": "1",
                "OMP_NUM_THREADS": "1"}

    def _spawn(self, host: int, argv: Sequence[str], name: str,
               extra_env: Mapping[str, str] = MappingProxyType({})) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - owned by the process
        # the host's workers read their compute factor here: `wan.live.set_compute` slows them live
        env = {**self.env(), "DTFM_COMPUTE_SLOWDOWN_FILE": self.wan.live.compute_file(host),
               **extra_env}
        proc = self.wan.popen(host, [sys.executable, "-m", *argv], stdout=log,
                              stderr=subprocess.STDOUT, env=env)
        log.close()
        self.procs.append(proc)
        return proc

    def start(self, timeout: float = 60.0, prewarm: bool = True) -> list[str]:
        """Start everything; return agent ids in host order (agent i is on host i + 1).

        `prewarm=False` starts the agents without their spare workers. The benchmarks that
        measure links or steady steps keep it to compare with their earlier runs: before a
        waiting spare lowered its session's autogroup (agent.worker), N spares importing
        torch on this machine's shared cores inflated the agents' round trips until the two
        ends of a pair disagreed and the pair was dropped as contradictory."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._start_coordinator()
        self._start_agents(prewarm)
        return self._wait_agents(timeout)

    def _start_coordinator(self, log_name: str = "coordinator") -> None:
        self.coordinator_proc = self._spawn(0, [
            "coordinator", "start", "--listen", self.coordinator_address,
            "--liveness-timeout", "10", *self.coordinator_args], log_name)

    def kill_coordinator(self, restart_log: str = "") -> None:
        """SIGKILL the coordinator (and with it the relay it hosts), as a crash would; with
        `restart_log`, start it again at once with the same flags (a `--state-dir` among
        them lets it adopt the job), logging to `restart_log`.log."""
        proc = self.coordinator_proc
        if proc is None:
            raise RuntimeError("no coordinator was started: call start() first")
        proc.kill()
        proc.wait(10)
        if restart_log:
            self._start_coordinator(restart_log)

    def _start_agents(self, prewarm: bool) -> None:
        for i in range(self.agents):
            self.agent_procs.append(self.start_agent(i, prewarm))

    def start_agent(self, i: int, prewarm: bool = True, log_name: str = "") -> \
            subprocess.Popen[bytes]:
        """Start agent i on its host and state directory (again, after a kill: it keeps its
        id and checkpoints), logging to `log_name`.log (agent-i.log by default)."""
        host = i + 1
        return self._spawn(host, [
            self.agent_modules.get(i, "agent"), "start",
            "--coordinator", self.coordinator_address,
            "--listen", f"{self.wan.address(host)}:{AGENT_PORT}", "--device", "cpu",
            "--state-dir", str(self.workdir / f"agent-{i}"),
            *([] if prewarm else ["--no-prewarm"]), *self.agent_args], log_name or f"agent-{i}",
            self.agent_env.get(i, {}))

    def _wait_agents(self, timeout: float) -> list[str]:
        """Agent ids in host order once every agent has joined."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.status()
            if status is None:
                time.sleep(0.5)
                continue
            alive = {a["id"] for a in status["agents"] if a["state"] == "alive"}
            ids = [self.agent_id(i) for i in range(self.agents)]
            if all(i in alive for i in ids):
                return [str(i) for i in ids]
            time.sleep(0.5)
        raise RuntimeError(f"agents did not all join within {timeout} s; logs in {self.workdir}")

    def agent_id(self, i: int) -> str | None:
        """Agent i's id, from its state directory once it has started (by id, not address:
        agents behind different NATs may advertise the same private address)."""
        # the agent's id file (agent.identity.ID_FILE); dtfm.wan imports no agent code
        path = self.workdir / f"agent-{i}" / "agent-id"
        try:
            return path.read_text().strip() or None
        except OSError:
            return None

    def stop(self) -> None:
        """Stop the coordinator and agents (their workers die with them); the WAN stays up,
        and agents started again with the same work dir keep their ids."""
        self.watch.close()
        terminate_all(self.procs, grace_s=15.0, group=False)
        self.procs.clear()
        self.agent_procs.clear()

    def run_to_end(self, timeout: float, start_timeout: float = 90.0
                   ) -> tuple[list[str], dict[str, Any]]:
        """Start the cluster, wait for its job to end (`wait_job`), stop it whatever
        happened; the agents' ids and the last status."""
        try:
            ids = self.start(timeout=start_timeout)
            return ids, self.wait_job(timeout)
        finally:
            self.stop()

    def status(self) -> dict[str, Any] | None:
        """`coordinator status --json` (from a watcher kept running on host 0: `StatusWatch`),
        or None while the coordinator does not answer (not listening yet, restarting, or slow
        under load)."""
        return self.watch.status(timeout=15)

    def wait_job(self, timeout: float, on_status: Any = None) -> dict[str, Any]:
        """Poll `coordinator status` until the job is done or failed; return the last status.

        `on_status(status)` sees every poll (for progress lines)."""
        deadline = time.monotonic() + timeout
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            got = self.status()
            if got is None:
                time.sleep(1.0)
                continue
            status = got
            if on_status is not None:
                on_status(status)
            if status["job"]["state"] in ("done", "failed"):
                return status
            time.sleep(1.0)
        raise TimeoutError(f"the job did not finish within {timeout:.0f} s (last state "
                           f"{status.get('job', {}).get('state')}); logs in {self.workdir}")

    def train(self, job_args: Sequence[str], placement: str, links: Path, timeout: float,
              on_status: Any = None, prewarm: bool = True, max_restarts: int = 0
              ) -> dict[str, Any]:
        """Start the cluster with a job under `placement` on the measured matrix `links`, wait
        for it to end, stop the cluster; return what the coordinator reported about it.

        `job_args`: the job's own flags (--model, --agents, --stages, --steps, ...).
        `prewarm=False`: agents without spare workers. A benchmark of steady steps wants that
        here: each agent starts its next spare after its worker's first step, and N spares
        importing torch on this machine's shared cores slow the steps being measured (on
        real hosts a spare shares only its own machine).
        `max_restarts`: 0 for a benchmark, whose timing a recovery would blur; a demo lets the
        job recover as a user's job would, and its result says how often it did."""
        self.coordinator_args = [*job_args, "--placement", placement, "--links", str(links),
                                 "--max-restarts", str(max_restarts)]
        self.start(prewarm=prewarm)
        started = time.monotonic()
        marks: dict[str, float] = {}

        def watch(status: dict[str, Any]) -> None:
            now = time.monotonic() - started
            if status["job"]["state"] == "running":
                marks.setdefault("running", now)
            if status["job"]["step"] >= 1:
                marks.setdefault("first_step", now)
            if on_status is not None:
                on_status(status, now)

        try:
            status = self.wait_job(timeout, watch)
            ended = time.monotonic() - started
        finally:
            self.stop()
        job, plan = status["job"], status["plan"] or {}
        if job["state"] != "done":
            raise RuntimeError(f"{placement}: the job {job['state']}: {job['message']} "
                               f"(logs in {self.workdir})")
        workers = [a["worker"] for a in status["agents"] if a["worker"]["step_s"]]
        split = {k: statistics.median(w[k] for w in workers)
                 for k in ("step_s", "compute_s", "pp_wait_s", "dp_s")} if workers else {}
        # bytes per step by traffic kind, summed over the job's workers: their own counters
        # (ProgressReport.dp_bytes_sent / pp_bytes_sent over the steps they ran)
        traffic = {k: sum(w[k] for w in workers if w["job_id"] == job["id"])
                   for k in ("dp_bytes_per_step", "pp_bytes_per_step")}
        return {
            "placement": placement, "grid": plan.get("grid"),
            "dp_shares": plan.get("dp_shares"), "cost": plan.get("cost"),
            "dp_cost": plan.get("dp_cost"), "pp_cost": plan.get("pp_cost"),
            "predicted_step_s": job["predicted_step_s"],
            "predicted_breakdown": plan.get("predicted_breakdown"),
            "predicted_comm_s": plan.get("predicted_comm_s"),
            "measured_step_s": job["measured_step_s"], "tokens_per_s": job["tokens_per_s"],
            "loss": job["loss"], "worker_split_median": split, **traffic,
            # what the job recovered from (only where `max_restarts` let it): a result that
            # shows a recovery's stall in its time says so
            "recoveries": [{k: r.get(k) for k in ("reason", "steps_lost", "stalled_s",
                                                  "last_step", "resumed_step")}
                           for r in job.get("recoveries", []) if not r.get("planned")],
            "val_loss": job.get("val_loss"), "val_step": job.get("val_step"),
            # the agents the integrity checks excluded (a bench's bad agent; nobody honest)
            "excluded": {a["id"]: {"reason": a["exclusion"]["reason"],
                                   "step": a["exclusion"]["step"]}
                         for a in status["agents"] if a.get("exclusion")},
            # every agent's evidence shown, by kind (the bad agent's, and any honest one's)
            "evidence": {a["id"]: dict(collections.Counter(e["kind"] for e in a["evidence"]))
                         for a in status["agents"] if a.get("evidence")},
            # what the coordinator's relay forwarded for the job, and the steps it ran
            # (bench/reach.py reports relayed bytes per step from these)
            "relayed_bytes": job["relay"]["forwarded_bytes"], "steps_trained": job["step"],
            # a job on a steady network should weigh no re-plan: benchmarks count them
            "replans": [{k: r[k] for k in ("at_step", "decision", "outcome", "trigger")}
                        for r in job.get("replans", [])],
            "trained_s": ended - marks["first_step"] if "first_step" in marks else None,
            "assignment_to_first_step_s": (marks["first_step"] - marks["running"]
                                           if {"first_step", "running"} <= marks.keys()
                                           else None),
        }

    def cli(self, *args: str, timeout: float = 30.0) -> Any:
        """Run `coordinator ARGS --coordinator ...` from host 0; parse its JSON output."""
        out = subprocess.run(
            self.wan.command(0, [sys.executable, "-m", "coordinator", *args,
                                 "--coordinator", self.coordinator_address]),
            capture_output=True, text=True, env=self.env(), timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"coordinator {' '.join(args)} failed: {out.stderr.strip()}")
        return json.loads(out.stdout)

    def measure(self, timeout: float = 600.0, sampled: bool = False,
                ping_spread_s: float = 0.0) -> dict[str, Any]:
        """`coordinator links --measure` (`sampled`: bandwidth for representatives of
        latency clusters, the rest inferred; `ping_spread_s`: `--ping-spread`)."""
        return self.cli("links", "--measure", "--json", "--timeout", str(timeout),
                        *(["--sampled"] if sampled else []),
                        *(["--ping-spread", str(ping_spread_s)] if ping_spread_s else []),
                        timeout=timeout + 30)
