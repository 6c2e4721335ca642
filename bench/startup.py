"""Benchmark: from an agent's assignment to its worker's first step, and where the time goes.

Runs one short job through real coordinator and agent processes, on loopback or (`--wan`,
needs root) on the emulated world-wide WAN with one agent per city (the paper's one-way
delays, 25 Mbit/s per Gbit/s), with the agents' spare workers on (the default) or off
(`--no-prewarm`). The agents start first and settle for `--settle` seconds (a deployed agent
waits long before its job; its spare is warm by then), then the coordinator starts the job.

Each worker's start is cut into phases from three sources, all written by the programs
themselves: the agent's `worker start-up:` line (`agent/daemon/supervisor.py`: assignment received,
checkpoints fetched, first step event read), the worker's `start-up:` line
(`agent/worker/__main__.py`: process started, imports done, assignment in hand) and its
`joined world` and `rank R: stage` log lines (`world.py`, `train.py`):

  prepare     checkpoint listing/fetch from peers before the worker starts (agent)
  process     a fresh process's spawn, python and imports; a spare's hand-over
  build       model, optimizer and data
  world       rendezvous store and init_process_group
  groups      the member-only groups (pipeline, data-parallel)
  resume      the ranks' agreement on a checkpoint, and loading it
  first step  the first step, until the agent read its event

Prints the median and maximum of each phase over the workers and writes JSON
(bench/results/startup.json, one entry per mode). `bench/wan.py` uses `breakdown()` too.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python bench/startup.py`
    sys.path.insert(0, str(REPO))

from coordinator.scheduler.scenarios import world_links  # noqa: E402
from dtfm.wan import WanEmulator  # noqa: E402
from dtfm.wan.cluster import WanCluster, measurement_wan  # noqa: E402

RESULTS = REPO / "bench" / "results" / "startup.json"
PHASES = ("prepare", "process", "build", "world", "groups", "resume", "first_step")
AGENT_MARK = "worker start-up: "  # agent.supervisor.STARTUP_PREFIX
WORKER_MARK = "start-up: "  # agent.worker.__main__.STARTUP_PREFIX
JOINED = re.compile(r"joined world of \d+ in ([\d.]+) s \(world ([\d.]+) s, groups ([\d.]+) s")
TRAINING = re.compile(r"rank \d+: stage \d+/\d+ replica")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _stamp(line: str) -> float | None:
    """A logging asctime at the start of `line`, as epoch seconds (same machine, local time)."""
    m = STAMP.match(line)
    if m is None:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _json_after(line: str, prefix: str) -> dict[str, Any] | None:
    at = line.find(prefix)
    if at < 0:
        return None
    try:
        obj = json.loads(line[at + len(prefix):])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def worker_phases(agent_marks: dict[str, Any], worker_log: Path) -> dict[str, Any] | None:
    """One worker's phases (seconds) from its agent's marks and its own log; None when the
    log lacks a line (the worker failed before training, or an older worker)."""
    marks: dict[str, Any] | None = None
    joined: tuple[float, float, float, float] | None = None  # at, join_s, world_s, groups_s
    training_at: float | None = None
    for line in worker_log.read_text(errors="replace").splitlines():
        got = _json_after(line, WORKER_MARK)
        if got is not None and got.get("pid") == agent_marks["pid"]:
            marks = got
        elif (m := JOINED.search(line)) and (at := _stamp(line)) is not None:
            joined = (at, float(m.group(1)), float(m.group(2)), float(m.group(3)))
        elif TRAINING.search(line) and joined is not None:
            training_at = _stamp(line)
    first = agent_marks.get("first_step_at") or 0.0
    if marks is None or joined is None or training_at is None or not first:
        return None
    assigned, prepared = agent_marks["assigned_at"], agent_marks["prepared_at"]
    joined_at, join_s, world_s, groups_s = joined
    return {
        "rank": agent_marks["rank"], "spare": bool(agent_marks["spare"]),
        "prepare": prepared - assigned,
        "process": marks["ready_at"] - prepared,
        "imports": marks["imported_at"] - marks["started_at"],
        "build": (joined_at - join_s) - marks["ready_at"],
        "world": world_s, "groups": groups_s,
        "resume": training_at - joined_at,
        "first_step": first - training_at,
        "total": first - assigned,
    }


def breakdown(root: Path, job_id: str = "", epoch: int | None = None) -> list[dict[str, Any]]:
    """Every worker's start-up phases under a cluster directory whose agents log to
    `root/agent-I.log` and keep their state in `root/agent-I/` (as `WanCluster` lays them
    out). `job_id`/`epoch` pick one job's epoch; by default the newest start of each agent."""
    out = []
    for agent_log in sorted(root.glob("agent-*.log")):
        state = root / agent_log.stem
        starts = [m for line in agent_log.read_text(errors="replace").splitlines()
                  if (m := _json_after(line, AGENT_MARK)) is not None
                  and (not job_id or m.get("job_id") == job_id)
                  and (epoch is None or m.get("epoch") == epoch)]
        if not starts:
            continue
        m = starts[-1]
        log = state / "work" / f"{m['job_id']}-e{m['epoch']}-r{m['rank']}.log"
        phases = worker_phases(m, log) if log.exists() else None
        if phases is not None:
            out.append(phases)
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and maximum of each phase (and the total) over the workers."""
    if not rows:
        return {}
    keys = (*PHASES, "imports", "total")
    return {"workers": len(rows), "spares": sum(r["spare"] for r in rows),
            "median": {k: statistics.median(r[k] for r in rows) for k in keys},
            "max": {k: max(r[k] for r in rows) for k in keys}}


def table(summary: dict[str, Any]) -> str:
    if not summary:
        return "(no worker start-up lines found)"
    head = "".join(f"{k:>11}" for k in (*PHASES, "total"))
    lines = [f"{'':8}{head}"]
    for what in ("median", "max"):
        lines.append(f"{what:<8}" + "".join(f"{summary[what][k]:>11.2f}"
                                            for k in (*PHASES, "total")))
    return "\n".join(lines)


class Loopback:
    """`WanCluster`'s view of hosts, on this machine's loopback: host i is 127.0.77.(i+1)
    (all of 127/8 is local on Linux), so every agent keeps the cluster's fixed ports."""

    def address(self, i: int) -> str:
        return f"127.0.77.{i + 1}"

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        return list(argv)

    def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(list(argv), cwd=REPO, **kwargs)


class SettledCluster(WanCluster):
    """A `WanCluster` whose agents start `settle` seconds before the coordinator (and its
    job), optionally with their spare workers off."""

    def __init__(self, wan: Any, workdir: Path, agents: int, settle: float,
                 prewarm: bool) -> None:
        super().__init__(wan, workdir, agents)
        self.settle, self.prewarm = settle, prewarm

    def start(self, timeout: float = 120.0, prewarm: bool = True) -> list[str]:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._start_agents(prewarm and self.prewarm)
        time.sleep(self.settle)
        self._start_coordinator()
        return self._wait_agents(timeout)


def links_file(path: Path, ids: list[str], delay: list[list[float]],
               mbps: list[list[float]]) -> Path:
    """The emulated matrix as a `--links` file (the job plans on it without measuring)."""
    by_host = sorted(ids)  # order does not matter for rank-order placement
    path.write_text(json.dumps({
        "agents": by_host, "delay_ms": delay,
        "bandwidth_gbps": [[v / 1000 for v in row] for row in mbps]}))
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wan", action="store_true", help="the emulated world-wide WAN (root)")
    p.add_argument("--no-prewarm", dest="prewarm", action="store_false",
                   help="agents start workers when assigned (no spare)")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--model", default="gpt-mini")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--settle", type=float, default=45.0,
                   help="seconds the agents run before the job starts")
    p.add_argument("--scale", type=float, default=25.0, help="emulated Mbit/s per Gbit/s")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--workdir", default="", help="keep the daemons' logs here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    agents = args.stages * args.replicas
    job = ["--model", args.model, "--agents", str(agents), "--stages", str(args.stages),
           "--replicas", str(args.replicas), "--steps", str(args.steps), "--batch", "16",
           "--micro-batches", "4", "--eval-batches", "0", "--layer-split", "even",
           "--search-seconds", "1"]
    mode = f"{'wan' if args.wan else 'loopback'}-{'prewarm' if args.prewarm else 'cold'}"
    with tempfile.TemporaryDirectory(prefix="dtfm-bench-startup-") as scratch:
        root = Path(args.workdir or scratch)
        if args.wan:
            ok, why = WanEmulator.available()
            if not ok:
                print(f"cannot emulate a WAN here: {why}", file=sys.stderr)
                return 2
            if agents != 8:
                print("--wan puts one agent in each of the 8 cities: stages x replicas must "
                      "be 8", file=sys.stderr)
                return 2
            delay, mbps, _ = world_links(1, args.scale)
            with measurement_wan(delay, mbps) as wan:
                row = _run(SettledCluster(wan, root, agents, args.settle, args.prewarm),
                           job, delay, mbps, args)
        else:
            zeros = [[0.0] * agents for _ in range(agents)]
            fast = [[0.0 if i == j else 10_000.0 for j in range(agents)] for i in range(agents)]
            row = _run(SettledCluster(Loopback(), root, agents, args.settle, args.prewarm),
                       job, zeros, fast, args)
        row["workers"] = breakdown(root)
    row["summary"] = summarize(row["workers"])
    print(f"{mode}: assignment -> first step (coordinator's view) "
          f"{row['assignment_to_first_step_s']}")
    print(table(row["summary"]))
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results[mode] = {"config": {k: v for k, v in vars(args).items()
                                if k not in ("out", "workdir")}, **row}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    return 0


def _run(cluster: SettledCluster, job: list[str], delay: list[list[float]],
         mbps: list[list[float]], args: argparse.Namespace) -> dict[str, Any]:
    settle, cluster.settle = cluster.settle, 0.0
    ids = cluster.start()  # once, for the agents' ids (kept in their state dirs)
    cluster.stop()
    cluster.settle = settle
    links = links_file(cluster.workdir / "links.json", ids, delay, mbps)
    return cluster.train(job, "rank-order", links, args.timeout)


if __name__ == "__main__":
    raise SystemExit(main())
