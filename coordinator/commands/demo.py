"""`coordinator demo`: the whole product on one machine, with nothing set up.

Starts a coordinator and several agents as real processes on loopback (a fresh token in a
temporary directory), lets the coordinator measure links, schedule and push assignments, and
prints the job's progress until training ends, then where the loss went, how long it took and
what to try next. Everything it started is stopped on the way out, whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from coordinator.commands import demo_badpeer
from coordinator.commands.status import status_to_json, step_time_line
from coordinator.web.sessions import login_url
from dtfm import flags, rpc
from dtfm.core.events import WorkerEnv
from dtfm.core.words import stages_x_replicas
from dtfm.procs import terminate_all
from dtfm.progressline import ProgressLine
from dtfm.rpc import free_port
from protos.dtfm.v1 import coordinator_pb2, coordinator_pb2_grpc

# (loopback demo, --wan world demo) defaults of the flags that differ between the two
DEFAULTS = {"model": ("gpt-tiny", "gpt-mini"), "agents": (4, 8), "stages": (2, 4),
            "replicas": (2, 2), "steps": (80, 10), "batch": (8, 16), "micro_batches": (2, 4)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model preset (gpt-tiny; gpt-mini with --wan)")
    p.add_argument("--agents", type=int, help="agents to start (4; with --wan: one in each of "
                   "8 cities, 8 in all, or 8 x --per-city)")
    p.add_argument("--stages", type=int, help="pipeline stages (2; 4 with --wan)")
    p.add_argument("--replicas", type=int,
                   help="data-parallel replicas (2; with --wan: the agents / --stages)")
    p.add_argument("--steps", type=int, help="training steps (80; 10 with --wan)")
    p.add_argument("--batch", type=int, help="global batch (8; 16 with --wan)")
    p.add_argument("--micro-batches", type=int, help="micro-batches per replica (2; 4 with --wan)")
    p.add_argument("--wan", choices=["world"], default=None,
                   help="run on an emulated world-wide WAN (one network namespace per agent, "
                   "the paper's delays; needs root) and compare the scheduled placement with "
                   "network-blind rank order")
    p.add_argument("--per-city", type=int, default=1, help="agents per city with --wan world")
    p.add_argument("--nat", type=int, default=0, metavar="N",
                   help="with --wan world: put N agents behind NAT routers (they accept no "
                   "inbound connection; two of them share one site when N >= 2)")
    p.add_argument("--scale", type=float, default=25.0,
                   help="emulated Mbit/s per Gbit/s of the paper's bandwidths (--wan)")
    demo_badpeer.add_argument(p)
    p.add_argument("--workdir", default="", help="keep logs and state here (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=900.0, help="give up after this many s")
    p.add_argument("--json", action="store_true", help="print one JSON object per update")
    flags.add_common_args(p, config_file=False)


def _resolve_defaults(args: argparse.Namespace) -> str:
    """Fill the flags left out; an error message where --wan fixes a flag given otherwise."""
    wan = args.wan is not None
    if args.bad_peer is not None and (wrong := demo_badpeer.resolve(args)):
        return wrong
    if wan and args.agents is not None and args.agents != 8 * args.per_city:
        return (f"--agents {args.agents}: the --wan world demo runs 8 x --per-city agents "
                f"({8 * args.per_city} with --per-city {args.per_city}); set --per-city "
                f"instead")
    for name, pair in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, pair[wan])
    if wan:
        args.agents = 8 * args.per_city
        args.replicas = args.agents // args.stages
    return ""


def run(args: argparse.Namespace) -> int:
    if wrong := _resolve_defaults(args):
        return flags.fail(wrong)
    if args.nat and args.wan is None:
        return flags.fail("--nat puts emulated agents behind NAT routers: it needs --wan world")
    if args.wan is not None:
        from coordinator.commands.demo_wan import run_wan

        return run_wan(args)
    if args.stages * args.replicas != args.agents:
        return flags.fail(f"--stages {args.stages} x --replicas {args.replicas} must equal "
                            f"--agents {args.agents}")
    # a temporary workdir is removed after a clean run and kept after a failure, for its logs
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dtfm-demo-"))
    code = 1
    try:
        code = _run_in(workdir, args)
    finally:
        if code == 0 and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return code


def agents_env(agents: int) -> dict[str, str]:
    """The demo's agents share one machine: each worker computes on its share of the cores.
    Left to torch, every worker takes a thread per core, and N of them oversubscribe the
    machine N times over, their OpenMP threads spinning on cores the others need."""
    threads = str(max(1, (os.cpu_count() or 1) // max(agents, 1)))
    return {**os.environ, WorkerEnv.THREADS: threads, "OMP_NUM_THREADS": threads}


def _run_in(workdir: Path, args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as stack:
        workdir.mkdir(parents=True, exist_ok=True)
        token_file = workdir / "token"
        token_file.write_text(secrets.token_hex(16))
        token_file.chmod(0o600)
        address = f"127.0.0.1:{free_port()}"
        web = f"127.0.0.1:{free_port()}"
        procs: list[subprocess.Popen[bytes]] = []
        stack.callback(terminate_all, procs)
        py = [sys.executable, "-m"]
        common = ["--token-file", str(token_file), "--log-level", "info"]
        coord_log = open(workdir / "coordinator.log", "wb")  # noqa: SIM115 - closed by stack
        stack.callback(coord_log.close)
        procs.append(subprocess.Popen(
            [*py, "coordinator", "start", "--listen", address, *common,
             "--model", args.model, "--agents", str(args.agents), "--stages", str(args.stages),
             "--replicas", str(args.replicas), "--steps", str(args.steps),
             "--batch", str(args.batch), "--micro-batches", str(args.micro_batches),
             "--search-seconds", "2", "--checkpoint-dir", str(workdir / "checkpoints"),
             # a validation curve beside the training loss on the page: four points
             "--eval-every", str(max(1, args.steps // 4)), "--web", web,
             *(demo_badpeer.coordinator_flags(args) if args.bad_peer else [])],
            stdout=coord_log, stderr=subprocess.STDOUT, start_new_session=True))
        env = agents_env(args.agents)
        for i in range(args.agents):
            log_file = open(workdir / f"agent-{i}.log", "wb")  # noqa: SIM115
            stack.callback(log_file.close)
            bad = args.bad_peer and i == args.agents - 1  # the last agent, with --bad-peer
            procs.append(subprocess.Popen(
                [*py, "agent", "start", "--coordinator", address, "--listen", "127.0.0.1:0",
                 "--state-dir", str(workdir / f"agent-{i}"), "--device", "cpu", *common],
                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                env=demo_badpeer.bad_env(env, args.bad_peer) if bad else env))
        print(f"demo: coordinator on {address}, {args.agents} agents, logs in {workdir}",
              file=sys.stderr)
        if args.bad_peer:
            print(f"demo: agent-{args.agents - 1} is the bad peer: its workers send "
                  f"{args.bad_peer} values from step {demo_badpeer.ONSET} on", file=sys.stderr)
        security = rpc.Security(token=token_file.read_text())
        print(f"demo: watch it live in a browser: {login_url(f'http://{web}', security.token)}",
              file=sys.stderr)
        return flags.run_async(_watch(address, security, procs, args, workdir))
    return 1  # pragma: no cover


# What to try after the loopback demo: the same product across an emulated WAN, then machines.
NEXT_STEPS = [
    "the scheduler on an emulated world-wide WAN, against network-blind rank order: "
    "`sudo .venv/bin/coordinator demo --wan world` (needs root, about 3 minutes)",
    "your own machines: README.md, \"Running a real cluster\" (tune their TCP with "
    "deploy/install.sh or deploy/sysctl.d)",
]


def summary(history: coordinator_pb2.JobHistory, status: coordinator_pb2.ClusterStatus,
            seconds: float) -> dict[str, Any]:
    """Where the loss went (first and last step that reported one), how long it took (all
    of it, and a step as the members measured it), and what to try next: the demo's last
    word."""
    losses = [p for p in history.points if p.loss > 0]
    step_times = [p.step_s for p in history.points if p.step_s > 0]
    first, last = (losses[0], losses[-1]) if losses else (None, None)
    steps = status.job.step or status.job.total_steps
    return {
        "model": status.job.model, "agents": len(status.agents),
        "stages": status.plan.stages, "replicas": status.plan.replicas,
        "steps": steps, "first_step": first.step if first else 0,
        "first_loss": first.loss if first else 0.0, "last_step": last.step if last else 0,
        "last_loss": last.loss if last else 0.0, "seconds": round(seconds, 1),
        "step_s": round(statistics.median(step_times), 4) if step_times else 0.0,
        "plan_cost": status.plan.cost, "next": NEXT_STEPS,
        # the plan's predicted step against the measured one, and why where far apart
        "step_time": step_time_line(status_to_json(status)) if status.job.predicted_step_s
        else "",
    }


def summary_text(s: dict[str, Any]) -> str:
    loss = (f"loss {s['first_loss']:.3f} at step {s['first_step']} -> {s['last_loss']:.3f} at "
            f"step {s['last_step']}" if s["last_step"] else "no loss reported")
    return (f"demo: trained {s['steps']} steps of {s['model']} on {s['agents']} agents "
            f"({stages_x_replicas(s['stages'], s['replicas'])}) in {s['seconds']:.0f} s "
            f"({s['step_s']:.2f} s a step); {loss}; "
            f"plan cost {s['plan_cost']:.4f} s\n"
            + (f"demo: {s['step_time']}\n" if s.get("step_time") else "")
            + "".join(f"demo: next, {n}\n" for n in s["next"]))


async def _summary(stub: coordinator_pb2_grpc.CoordinatorStub,
                   status: coordinator_pb2.ClusterStatus, started: float) -> dict[str, Any]:
    """`summary` of the finished job, with its loss history from the coordinator."""
    try:
        history = await stub.GetHistory(coordinator_pb2.HistoryRequest(), timeout=5.0)
    except grpc.aio.AioRpcError:
        history = coordinator_pb2.JobHistory()  # the summary then says no loss was reported
    return summary(history, status, time.monotonic() - started)


async def _watch(address: str, security: rpc.Security, procs: list[subprocess.Popen[bytes]],
                 args: argparse.Namespace, workdir: Path) -> int:
    started = time.monotonic()
    deadline = started + args.timeout
    last_line = ""
    progress = ProgressLine(sys.stdout)  # in place on a terminal, sparse into a file
    start_step_time: tuple[int, float] | None = None
    async with rpc.open_channel(address, security) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        while time.monotonic() < deadline:
            # an excluded agent exits (its re-join is refused): the bad peer may
            dead = [p for p in procs[:len(procs) - bool(args.bad_peer)] if p.poll() is not None]
            if dead:
                progress.finish()
                return flags.fail(f"a demo process exited early (code {dead[0].returncode}); "
                                    f"see the logs in {workdir}", 1)
            try:
                status = await stub.GetStatus(coordinator_pb2.StatusRequest(), timeout=5.0)
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.5)
                continue
            job = status.job
            state = coordinator_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_").lower()
            alive = sum(a.state == coordinator_pb2.AGENT_STATE_ALIVE for a in status.agents)
            if job.step and start_step_time is None:
                start_step_time = (job.step, time.monotonic())
            eta = ""
            if start_step_time and job.step > start_step_time[0]:
                rate = (job.step - start_step_time[0]) / (time.monotonic() - start_step_time[1])
                eta = f"  ETA {max(0.0, (job.total_steps - job.step) / rate):.0f}s"
            done = job.state == coordinator_pb2.JOB_STATE_DONE
            closing = await _summary(stub, status, started) if done else None
            if closing is not None and args.bad_peer:  # what the rehearsal showed
                closing["bad_peer"] = demo_badpeer.outcome(
                    status_to_json(status), demo_badpeer.agent_id(
                        workdir / f"agent-{args.agents - 1}"), args.bad_peer)
            if args.json:
                update = {"state": state, "agents_alive": alive, "step": job.step,
                          "total_steps": job.total_steps, "loss": job.loss,
                          "tokens_per_s": job.tokens_per_s}
                line = json.dumps({**update, "summary": closing} if closing else update)
            else:
                line = (f"[{state}] agents {alive}/{args.agents}  step {job.step}/"
                        f"{job.total_steps}  loss {job.loss:.4f}  "
                        f"{job.tokens_per_s:.0f} tok/s{eta}  {job.message}")
            if args.json:
                if line != last_line:
                    print(line, flush=True)
                    last_line = line
            else:  # a new state or agent count is an event; else a line every 10 s in a file
                progress.show(line, key=(state, alive))
            if closing is not None:
                progress.finish()
                sys.stderr.write(summary_text(closing))
                if not args.bad_peer:
                    return 0
                sys.stderr.write(demo_badpeer.outcome_text(closing["bad_peer"]))
                return 0 if closing["bad_peer"]["excluded"] else 1
            if job.state == coordinator_pb2.JOB_STATE_FAILED:
                progress.finish()
                return flags.fail(f"job failed: {job.message}; see logs in {workdir}", 1)
            await asyncio.sleep(1.0)
    progress.finish()
    return flags.fail(f"demo did not finish within {args.timeout:.0f} s; logs in {workdir}", 1)
