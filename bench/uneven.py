"""Benchmark: uneven devices. The compute-aware layer split against the even one, measured.

Runs a coordinator and `--agents` agents on this machine (loopback, no link measurement) and
trains the same model for the same steps twice: once with `--layer-split even` and once with
`--layer-split auto`. Half of the agents are made slow: their environment carries
`DTFM_COMPUTE_SLOWDOWN=FACTOR` (the worker then takes FACTOR times as long for each stage's
forward and backward) and they report `--flops BASE/FACTOR` while the others report `--flops
BASE`, as an operator would pin a known speed mix. Each run's table row shows the layer split,
the plan's predicted step time, the measured step time (median of the members' steady steps,
from `coordinator status`), tokens/s, and the prediction's error; the summary gives the
speed-up of auto over even (the issue's target: >= 1.3x for a 2:1 mix) and writes
bench/results/uneven.json.

The slow agents' workers idle for the extra time (agent/worker/train.py, compute_slowdown), so
emulated devices sharing this machine's cores do not slow each other down.

    .venv/bin/python bench/uneven.py [--model gpt-mini] [--agents 4] [--stages 2]
                                     [--slowdown 2] [--steps 12] [--device cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
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

from dtfm.procs import terminate_all  # noqa: E402
from dtfm.rpc import free_port  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-mini")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--slowdown", type=float, default=2.0, help="slow agents take this factor")
    p.add_argument("--flops", type=float, default=0.0,
                   help="FLOP/s the fast agents report (0: measure this machine once)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--splits", default="even,auto", help="--layer-split values to compare")
    p.add_argument("--timeout", type=float, default=900.0, help="per job, seconds")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--workdir", default="", help="keep the daemons' logs here")
    return p.parse_args(argv)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTFM_")}
    return {**env, "DTFM_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1",
            **extra}


def _listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with contextlib.suppress(OSError), socket.create_connection((host, int(port)), 0.5):
        return True
    return False


class Cluster:
    """A coordinator and its agents, always stopped on exit."""

    def __init__(self, work: Path) -> None:
        self.work, self.procs = work, []  # type: ignore[var-annotated]

    def spawn(self, args: list[str], name: str, env: dict[str, str]) -> None:
        with open(self.work / f"{name}.log", "ab") as log:
            self.procs.append(subprocess.Popen([sys.executable, "-m", *args], cwd=REPO,
                                               stdout=log, stderr=subprocess.STDOUT, env=env,
                                               start_new_session=True))

    def status(self, address: str) -> dict[str, Any]:
        out = subprocess.run([sys.executable, "-m", "coordinator", "status", "--coordinator",
                              address, "--json"], cwd=REPO, capture_output=True, text=True,
                             env=_env(), timeout=60)
        if out.returncode:
            raise RuntimeError(f"coordinator status failed: {out.stderr.strip()}")
        return json.loads(out.stdout)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        terminate_all(self.procs)


def run_job(args: argparse.Namespace, split: str, flops: float) -> dict[str, Any]:
    """One job with `--layer-split split`; returns its plan and measured speed."""
    with tempfile.TemporaryDirectory(prefix="dtfm-uneven-") as tmp:
        work = Path(args.workdir or tmp) / split
        work.mkdir(parents=True, exist_ok=True)
        with Cluster(work) as c:
            address = f"127.0.0.1:{free_port()}"
            c.spawn(["coordinator", "start", "--listen", address, "--model", args.model,
                     "--agents", str(args.agents), "--stages", str(args.stages),
                     "--steps", str(args.steps), "--batch", str(args.batch),
                     "--micro-batches", str(args.micro_batches), "--no-measure",
                     "--layer-split", split, "--search-seconds", "2",
                     "--heartbeat-interval", "0.5"], "coordinator", _env())
            _wait(lambda: _listening(address), 30, "the coordinator to listen")
            for i in range(args.agents):
                slow = i >= args.agents // 2
                env = _env(**{SEAM_ENV: str(args.slowdown)}) if slow else _env()
                speed = flops / args.slowdown if slow else flops
                c.spawn(["agent", "start", "--coordinator", address, "--state-dir",
                         str(work / f"agent-{i}"), "--device", args.device,
                         "--flops", f"{speed:.6g}"], f"agent-{i}", env)
            status = _wait(lambda: _finished(c.status(address)), args.timeout, "the job")
    return summarize(split, status)


def _finished(status: dict[str, Any]) -> dict[str, Any] | None:
    state = status["job"]["state"]
    if state == "failed":
        raise RuntimeError(f"the job failed: {status['job']['message']}")
    return status if state == "done" else None


def _wait(pred: Any, timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.5)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def summarize(split: str, status: dict[str, Any]) -> dict[str, Any]:
    job, plan = status["job"], status["plan"] or {}
    speeds = {a["id"]: a["device"]["flops"] for a in status["agents"]}
    measured = job["measured_step_s"]
    predicted = plan.get("predicted_step_s", 0.0)
    return {"split": split, "layer_splits": plan.get("layer_splits", []),
            "grid": plan.get("grid", []),
            "stage_speeds": [[speeds.get(a, 0.0) for a in row] for row in plan.get("grid", [])],
            "predicted_step_s": predicted, "measured_step_s": measured,
            "tokens_per_s": job["tokens_per_s"],
            "prediction_error": abs(predicted - measured) / measured if measured else None}


def measure_flops() -> float:
    from agent.device import cpu_flops

    return statistics.median(cpu_flops() for _ in range(3))


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'split':<6} {'layers':<12} {'predicted s':>12} {'measured s':>11} "
             f"{'tokens/s':>10} {'pred. error':>11}"]
    for r in rows:
        err = f"{100 * r['prediction_error']:.0f} %" if r["prediction_error"] is not None else "-"
        lines.append(f"{r['split']:<6} {','.join(map(str, r['layer_splits'])):<12} "
                     f"{r['predicted_step_s']:>12.3f} {r['measured_step_s']:>11.3f} "
                     f"{r['tokens_per_s']:>10.0f} {err:>11}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    flops = args.flops or measure_flops()
    rows = [run_job(args, split, flops) for split in args.splits.split(",")]
    print(table(rows))
    by = {r["split"]: r for r in rows}
    speedup = None
    if "even" in by and "auto" in by and by["even"]["tokens_per_s"]:
        speedup = by["auto"]["tokens_per_s"] / by["even"]["tokens_per_s"]
        print(f"auto / even tokens/s: {speedup:.2f}x (target >= 1.3x for a 2:1 mix)")
    result = {"args": vars(args), "fast_flops": flops, "rows": rows,
              "speedup_auto_over_even": speedup, "time": time.time()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
