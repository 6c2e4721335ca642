"""Benchmark: a long honest job across emulated hosts, with churn and a slowed link, excludes
nobody (issue 43's false-positive run).

Six agents on six emulated hosts (5-10 ms, 100 Mbit/s; one of them behind a NAT), one
coordinator on host 0, train gpt-tiny 2 x 3 (`--dp-mode sharded`, `--verify full`) for
`--steps` steps with `--pp-compress int4` and `--sync-every 8` (the issue's run), while:

- **churn**: at step `--kill-at` one agent (a member) is SIGKILLed, as a crash would; it is
  started again `--restart-after` seconds later on the same state directory, so the job
  shrinks, then grows back;
- **a slowed link**: at step `--slow-at` the link between two other agents goes to 60 ms and
  10 Mbit/s, both ways, for the rest of the run.

Everything is honest: no agent is bad, so every piece of integrity evidence is a false
positive. It reports the evidence by kind (the coordinator's log lines: "integrity evidence
from agent ..."), the agents excluded (the target: none), the disputes and re-plans, the
recoveries and the job's end. The same run with `--sync-every 1` exercises the per-step
scoring (norm, direction, shape, averages) instead of the outer steps' checks.

Needs root (network namespaces). Run: `python bench/honest_wan.py` (1000 steps: about 10
minutes on a 2-core machine); writes bench/results/honest_wan.json (`--out`).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "honest_wan.json"

from dtfm.wan import WanEmulator  # noqa: E402
from dtfm.wan.cluster import WanCluster, measurement_wan  # noqa: E402

AGENTS = 6
# agents on hosts 1..6: two sites of three (5 ms inside, 10 ms across), 100 Mbit/s
DELAY = [[0 if i == j else (5 if i // 3 == j // 3 else 10) for j in range(AGENTS)]
         for i in range(AGENTS)]
RATE = [[0 if i == j else 100 for j in range(AGENTS)] for i in range(AGENTS)]
NAT = [5]  # a volunteer at home
EVIDENCE = re.compile(r"integrity evidence from agent (\S+) .*?: (\w+) names (.+?):")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--sync-every", type=int, default=8)
    p.add_argument("--pp-compress", default="int4")
    p.add_argument("--outer-delay", type=int, default=0, choices=(0, 1),
                   help="1: the outer step one round late (with --sync-every > 1)")
    p.add_argument("--kill-at", type=int, default=300, help="step of the agent's SIGKILL")
    p.add_argument("--restart-after", type=float, default=5.0, help="seconds")
    p.add_argument("--slow-at", type=int, default=600, help="step the link slows at")
    p.add_argument("--timeout", type=float, default=3000.0)
    p.add_argument("--workdir", default="")
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def job_flags(args: argparse.Namespace) -> list[str]:
    return ["--model", "gpt-tiny", "--agents", str(AGENTS), "--min-agents", "4",
            "--stages", "2", "--replicas", "3", "--steps", str(args.steps), "--batch", "12",
            "--micro-batches", "2", "--seed", "11", "--search-seconds", "1",
            "--eval-batches", "0", "--checkpoint-every", "8", "--heartbeat-interval", "0.5",
            "--dp-mode", "sharded", "--verify", "full", "--pp-compress", args.pp_compress,
            "--sync-every", str(args.sync_every), "--outer-delay", str(args.outer_delay),
            "--max-restarts", "6"]


def run(wan: WanEmulator, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    cluster = WanCluster(wan, work, agents=AGENTS, coordinator_args=job_flags(args))
    events: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        ids = cluster.start(timeout=120)
        killed: int | None = None
        restart_at = slowed = 0.0
        last_note = 0.0
        while True:
            status = cluster.status()
            if status is None:
                time.sleep(1.0)
                continue
            job, now = status["job"], time.monotonic()
            step = int(job.get("step", 0))
            if now - last_note > 30:
                print(f"[{now - t0:6.0f} s] step {step}/{args.steps}, {job['state']}",
                      file=sys.stderr)
                last_note = now
            if job["state"] in ("done", "failed"):
                break
            if now - t0 > args.timeout:
                raise TimeoutError(f"the job did not finish within {args.timeout:.0f} s")
            grid = [a for row in (status.get("plan") or {}).get("grid", []) for a in row]
            if killed is None and step >= args.kill_at and grid:
                killed = ids.index(grid[-1])
                cluster.agent_procs[killed].kill()
                restart_at = now + args.restart_after
                events.append({"at_s": round(now - t0, 1), "step": step,
                               "what": f"SIGKILL agent-{killed} ({ids[killed]})"})
            if killed is not None and restart_at and now >= restart_at:
                cluster.agent_procs[killed] = cluster.start_agent(killed,
                                                                  log_name=f"agent-{killed}-2")
                restart_at = 0.0
                events.append({"at_s": round(now - t0, 1), "step": step,
                               "what": f"agent-{killed} started again"})
            if not slowed and step >= args.slow_at:
                a, b = [i for i in range(AGENTS) if i != killed][:2]
                wan.live.set_link(a + 1, b + 1, delay_ms=60.0, bandwidth_mbps=10.0,
                                  both_ways=True)
                slowed = now
                events.append({"at_s": round(now - t0, 1), "step": step,
                               "what": f"link agent-{a} <-> agent-{b}: 60 ms, 10 Mbit/s"})
            time.sleep(0.5)
    finally:
        cluster.stop()
    return {"status": status, "events": events, "ids": ids, "wall_s": time.monotonic() - t0}


def evidence(log: str) -> tuple[dict[str, int], list[str]]:
    """Evidence pieces by kind, and the lines that named somebody (first 20)."""
    kinds: collections.Counter[str] = collections.Counter()
    named = []
    for line in log.splitlines():
        if m := EVIDENCE.search(line):
            kinds[m.group(2)] += 1
            if len(named) < 20:
                named.append(line[-300:])
    return dict(kinds), named


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ok, why = WanEmulator.available()
    if not ok:
        print(f"no WAN emulator here: {why}", file=sys.stderr)
        return 2
    work = Path(args.workdir or tempfile.mkdtemp(prefix="honest-wan-"))
    with measurement_wan(DELAY, RATE, nat=NAT) as wan:
        got = run(wan, work, args)
    status, job = got["status"], got["status"]["job"]
    log = (work / "coordinator.log").read_text(errors="replace")
    kinds, named = evidence(log)
    excluded = [a["id"] for a in status["agents"] if a["state"] == "excluded"]
    disputes = log.count("replicas of one stage, disagree")
    result = {
        "steps": args.steps, "sync_every": args.sync_every, "pp_compress": args.pp_compress,
        "outer_delay": args.outer_delay,
        "agents": AGENTS, "layout": "2x3", "nat": NAT, "wall_s": round(got["wall_s"], 1),
        "state": job["state"], "step": job.get("step"), "loss": job.get("loss"),
        "message": job.get("message", ""), "events": got["events"],
        "recoveries": [{k: r.get(k) for k in ("reason", "layout_before", "layout_after",
                                              "resumed_step", "planned")}
                       for r in job.get("recoveries", [])],
        "evidence_by_kind": kinds, "evidence_lines": named, "disputes": disputes,
        "excluded": excluded, "workdir": str(work)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"gpt-tiny 2 x 3 on 6 emulated hosts (agent 5 behind a NAT), {args.steps} honest "
          f"steps, --pp-compress {args.pp_compress} --sync-every {args.sync_every} "
          f"--outer-delay {args.outer_delay}: "
          f"{job['state']} at step {job.get('step')} in {got['wall_s']:.0f} s")
    for e in got["events"]:
        print(f"  {e['at_s']:7.1f} s, step {e['step']:5d}: {e['what']}")
    for r in result["recoveries"]:
        print(f"  recovery: {r['layout_before']} -> {r['layout_after']}, resumed after step "
              f"{r['resumed_step']}: {str(r['reason'])[:110]}")
    print(f"{'kind':<18}{'pieces':>8}")
    for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"{kind:<18}{n:>8}")
    print(f"R = 2 disputes: {disputes}; agents excluded: {', '.join(excluded) or 'none'}")
    print(f"wrote {args.out} (logs in {work})")
    return 0 if job["state"] == "done" and not excluded else 1


if __name__ == "__main__":
    raise SystemExit(main())
