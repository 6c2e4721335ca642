"""Benchmark: how one coordinator holds N agents, shown with simulated ones (issue 46).

For each `--agents N` it starts a real `coordinator start` (a gpt-tiny job over all N agents,
--state-dir, --metrics-listen) and a few processes of simulated agents (agent/sim/): each
speaks the real gRPC API, answers link probes from a world of sites drawn from `--seed`
(which the coordinator is not told), taking as long as the real probe would, and trains at
the pace of the plan's step model. It measures, from the agents' events and the
coordinator's log:

- join_s: from the first welcome until all N are registered;
- measure_s: the job's (sampled) link measurement; plan_s: placing all N, with the plan's
  cost and rank order's on the true world (plan_vs_rank: their ratio);
- assign_s: from the plan until every member holds its assignment; train_s: until every
  member has trained a step;
- heartbeat_cpu: the coordinator's CPU in cores over HEARTBEAT_WINDOW_S while the job trains;
- status_s: GetStatus and its JSON (as `coordinator status --json` builds it), status_cli_s:
  the command itself (a Python start-up included); metrics_s: one Prometheus scrape;
- recover_s: 5 % of the members vanish at once, until the new epoch's members all train;
- restart_s: the coordinator stopped and started again on its --state-dir, until every
  member has reported to it and the job trains on;
- rss_mib: the coordinator's peak resident memory (VmHWM, both processes).

Prints progress while it runs, a table at the end, and writes a JSON list (one object per N).
Run: `python bench/scale.py --agents 64 256 1000 --seed 7 --out bench/results/scale.json`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python bench/scale.py`
    sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from agent.sim.agent import agent_index  # noqa: E402
from agent.sim.driver import Swarms  # noqa: E402
from agent.sim.world import World  # noqa: E402
from coordinator.daemon.pace import HeartbeatPace  # noqa: E402
from coordinator.daemon.statusjson import status_to_json  # noqa: E402
from coordinator.scheduler import Network  # noqa: E402
from coordinator.scheduler.costmodel import comm_gb, plan_cost  # noqa: E402
from coordinator.scheduler.placement import rank_order_grid  # noqa: E402
from dtfm import rpc  # noqa: E402
from dtfm.core.presets import get_preset  # noqa: E402
from dtfm.procs import terminate_all, wait_for  # noqa: E402
from protos.dtfm.v1 import coordinator_pb2, coordinator_pb2_grpc  # noqa: E402

TOKEN = "scale-bench-token-0123456789"
MODEL, STAGES = "gpt-tiny", 4  # its 4 layers, one a stage
HEARTBEAT_WINDOW_S = 20.0
LOST_SHARE = 0.05
KEYS = ("join_s", "heartbeat_cpu", "measure_s", "plan_s", "plan_vs_rank", "assign_s",
        "status_s", "metrics_s", "recover_s", "replan_s", "restart_s", "rss_mib")
AUTH = (("authorization", f"Bearer {TOKEN}"),)
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def say(*parts: object) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


class CoordinatorLog:
    """Follows a coordinator's log file on a thread, keeping (unix time, line) of each line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[tuple[float, str]] = []
        self._stop = False
        threading.Thread(target=self._follow, daemon=True).start()

    def _follow(self) -> None:
        while not self.path.exists() and not self._stop:
            time.sleep(0.05)
        with open(self.path, errors="replace") as f:
            while not self._stop:
                line = f.readline()
                if not line:
                    time.sleep(0.05)
                    continue
                m = STAMP.match(line)
                t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() \
                    if m else time.time()
                self.lines.append((t, line.rstrip()))

    def first(self, pattern: str, after: float = 0.0) -> float | None:
        """When the first line matching `pattern` at or after `after` was logged."""
        rx = re.compile(pattern)
        return next((t for t, line in list(self.lines) if t >= after and rx.search(line)), None)

    def wait(self, pattern: str, after: float, timeout: float) -> float:
        return wait_for(lambda: self.first(pattern, after), timeout, f"log line /{pattern}/")

    def close(self) -> None:
        self._stop = True


class Coordinator:
    """One `coordinator start` process of the benchmark, with its log and /proc figures."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str],
                 profile: Path | None = None) -> None:
        self.log_file = open(log, "ab")  # noqa: SIM115 - closed in stop()
        python = [sys.executable, *(("-m", "cProfile", "-o", str(profile)) if profile else ())]
        self.proc = subprocess.Popen([*python, "-m", "coordinator", "start", *args],
                                     stdout=self.log_file, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.started = time.time()
        self.peak_kib = 0

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def hwm_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                self.peak_kib = max(self.peak_kib, int(line.split()[1]))
        return self.peak_kib

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.hwm_kib()
        terminate_all([self.proc], grace_s=20.0)
        self.log_file.close()


class Stub:
    """The coordinator's blocking stub, each call carrying the token."""

    def __init__(self, stub: coordinator_pb2_grpc.CoordinatorStub) -> None:
        self._stub = stub

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        return lambda request, **kw: method(request, metadata=AUTH, **kw)


def batch(n: int) -> int:
    """The global batch: two micro-batches for each replica, and divisible by the replicas
    left after LOST_SHARE are lost (the job keeps its batch on fewer replicas only where it
    divides, `dtfm.core.shape.elastic_layout`)."""
    replicas = n // STAGES
    return 2 * math.lcm(replicas, (n - max(1, round(LOST_SHARE * n))) // STAGES)


def plan_of(stub: Stub, epoch_above: int = 0,
            timeout: float = 600.0) -> Any:
    def ready() -> Any:
        try:
            plan = stub.GetPlan(coordinator_pb2.PlanRequest(), timeout=30)
        except grpc.RpcError:
            return None
        return plan if plan.epoch > epoch_above and plan.stages else None
    return wait_for(ready, timeout, f"a plan of an epoch after {epoch_above}", interval=0.5)


def true_costs(world: World, plan: Any) -> tuple[float, float]:
    """The plan's cost and rank order's (agents in address order) on the world's true links,
    by the paper's cost model."""
    ids = sorted((a for row in plan.grid for a in row.agent_ids), key=agent_index)
    order = [agent_index(a) for a in ids]
    delay, bandwidth = world.matrices(order)  # type: ignore[arg-type]
    net = Network(delay_ms=delay, bandwidth_gbps=bandwidth)
    dp_gb, pp_gb = comm_gb(get_preset(MODEL), plan.stages, plan.replicas, batch(len(world)))
    at = {a: i for i, a in enumerate(ids)}
    grid = [[at[a] for a in row.agent_ids] for row in plan.grid]
    planned = plan_cost(net, grid, dp_gb, pp_gb)[0]
    ranked = plan_cost(net, rank_order_grid(plan.stages, plan.replicas), dp_gb, pp_gb)[0]
    return planned, ranked


def timed_status(stub: Stub, address: str,
                 env: dict[str, str], metrics: str) -> dict[str, float]:
    t = time.monotonic()
    status_to_json(stub.GetStatus(coordinator_pb2.StatusRequest(), timeout=60))
    status_s = time.monotonic() - t
    t = time.monotonic()
    subprocess.run([sys.executable, "-m", "coordinator", "status", "--coordinator", address,
                    "--json"], env=env, check=True, capture_output=True, timeout=120)
    cli_s = time.monotonic() - t
    t = time.monotonic()
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=60) as r:
        size = len(r.read())
    return {"status_s": status_s, "status_cli_s": cli_s, "metrics_s": time.monotonic() - t,
            "metrics_bytes": size}


def run_one(n: int, seed: int, processes: int, tmp: Path, profile: Path | None = None,
            own_relay_port: bool = False, heartbeat: tuple[float, float] | None = None
            ) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTFM_")}
    env.update(DTFM_TOKEN=TOKEN, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    address, metrics = f"127.0.0.1:{rpc.free_port()}", f"127.0.0.1:{rpc.free_port()}"
    args = ["--listen", address, "--model", MODEL, "--agents", str(n),
            "--min-agents", str(max(2, math.floor(n * (1 - 2 * LOST_SHARE)))),
            "--steps", "1000000", "--stages", str(STAGES), "--batch", str(batch(n)),
            "--checkpoint-every", "0",
            "--eval-batches", "0", "--state-dir", str(tmp / "state"),
            "--metrics-listen", metrics, "--log-level", "info",
            *(("--relay-port", str(rpc.free_port())) if own_relay_port else ()),
            *(("--heartbeat-interval", str(heartbeat[0]), "--liveness-timeout",
               str(heartbeat[1])) if heartbeat else ())]
    world = World.draw(seed, n)
    pace = HeartbeatPace(*heartbeat) if heartbeat else HeartbeatPace()
    out: dict[str, Any] = {"agents": n, "seed": seed, "sites": len(world.sites),
                           "relay": "own port" if own_relay_port else "shares the gRPC port",
                           "heartbeat_interval_s": heartbeat[0] if heartbeat else 1.0,
                           "liveness_timeout_s": heartbeat[1] if heartbeat else 15.0,
                           # as the coordinator paces N agents (coordinator/daemon/pace.py)
                           "paced_interval_s": pace.interval(n), "paced_liveness_s":
                           pace.liveness(n),
                           "processes": processes, "cores": os.cpu_count()}
    coord = Coordinator(args, tmp / "coordinator.log", env,
                        profile / f"coordinator-{n}.prof" if profile else None)
    log = CoordinatorLog(tmp / "coordinator.log")
    wait_for(lambda: rpc.listening(address) or coord.proc.poll() is not None, 60,
             "the coordinator to listen")
    if coord.proc.poll() is not None:
        raise RuntimeError(f"the coordinator exited: {(tmp / 'coordinator.log').read_text()}")
    channel = grpc.insecure_channel(address, options=rpc.CHANNEL_OPTIONS)
    stub = Stub(coordinator_pb2_grpc.CoordinatorStub(channel))
    swarms = Swarms(address, n, seed, processes, env=env, log=tmp / "swarms.log", nice=10)
    try:
        say(f"N={n}: {processes} swarm processes started; waiting for joins")
        swarms.wait(lambda s: len(s.welcomed) >= n, 300, f"{n} agents to join")
        out["join_s"] = max(swarms.welcomed.values()) - min(swarms.welcomed.values())
        say(f"N={n}: joined in {out['join_s']:.1f} s; the job measures")
        measuring = log.wait(r"job \S+: measuring", coord.started, 120)
        scheduling = log.wait(r"job \S+: scheduling", measuring, 900)
        out["measure_s"] = scheduling - measuring
        say(f"N={n}: measured in {out['measure_s']:.1f} s; planning")
        running = log.wait(r"job \S+: running", scheduling, 900)
        out["plan_s"] = running - scheduling
        plan = plan_of(stub)
        members = [agent_index(a) for row in plan.grid for a in row.agent_ids]
        out["layout"] = f"{plan.stages}x{plan.replicas}"
        out["plan_cost"], out["rank_cost"] = true_costs(world, plan)
        out["plan_vs_rank"] = out["plan_cost"] / out["rank_cost"]
        say(f"N={n}: planned {out['layout']} in {out['plan_s']:.1f} s, cost "
            f"{out['plan_cost']:.3f} vs rank order {out['rank_cost']:.3f}")
        swarms.wait(lambda s: len(s.assigned[plan.epoch]) >= len(members), 300, "assignments")
        out["assign_s"] = max(swarms.assigned[plan.epoch].values()) - running
        swarms.wait(lambda s: len(s.trained[plan.epoch]) >= len(members), 300, "first steps")
        out["train_s"] = max(swarms.trained[plan.epoch].values()) - running
        say(f"N={n}: assigned in {out['assign_s']:.1f} s, all training after "
            f"{out['train_s']:.1f} s; steady-state CPU for {HEARTBEAT_WINDOW_S:.0f} s")
        time.sleep(3.0)
        cpu, t = coord.cpu_s(), time.monotonic()
        time.sleep(HEARTBEAT_WINDOW_S)
        out["heartbeat_cpu"] = (coord.cpu_s() - cpu) / (time.monotonic() - t)
        out.update(timed_status(stub, address, env, metrics))
        say(f"N={n}: heartbeats {out['heartbeat_cpu']:.3f} cores; status "
            f"{out['status_s']:.2f} s (cli {out['status_cli_s']:.2f} s), metrics "
            f"{out['metrics_s']:.2f} s")
        lost = random.Random(seed).sample(members, max(1, round(LOST_SHARE * len(members))))
        t_lost = time.time()
        swarms.kill(lost)
        new = plan_of(stub, plan.epoch)
        alive = [agent_index(a) for row in new.grid for a in row.agent_ids]
        swarms.wait(lambda s: len(s.trained[new.epoch]) >= len(alive), 600, "recovery")
        out["recover_s"] = max(swarms.trained[new.epoch].values()) - t_lost
        noticed = log.first(r"job \S+: recovering", t_lost) or t_lost
        out["notice_s"] = noticed - t_lost  # the liveness timeout, mostly
        out["replan_s"] = out["recover_s"] - out["notice_s"]
        out["recover_layout"] = f"{new.stages}x{new.replicas}"
        say(f"N={n}: lost {len(lost)}, training again on {out['recover_layout']} after "
            f"{out['recover_s']:.1f} s; restarting the coordinator")
        coord.hwm_kib()
        peak = coord.peak_kib
        coord.stop()
        log.close()
        coord = Coordinator(args, tmp / "coordinator-2.log", env)
        log = CoordinatorLog(tmp / "coordinator-2.log")
        log.wait(r"every member of epoch \d+ reported after the restart", coord.started, 600)
        swarms.wait(lambda s: all(s.welcomed.get(i, 0) >= coord.started for i in alive), 120,
                    "every member to re-join")
        out["restart_s"] = max(log.first(r"every member of epoch", coord.started) or 0,
                               max(swarms.welcomed[i] for i in alive)) - coord.started
        coord.hwm_kib()
        out["rss_mib"] = max(peak, coord.peak_kib) / 1024
        say(f"N={n}: back after the restart in {out['restart_s']:.1f} s; peak RSS "
            f"{out['rss_mib']:.0f} MiB")
    finally:
        swarms.close()
        coord.stop()
        log.close()
        channel.close()
    return out


def exponents(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each figure's growth: the least-squares slope of log(figure) on log(N)."""
    out = {}
    for key in KEYS:
        pts = [(math.log(r["agents"]), math.log(r[key])) for r in rows
               if isinstance(r.get(key), float) and r[key] > 0]
        if len(pts) >= 2:
            mx = sum(x for x, _ in pts) / len(pts)
            my = sum(y for _, y in pts) / len(pts)
            sxx = sum((x - mx) ** 2 for x, _ in pts)
            out[key] = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else 0.0
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = "| figure | " + " | ".join(f"N={r['agents']}" for r in rows) + " | growth |"
    lines = [head, "|" + "---|" * (len(rows) + 2)]
    growth = exponents(rows)
    for key in KEYS:
        cells = [f"{r[key]:.3g}" if isinstance(r.get(key), float) else "-" for r in rows]
        g = f"N^{growth[key]:.2f}" if key in growth else "-"
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {g} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[64, 256, 1000])
    parser.add_argument("--seed", type=int, default=7, help="draws the world of sites")
    parser.add_argument("--processes", type=int, default=4,
                        help="swarm processes of simulated agents")
    parser.add_argument("--own-relay-port", action="store_true",
                        help="give the coordinator's relay a port of its own (--relay-port), "
                        "so gRPC is served without the shared port's front")
    parser.add_argument("--heartbeat", type=float, nargs=2, metavar=("INTERVAL", "TIMEOUT"),
                        help="the coordinator's --heartbeat-interval and --liveness-timeout "
                        "(default: its defaults, 1 s and 15 s)")
    parser.add_argument("--profile", type=Path,
                        help="write the first coordinator's cProfile to this directory")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "scale.json"))
    args = parser.parse_args()
    rows = []
    for n in args.agents:
        with tempfile.TemporaryDirectory(prefix=f"scale-{n}-") as tmp:
            try:
                rows.append(run_one(n, args.seed, args.processes, Path(tmp), args.profile,
                                    args.own_relay_port, args.heartbeat))
            except Exception as exc:  # noqa: BLE001 - a figure that failed is a result too
                say(f"N={n}: failed: {exc!r}; coordinator log tail:")
                print((Path(tmp) / "coordinator.log").read_text()[-3000:], flush=True)
                rows.append({"agents": n, "error": repr(exc)})
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))
    print(json.dumps({"growth": exponents(rows)}))


if __name__ == "__main__":
    main()
