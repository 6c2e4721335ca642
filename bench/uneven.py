"""Benchmark: uneven devices. The compute-aware layer split against the even one, measured.

Runs a coordinator and `--agents` agents on this machine (loopback, no link measurement) and
trains the same model for the same steps with `--layer-split even` and with `auto`. Half of
the agents are made slow: their environment carries `DTFM_COMPUTE_SLOWDOWN=FACTOR` (the worker
idles FACTOR-1 times as long as each stage's forward and backward took, agent/worker/pipeline.py)
and they report `--flops BASE/FACTOR` while the others report `--flops BASE`, as an operator
would pin a known speed mix.

What it measures is the plan, not this machine's contention, because:
- every worker runs one torch thread (`--threads`, `DTFM_NUM_THREADS`); several workers with
  torch's default of one thread per core oversubscribe the cores, and the compute each
  reports then depends on what its neighbours do at that moment;
- the default layout is 2 stages x 1 replica: two one-thread workers on this 2-core machine
  never wait for a core, whereas four (2 x 2) need more than two cores whenever the fast
  ones compute together, which caps the faster plan (docs/benchmarks.md has the numbers);
  `--agents 4 --base-slowdown 2` slows every agent (the slow ones by 2 x `--slowdown`) so
  that four workers leave cores free again;
- the agents keep no spare worker (`--no-prewarm`): an agent starts its spare, a process
  importing torch, once its worker has trained a step, and that import ran beside steps 2-8
  (they took twice as long as the steps after it); the bench asks the coordinator's status
  in-process, not by starting a `coordinator status` process twice a second;
- `BASE` (`--flops 0`) is calibrated: the FLOP/s one worker thread reaches on this model
  (one micro-batch's forward and backward through every layer, FLOPs counted as the scheduler
  counts them), not the agents' 512x512 numpy matmul on every core, which reads 3x what a
  worker reaches on a small model; so the plan-time prediction is comparable with the step;
- the splits run in turn, `--rounds` times, so each pair of runs shares the background load
  of that moment; the speed-up is the median of the rounds' ratios;
- other sessions' work on the machine still stretches every step; each job also reports its
  load (how many times slower than calibrated its workers computed) and the step divided by
  it (`_normalized_step`), the figure the splits and the plan-time prediction compare on.

Each run's row shows the layer split, the plan-time prediction (agents' FLOP/s only), the
prediction refreshed with the workers' measured compute (what `coordinator status` shows),
the measured step time (median of the members' steady steps), tokens/s, the refreshed
prediction's error, the load, the normalized step and the plan-time prediction's error
against it; the JSON also has each worker's median split of a step (compute, pipeline wait,
data-parallel sync, the rest) from its progress events. Writes bench/results/uneven.json.

    .venv/bin/python bench/uneven.py [--model gpt-mini] [--agents 2] [--stages 2]
                                     [--slowdown 2] [--steps 12] [--rounds 2] [--threads 1]
                                     [--agents 4 --base-slowdown 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "uneven.json"
SEAM_ENV = "DTFM_COMPUTE_SLOWDOWN"
TOKEN = "bench-uneven-token"
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from coordinator.commands.status import status_to_json  # noqa: E402
from coordinator.scheduler.compute import stage_flops  # noqa: E402
from dtfm.core.events import StepEvent, WorkerEnv, parse_event  # noqa: E402
from dtfm.core.layout import layer_ranges  # noqa: E402
from dtfm.core.presets import get_preset  # noqa: E402
from dtfm.procs import terminate_all, wait_for  # noqa: E402
from dtfm.rpc import free_port, listening  # noqa: E402
from protos.dtfm.v1 import coordinator_pb2, coordinator_pb2_grpc  # noqa: E402

PARTS = ("step_s", "compute_s", "pp_wait_s", "dp_s", "sync_s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-mini")
    p.add_argument("--agents", type=int, default=2)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--slowdown", type=float, default=2.0, help="slow agents take this factor")
    p.add_argument("--base-slowdown", type=float, default=1.0,
                   help="every agent idles this factor (the slow ones base x slowdown): "
                   "leaves cores free when more workers than cores run")
    p.add_argument("--flops", type=float, default=0.0,
                   help="FLOP/s the fast agents report (0: calibrate on this model)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--schedule", default="gpipe", choices=("gpipe", "1f1b"))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--splits", default="even,auto", help="--layer-split values to compare")
    p.add_argument("--rounds", type=int, default=2,
                   help="run every split this many times, in turn")
    p.add_argument("--timeout", type=float, default=900.0, help="per job, seconds")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--workdir", default="", help="keep the daemons' logs here")
    args = p.parse_args(argv)
    if args.agents < 2 or args.agents % args.stages:
        p.error(f"--agents {args.agents} must be a multiple of --stages {args.stages} "
                "and at least 2 (half of the agents are slow)")
    if args.rounds < 1 or args.threads < 1:
        p.error("--rounds and --threads must be >= 1")
    if args.slowdown < 1 or args.base_slowdown < 1:
        p.error("--slowdown and --base-slowdown are factors >= 1")
    return args


def _env(threads: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTFM_")}
    return {**env, "DTFM_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1",
            WorkerEnv.THREADS: str(threads), "OMP_NUM_THREADS": str(threads), **extra}


class Cluster:
    """A coordinator and its agents, always stopped on exit."""

    def __init__(self, work: Path, threads: int) -> None:
        self.work, self.threads = work, threads
        self.procs: list[subprocess.Popen[bytes]] = []
        self._channel: grpc.Channel | None = None
        self._stub: Any = None

    def spawn(self, args: list[str], name: str, env: dict[str, str]) -> None:
        with open(self.work / f"{name}.log", "ab") as log:
            self.procs.append(subprocess.Popen([sys.executable, "-m", *args], cwd=REPO,
                                               stdout=log, stderr=subprocess.STDOUT, env=env,
                                               start_new_session=True))

    def status(self, address: str) -> dict[str, Any]:
        """`coordinator status --json`, asked in this process: a `coordinator status`
        process per poll costs a third of a core (interpreter and grpc imports) on a
        2-core machine whose cores the workers are being timed on."""
        if self._stub is None:
            self._channel = grpc.insecure_channel(address)
            self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        got = self._stub.GetStatus(coordinator_pb2.StatusRequest(), timeout=30,
                                   metadata=[("authorization", f"Bearer {TOKEN}")])
        return status_to_json(got)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._channel is not None:
            self._channel.close()
        terminate_all(self.procs)


def _slow(args: argparse.Namespace, i: int) -> bool:
    return i >= args.agents // 2


def run_job(args: argparse.Namespace, split: str, flops: float, work: Path) -> dict[str, Any]:
    """One job with `--layer-split split`; returns its plan and measured speed."""
    work.mkdir(parents=True, exist_ok=True)
    with Cluster(work, args.threads) as c:
        address = f"127.0.0.1:{free_port()}"
        c.spawn(["coordinator", "start", "--listen", address, "--model", args.model,
                 "--agents", str(args.agents), "--stages", str(args.stages),
                 "--steps", str(args.steps), "--batch", str(args.batch),
                 "--micro-batches", str(args.micro_batches), "--schedule", args.schedule,
                 "--no-measure", "--layer-split", split, "--search-seconds", "2",
                 "--eval-batches", "0", "--heartbeat-interval", "0.5"], "coordinator",
                _env(args.threads))
        wait_for(lambda: listening(address), 30, "the coordinator to listen")
        for i in range(args.agents):
            factor = args.base_slowdown * (args.slowdown if _slow(args, i) else 1.0)
            env = _env(args.threads, **({SEAM_ENV: f"{factor:g}"} if factor > 1 else {}))
            speed = flops / factor
            c.spawn(["agent", "start", "--coordinator", address, "--state-dir",
                     str(work / f"agent-{i}"), "--device", args.device, "--no-prewarm",
                     "--flops", f"{speed:.6g}"], f"agent-{i}", env)
        plan_time: list[float] = []
        status = wait_for(lambda: _finished(c.status(address), plan_time), args.timeout,
                          "the job", interval=0.5)
    return summarize(split, status, plan_time[0] if plan_time else None,
                     _events(args, work), args, flops)


def _finished(status: dict[str, Any], plan_time: list[float]) -> dict[str, Any] | None:
    """The final status once the job is done; records the plan-time prediction on the way
    (before step 2 is reported the coordinator has only the agents' FLOP/s to go by)."""
    job, plan = status["job"], status["plan"]
    if job["state"] == "failed":
        raise RuntimeError(f"the job failed: {job['message']}")
    if plan and not plan_time and job["step"] < 2 and plan["predicted_step_s"]:
        plan_time.append(plan["predicted_step_s"])
    return status if job["state"] == "done" else None


def _events(args: argparse.Namespace, work: Path, first_step: int = 2
            ) -> dict[int, list[StepEvent]]:
    """Each agent's workers' step events from `first_step` on (by default the steady ones:
    step 1 carries warm-up)."""
    return {i: [ev for path in sorted((work / f"agent-{i}").glob("work/*.progress.jsonl"))
                for ev in map(parse_event, path.read_text().splitlines())
                if isinstance(ev, StepEvent) and ev.step >= first_step]
            for i in range(args.agents)}


def _workers(args: argparse.Namespace, events: dict[int, list[StepEvent]]) -> list[dict[str, Any]]:
    """Each worker's median split of a step: compute, pipeline wait, data-parallel, norm
    exchange and the rest (optimizer, clipping, data), which the step model leaves out."""
    out = []
    for i, evs in events.items():
        if not evs:
            continue
        med = {k: statistics.median(getattr(ev, k) for ev in evs) for k in PARTS}
        rest = med["step_s"] - med["compute_s"] - med["pp_wait_s"] - med["dp_s"] - med["sync_s"]
        out.append({"agent": i, "slow": _slow(args, i), "stage": evs[-1].stage,
                    "replica": evs[-1].replica, **med, "rest_s": rest})
    return sorted(out, key=lambda w: (w["stage"], w["replica"]))


def _normalized_step(args: argparse.Namespace, events: dict[int, list[StepEvent]],
                     splits: list[int], flops: float) -> tuple[float, float] | None:
    """(load, step): how many times slower than calibrated the workers computed, and the
    step time divided by it, medians over the job's steady steps.

    Other sessions' work on this machine comes and goes and stretches every rank's compute
    alike (the emulated slowdown is proportional to the real compute, so the slow agents'
    too); dividing each step by that step's mean stretch over all workers (measured compute
    over compute predicted from the calibrated FLOP/s) leaves the step the plan would have on
    a quiet machine, which the splits can be compared on and the plan-time prediction
    checked against. The measured tokens/s is reported beside it, untouched."""
    if not splits:
        return None
    spec = get_preset(args.model)
    tokens = args.batch // (args.agents // args.stages) * spec.seq_len
    ranges = layer_ranges(spec.n_layers, args.stages, splits)
    steps: dict[int, tuple[float, list[float]]] = {}
    for i, evs in events.items():
        speed = flops / args.base_slowdown / (args.slowdown if _slow(args, i) else 1.0)
        for ev in evs:
            predicted = stage_flops(spec, *ranges[ev.stage], tokens) / speed
            step_s, loads = steps.get(ev.step, (0.0, []))
            steps[ev.step] = (max(step_s, ev.step_s), [*loads, ev.compute_s / predicted])
    if not steps:
        return None
    loads = {k: statistics.fmean(v[1]) for k, v in steps.items()}
    return (statistics.median(loads.values()),
            statistics.median(v[0] / loads[k] for k, v in steps.items()))


def summarize(split: str, status: dict[str, Any], plan_time: float | None,
              events: dict[int, list[StepEvent]], args: argparse.Namespace,
              flops: float) -> dict[str, Any]:
    job, plan = status["job"], status["plan"] or {}
    speeds = {a["id"]: a["device"]["flops"] for a in status["agents"]}
    measured = job["measured_step_s"]
    predicted = plan.get("predicted_step_s", 0.0)
    load, normalized = _normalized_step(args, events, plan.get("layer_splits", []),
                                        flops) or (None, None)

    def error(p: float | None, of: float | None = measured) -> float | None:
        return abs(p - of) / of if of and p else None

    return {"split": split, "layer_splits": plan.get("layer_splits", []),
            "grid": plan.get("grid", []),
            "stage_speeds": [[speeds.get(a, 0.0) for a in row] for row in plan.get("grid", [])],
            "predicted_plan_s": plan_time, "predicted_step_s": predicted,
            "measured_step_s": measured, "tokens_per_s": job["tokens_per_s"],
            "load": load, "normalized_step_s": normalized,
            "plan_error": error(plan_time), "prediction_error": error(predicted),
            "plan_error_normalized": error(plan_time, normalized),
            "workers": _workers(args, events)}


def calibrate_flops(args: argparse.Namespace) -> float:
    """FLOP/s one worker reaches on this model with `--threads` threads: one micro-batch's
    forward and backward through the whole model (as the workers run it), the fastest of 20
    after 3 warm-ups (other work on the machine only ever slows one down), FLOPs counted as
    the scheduler counts them (`compute.stage_flops`)."""
    import torch

    from agent.worker.stage import Stage, lm_loss

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    spec = get_preset(args.model)
    micro = args.batch // (args.agents // args.stages) // args.micro_batches
    model = Stage(spec, 0, spec.n_layers, seed=0).to(device)
    x = torch.randint(0, spec.vocab_size, (micro, spec.seq_len), device=device)
    times = []
    for n in range(23):
        t0 = time.perf_counter()
        lm_loss(model(x), x).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if n >= 3:
            times.append(time.perf_counter() - t0)
    return stage_flops(spec, 0, spec.n_layers, micro * spec.seq_len) / min(times)


def _pct(x: float | None) -> str:
    return f"{100 * x:.0f} %" if x is not None else "-"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'round':>5} {'split':<6} {'layers':<8} {'plan s':>7} {'refreshed s':>11} "
             f"{'measured s':>10} {'tokens/s':>9} {'refr. err':>9} {'load':>5} "
             f"{'normalized s':>12} {'plan err':>8}"]
    for r in rows:
        plan = f"{r['predicted_plan_s']:.3f}" if r["predicted_plan_s"] else "-"
        lines.append(f"{r['round']:>5} {r['split']:<6} {','.join(map(str, r['layer_splits'])):<8} "
                     f"{plan:>7} {r['predicted_step_s']:>11.3f} {r['measured_step_s']:>10.3f} "
                     f"{r['tokens_per_s']:>9.0f} {_pct(r['prediction_error']):>9} "
                     f"{r['load'] or 0:>5.2f} {r['normalized_step_s'] or 0:>12.3f} "
                     f"{_pct(r['plan_error_normalized']):>8}")
    return "\n".join(lines)


def speedups(rows: list[dict[str, Any]], key: str = "tokens_per_s") -> list[float]:
    """auto's speed over even's, per round: tokens/s, or the inverse of a step time."""
    by = {(r["round"], r["split"]): r[key] for r in rows}
    ratios = [by[k, "auto"] / by[k, "even"] for k in sorted({r["round"] for r in rows})
              if by.get((k, "even")) and by.get((k, "auto"))]
    return ratios if key == "tokens_per_s" else [1.0 / x for x in ratios]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    flops = args.flops or calibrate_flops(args)
    print(f"this machine: {flops / 1e9:.2f} GFLOP/s per worker "
          f"({'given' if args.flops else 'calibrated'}); the fast agents report "
          f"{flops / args.base_slowdown / 1e9:.2f}, the slow ones "
          f"{flops / args.base_slowdown / args.slowdown / 1e9:.2f}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="dtfm-uneven-") as tmp:
        for k in range(args.rounds):
            for split in args.splits.split(","):
                work = Path(args.workdir or tmp) / f"{split}-{k}"
                rows.append({"round": k, **run_job(args, split, flops, work)})
    print(table(rows))
    ratios, normal = speedups(rows), speedups(rows, "normalized_step_s")
    speedup = statistics.median(ratios) if ratios else None
    normal_speedup = statistics.median(normal) if normal else None
    if speedup is not None and normal_speedup is not None:
        print(f"auto / even, measured tokens/s: {speedup:.2f}x (rounds: "
              f"{', '.join(f'{x:.2f}' for x in ratios)}); load-normalized: "
              f"{normal_speedup:.2f}x ({', '.join(f'{x:.2f}' for x in normal)}); "
              "target >= 1.3x for a 2:1 mix")
    result = {"args": vars(args), "worker_flops": flops,
              "fast_flops": flops / args.base_slowdown,
              "slow_flops": flops / args.base_slowdown / args.slowdown, "rows": rows,
              "speedups": ratios, "speedup_auto_over_even": speedup,
              "normalized_speedups": normal, "normalized_speedup_auto_over_even": normal_speedup,
              "time": time.time()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
