"""Benchmark: the headline model, `coordinator start --model gpt-1.3b --agents 8`, on this machine.

Runs a coordinator and `--agents` agents on loopback (gloo on CPU, no link measurement: every
agent is this host), as an operator runs them, and trains `--steps` optimizer steps of the
smallest batch (`--batch 1 --micro-batches 1` by default: one sequence per step). gpt-1.3b's
1.42 B parameters hold 16 bytes each with fp32 AdamW state, 22.7 GB over the 8 stages, which
this 23 GiB box cannot give on top of the activations and 8 worker processes; the default
`--moments-dtype bf16` stores AdamW's moments in bf16 (12 bytes per parameter), and the default
`--seq-len 512` trains `gpt-1.3b:seq=512` (the same layers on 512-token sequences: the memory
model puts the full 2048 at 24.3 GiB on this 23 GiB machine, 512 at 19.4 GiB). The agents
share one machine, and report it (`DeviceInfo.memory_pool`): the coordinator refuses up front,
with the numbers, a plan whose stages together overfill it, and so does this script.

Records, into a table and bench/results/headline.json:
- what the plan chose: stages x replicas, the layer split and why, placement, predicted step;
- each worker's peak resident memory (VmHWM of the worker process, read from /proc every
  `--poll` seconds while it lives; the high-water mark only rises, so the last read is the
  peak up to a poll's time before the worker exits), and the agents' and coordinator's;
- the machine's peak use: MemAvailable before the job minus its lowest value during it;
- each worker's step times, the job's step time (the slowest member's, per step) and tokens/s
  (batch tokens over that), and the wall time from start to done.

Check that the box is quiet first (it needs most of its memory and both cores):

    .venv/bin/python bench/headline.py [--model gpt-1.3b] [--seq-len 512] [--agents 8]
        [--stages 8] [--steps 2] [--batch 1] [--micro-batches 1] [--moments-dtype bf16]
        [--dtype fp32] [--threads 1] [--timeout 7200] [--workdir DIR]

A quick proof that the script works: `--model gpt-small --seq-len 0 --steps 2`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "headline.json"
sys.path.insert(0, str(REPO))

from agent.probing.device import available_ram  # noqa: E402
from bench.uneven import Cluster, _env, _events  # noqa: E402
from coordinator.scheduler.memory import MemoryShape, gib, stages_bytes  # noqa: E402
from dtfm.core.presets import SEQ_SUFFIX, get_preset  # noqa: E402
from dtfm.procs import wait_for  # noqa: E402
from dtfm.rpc import free_port, listening  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-1.3b")
    p.add_argument("--seq-len", type=int, default=512,
                   help="train MODEL:seq=N, the preset on N-token sequences (0: the preset's)")
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--stages", type=int, default=8,
                   help="pipeline stages (0: the coordinator chooses); replicas = agents/stages")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=1, help="sequences per optimizer step")
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--moments-dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--flops", type=float, default=5e10,
                   help="FLOP/s every agent reports (one machine's cores are alike; 0: each "
                   "agent measures its own, under its neighbours' load)")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between /proc reads")
    p.add_argument("--status-every", type=float, default=10.0,
                   help="seconds between asking the coordinator for its status")
    p.add_argument("--timeout", type=float, default=7200.0, help="the whole job, seconds")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--workdir", default="", help="keep the daemons' logs here")
    args = p.parse_args(argv)
    if args.agents < 1 or args.steps < 1 or args.threads < 1 or args.seq_len < 0:
        p.error("--agents, --steps and --threads must be >= 1, --seq-len >= 0")
    args.model_name = f"{args.model}{SEQ_SUFFIX}{args.seq_len}" if args.seq_len else args.model
    get_preset(args.model_name)  # an unknown name fails here, not in the coordinator's log
    return args


# --- memory, from /proc ---

def _status_kb(pid: int, key: str) -> int:
    """A `key:` line of /proc/PID/status in KiB (0 when the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _children(parents: set[int]) -> dict[int, list[int]]:
    """The direct children of each of `parents`: processes whose parent (field 4 of
    /proc/N/stat) it is; one pass over /proc."""
    out: dict[int, list[int]] = {pid: [] for pid in parents}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            ppid = int(text[text.rindex(")") + 2:].split()[1])  # after "(comm)", which may
        except (OSError, ValueError, IndexError):  # hold spaces
            continue
        if ppid in out:
            out[ppid].append(int(stat.parent.name))
    return out


def _is_worker(pid: int) -> bool:
    try:
        return b"agent.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@dataclass
class Memory:
    """Peak resident bytes per process, and the machine's lowest MemAvailable, while polled."""

    baseline: int = field(default_factory=available_ram)
    lowest: int = 0
    workers: dict[int, dict[str, int]] = field(default_factory=dict)  # pid -> agent, peak
    daemons: dict[str, int] = field(default_factory=dict)  # name -> peak

    def poll(self, agents: list[int], coordinator: int) -> None:
        avail = available_ram()
        self.lowest = avail if not self.lowest else min(self.lowest, avail)
        self._peak("coordinator", coordinator)
        children = _children(set(agents))
        for i, pid in enumerate(agents):
            self._peak(f"agent-{i}", pid)
            for child in children[pid]:
                if _is_worker(child):
                    hwm = _status_kb(child, "VmHWM") * 1024
                    seen = self.workers.setdefault(child, {"agent": i, "peak_rss": 0})
                    seen["peak_rss"] = max(seen["peak_rss"], hwm)

    def _peak(self, name: str, pid: int) -> None:
        self.daemons[name] = max(self.daemons.get(name, 0), _status_kb(pid, "VmHWM") * 1024)

    def per_agent(self) -> dict[int, int]:
        """Each agent's largest worker peak (a pre-started spare becomes the worker: one pid)."""
        out: dict[int, int] = {}
        for seen in self.workers.values():
            out[seen["agent"]] = max(out.get(seen["agent"], 0), seen["peak_rss"])
        return out


# --- the job ---

def coordinator_argv(args: argparse.Namespace, address: str) -> list[str]:
    argv = ["coordinator", "start", "--listen", address, "--model", args.model_name,
            "--agents", str(args.agents), "--steps", str(args.steps), "--batch", str(args.batch),
            "--micro-batches", str(args.micro_batches), "--moments-dtype", args.moments_dtype,
            "--dtype", args.dtype, "--schedule", args.schedule, "--no-measure",
            "--eval-batches", "0", "--checkpoint-every", "0", "--warmup-steps", "0",
            "--search-seconds", "2", "--max-restarts", "0"]
    return argv + (["--stages", str(args.stages)] if args.stages else [])


def run_job(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Start the cluster, follow the job to done (or failed), return what was measured."""
    work.mkdir(parents=True, exist_ok=True)
    memory = Memory()
    t0 = time.monotonic()
    with Cluster(work, args.threads) as c:
        address = f"127.0.0.1:{free_port()}"
        c.spawn(coordinator_argv(args, address), "coordinator", _env(args.threads))
        wait_for(lambda: listening(address), 60, "the coordinator to listen")
        for i in range(args.agents):
            # no spare worker: 8 idle processes with torch would take ~3 GB the model needs
            c.spawn(["agent", "start", "--coordinator", address, "--device", "cpu",
                     "--no-prewarm", "--state-dir", str(work / f"agent-{i}")]
                    + (["--flops", f"{args.flops:.6g}"] if args.flops else []),
                    f"agent-{i}", _env(args.threads))
        pids = [p.pid for p in c.procs]
        status: dict[str, Any] = {}
        seen: dict[str, Any] = {"plan": None, "running": ""}
        next_status = 0.0
        end = t0 + args.timeout
        while time.monotonic() < end:
            memory.poll(pids[1:], pids[0])
            if time.monotonic() >= next_status:
                status = c.status(address)
                next_status = time.monotonic() + args.status_every
                job = status["job"]
                seen["plan"] = status["plan"] or seen["plan"]
                if job["state"] == "running" and not seen["running"]:
                    seen["running"] = job["message"]
                if job["state"] in ("done", "failed"):
                    break
            time.sleep(args.poll)
        else:
            raise TimeoutError(f"the job did not finish within --timeout {args.timeout:.0f} s; "
                               f"logs in {work}")
        wall = time.monotonic() - t0
    job = status["job"]
    return {"state": job["state"], "message": job["message"], "plan": seen["plan"],
            "plan_message": seen["running"], "wall_s": wall,
            "coordinator_step_s": job["measured_step_s"],
            "coordinator_tokens_per_s": job["tokens_per_s"],
            "workers": workers(args, work, memory), "daemons_peak_rss": memory.daemons,
            "machine": {"mem_available_before": memory.baseline,
                        "mem_available_lowest": memory.lowest,
                        "peak_used": memory.baseline - memory.lowest if memory.lowest else 0}}


def workers(args: argparse.Namespace, work: Path, memory: Memory) -> list[dict[str, Any]]:
    """Each agent's worker: its stage, peak RSS and every step's time, from its progress file."""
    peaks = memory.per_agent()
    out = []
    for i, events in _events(args, work, first_step=1).items():
        last = events[-1] if events else None
        out.append({"agent": i, "stage": last.stage if last else -1,
                    "replica": last.replica if last else -1, "peak_rss": peaks.get(i, 0),
                    "step_s": [ev.step_s for ev in events],
                    "compute_s": [ev.compute_s for ev in events]})
    return sorted(out, key=lambda w: (w["stage"], w["replica"]))


def summarize(args: argparse.Namespace, run: dict[str, Any]) -> dict[str, Any]:
    """The job's step times (slowest member per step), tokens/s and the memory the model
    predicted per stage, beside what was measured."""
    spec = get_preset(args.model_name)
    per_step: dict[int, float] = {}
    for w in run["workers"]:
        for k, s in enumerate(w["step_s"], start=1):
            per_step[k] = max(per_step.get(k, 0.0), s)
    steps = [per_step[k] for k in sorted(per_step)]
    steady = steps[1:] or steps  # step 1 pays for warm-up
    step_s = statistics.median(steady) if steady else None
    plan = run["plan"] or {}
    stages, replicas = plan.get("stages", 0), plan.get("replicas", 0)
    predicted = []
    if stages:
        shape = MemoryShape(spec, stages, replicas, args.batch // (replicas * args.micro_batches),
                            args.micro_batches, args.schedule, args.dtype, args.moments_dtype)
        predicted = stages_bytes(shape, plan.get("layer_splits") or None)
    return {"model": args.model_name, "parameters": spec.param_count(), "seq_len": spec.seq_len,
            "step_times_s": steps, "step_s": step_s,
            "tokens_per_s": args.batch * spec.seq_len / step_s if step_s else None,
            "predicted_stage_bytes": predicted,
            "peak_rss_total": sum(w["peak_rss"] for w in run["workers"])}


def table(args: argparse.Namespace, run: dict[str, Any], s: dict[str, Any]) -> str:
    plan = run["plan"] or {}
    lines = [f"{args.model_name}: {s['parameters'] / 1e9:.2f} B parameters, sequence "
             f"{s['seq_len']}, batch {args.batch}, {args.steps} steps, moments "
             f"{args.moments_dtype}, dtype {args.dtype}: {run['state']}",
             f"plan: {plan.get('stages', '?')} stages x {plan.get('replicas', '?')} replicas, "
             f"layers {','.join(map(str, plan.get('layer_splits', [])))}, "
             f"{plan.get('placement', '?')} placement; {run['plan_message'] or run['message']}",
             "",
             f"{'stage':>5} {'agent':>5} {'peak RSS':>10} {'predicted':>10} {'step s':>16}"]
    for w in run["workers"]:
        pred = s["predicted_stage_bytes"][w["stage"]] \
            if 0 <= w["stage"] < len(s["predicted_stage_bytes"]) else 0
        times = ",".join(f"{x:.1f}" for x in w["step_s"]) or "-"
        lines.append(f"{w['stage']:>5} {w['agent']:>5} {gib(w['peak_rss']):>10} "
                     f"{gib(pred):>10} {times:>16}")
    daemons = sum(run["daemons_peak_rss"].values())
    step = f"{s['step_s']:.2f} s" if s["step_s"] else "-"
    tps = f"{s['tokens_per_s']:.1f}" if s["tokens_per_s"] else "-"
    lines += ["",
              f"workers' peak RSS summed: {gib(s['peak_rss_total'])}; agents + coordinator: "
              f"{gib(daemons)}; the machine's peak use (MemAvailable drop): "
              f"{gib(run['machine']['peak_used'])}",
              f"step time (slowest member, median after step 1): {step}; tokens/s: {tps}; "
              f"per step: {', '.join(f'{x:.1f}' for x in s['step_times_s'])}; "
              f"wall time {run['wall_s']:.0f} s"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dtfm-headline-") as tmp:
        run = run_job(args, Path(args.workdir or tmp))
    s = summarize(args, run)
    print(table(args, run, s))
    result = {"args": vars(args), "run": run, "summary": s, "time": time.time()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if run["state"] == "done" else 1


if __name__ == "__main__":
    sys.exit(main())
