"""Benchmark: churn. Random faults during one long job, and how the job comes back from each.

One coordinator (with `--state-dir`, so it survives SIGKILL) and `--agents` agents on
loopback, each with its own state directory and no shared checkpoint storage (each agent keeps
its stages' checkpoints; peers copy them), train one gpt-tiny job (`--stages` x
agents/stages replicas, `--min-agents` so that it may shrink). Every `--gap` steps (drawn at
random) one fault is injected, of a kind and on a victim drawn by `random.Random(--seed)`
(each kind equally often, in a shuffled order):

- `agent-kill`: SIGKILL of an agent's process group (its worker dies of the parent-death
  signal); the agent is started again, on the same state directory, 2-6 s later, so the job
  can grow back (its checkpoints on disk may be stale by then);
- `worker-kill`: SIGKILL of one member's worker process; its agent lives on;
- `coordinator-kill`: SIGKILL of the coordinator, started again at once on the same port with
  the same flags and state directory (it adopts the running job);
- `agent-stop`: SIGSTOP of an agent and its worker (a frozen machine) for the liveness
  timeout + 3 s, then SIGCONT.

Before each fault the job must be back to normal: running, at its full layout, every agent
alive, the last recovery trained. After each fault the coordinator is polled every 0.5 s:
"stall" is the time from the fault until the job trains a new step (the coordinator's
`stalled_s` is the same from its own side: from when it noticed to the new epoch's first
step), "catch-up" the time until the step passes the step at the fault again. Each row shows
the coordinator's recovery (reason, layout before and after, step resumed after, steps lost)
and whether a checkpoint it had counted was lost (resumed before `checkpoint_step` at the
fault). A fault with no recovery within `--fault-timeout` seconds stops the run and is
reported with the coordinator's log around it.

At the end: every checkpoint on every agent is verified against its manifest
(`dtfm.core.checkpoints.verify`), leftover temp and partial files are counted; the final
training loss (the coordinator's, at the last step), the validation loss (the workers' done
events) and the whole loss curve (from the workers' progress files, the newest epoch per step)
are compared with an uninterrupted run of the same seed, and, as the noise level, with one of
seed + 1. Writes bench/results/chaos.json.

    .venv/bin/python bench/chaos.py [--faults 20] [--seed 0] [--agents 6] [--steps 0 (auto)]
                                    [--quick] [--no-baseline] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "chaos.json"
TOKEN = "bench-chaos-token-0123"
KINDS = ("agent-kill", "worker-kill", "coordinator-kill", "agent-stop")
# not in the default mix: a worker dies and the coordinator is killed while it recovers
EXTRA_KINDS = ("coordinator-kill-in-recovery",)
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from coordinator.commands.status import status_to_json  # noqa: E402
from dtfm.core import checkpoints as ondisk  # noqa: E402
from dtfm.procs import terminate_all, wait_for  # noqa: E402
from dtfm.rpc import free_port, listening  # noqa: E402
from protos.dtfm.v1 import coordinator_pb2, coordinator_pb2_grpc  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="a smoke run: 4 faults, one per kind")
    p.add_argument("--seed", type=int, default=0, help="the job's seed and the faults'")
    p.add_argument("--agents", type=int, default=6)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--min-agents", type=int, default=4)
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--steps", type=int, default=0,
                   help="steps of the job (0: enough for the faults, 25 per fault + 60)")
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--gap", default="15,25", help="steps between faults: MIN,MAX (random)")
    p.add_argument("--liveness-timeout", type=float, default=3.0)
    p.add_argument("--heartbeat-interval", type=float, default=0.5)
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--measure", action="store_true",
                   help="let the agents measure their links (default: --no-measure)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"fault kinds to draw from (also: {', '.join(EXTRA_KINDS)})")
    p.add_argument("--fault-timeout", type=float, default=300.0,
                   help="seconds a fault may take to recover before the run stops")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the uninterrupted runs (seed, seed + 1)")
    p.add_argument("--job-flags", default="",
                   help="more `coordinator start` flags for every run, one string (the "
                   "integrity false-positive run: \"--pp-compress int4 --sync-every 8\")")
    p.add_argument("--slow-agent", type=float, default=1.0,
                   help="agent-0 computes this many times slower (DTFM_COMPUTE_SLOWDOWN): "
                   "slow is not wrong, so integrity must not exclude it")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--workdir", default="", help="keep the daemons' logs and state here")
    args = p.parse_args(argv)
    if args.quick:
        args.faults = 4
    if not args.steps:
        args.steps = 25 * args.faults + 60
    args.kinds = args.kinds.split(",")
    unknown = set(args.kinds) - set(KINDS) - set(EXTRA_KINDS)
    if unknown:
        p.error(f"unknown fault kind(s): {', '.join(sorted(unknown))}")
    lo, hi = (int(x) for x in args.gap.split(","))
    args.gap_range = (lo, hi)
    return args


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTFM_")}
    return {**env, "DTFM_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}


def _note(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Cluster:
    """A coordinator and its agents as real processes; every one stopped on exit."""

    def __init__(self, args: argparse.Namespace, work: Path, seed: int) -> None:
        self.args, self.work, self.seed = args, work, seed
        self.procs: list[subprocess.Popen[bytes]] = []
        self.address = f"127.0.0.1:{free_port()}"
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.stopped: set[int] = set()  # pids we sent SIGSTOP, to SIGCONT on the way out
        self._channel = grpc.insecure_channel(self.address)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)

    # --- processes ---
    def spawn(self, args: list[str], name: str, env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        with open(self.work / f"{name}.log", "ab") as log:
            log.write(f"===== {time.strftime('%H:%M:%S')} bench/chaos.py starts {name}\n"
                      .encode())
            log.flush()
            proc = subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT, env={**_env(), **(env or {})},
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def coordinator_flags(self) -> list[str]:
        a = self.args
        flags = ["coordinator", "start", "--listen", self.address, "--model", a.model,
                 "--agents", str(a.agents), "--min-agents", str(a.min_agents),
                 "--stages", str(a.stages), "--replicas", str(a.agents // a.stages),
                 "--steps", str(a.steps), "--batch", str(a.batch),
                 "--micro-batches", str(a.micro_batches),
                 "--checkpoint-every", str(a.checkpoint_every), "--seed", str(self.seed),
                 "--search-seconds", "1", "--max-restarts", str(a.max_restarts),
                 "--liveness-timeout", str(a.liveness_timeout),
                 "--heartbeat-interval", str(a.heartbeat_interval),
                 "--state-dir", str(self.work / "coordinator-state")]
        flags += shlex.split(a.job_flags)
        return flags if a.measure else [*flags, "--no-measure"]

    def start_coordinator(self) -> None:
        self.coordinator = self.spawn(self.coordinator_flags(), "coordinator")
        wait_for(lambda: listening(self.address) or self.coordinator.poll() is not None, 60,
              "the coordinator to listen", interval=0.1)
        if self.coordinator.poll() is not None:
            raise RuntimeError(f"the coordinator exited: see {self.work / 'coordinator.log'}")

    def start_agent(self, name: str) -> None:
        slow = ({"DTFM_COMPUTE_SLOWDOWN": str(self.args.slow_agent)}
                if name == "agent-0" and self.args.slow_agent != 1.0 else {})
        self.agents[name] = self.spawn(
            ["agent", "start", "--coordinator", self.address, "--state-dir",
             str(self.work / name), "--device", "cpu"], name, slow)

    def agent_id(self, name: str) -> str:
        path = self.work / name / "agent-id"
        return path.read_text().strip() if path.exists() else ""

    def names_by_id(self) -> dict[str, str]:
        return {self.agent_id(n): n for n in self.agents}

    def worker_pids(self, name: str) -> list[int]:
        """The live worker processes training for agent `name`: a fresh worker names its
        assignment's path on its command line; a spare that took an assignment (it got the
        path on stdin) has moved its stdout to the assignment's log. An idle spare has
        neither, and is not a worker to kill."""
        mark = f"{self.work / name / 'work'}/"
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                cmd = (d / "cmdline").read_bytes().split(b"\0")
                if b"agent.worker" not in cmd:
                    continue
                if any(c.decode(errors="replace").startswith(mark) for c in cmd) or \
                        os.readlink(d / "fd" / "1").startswith(mark):
                    pids.append(int(d.name))
        return pids

    def signal_group(self, pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        if sig == signal.SIGSTOP:
            self.stopped.add(pid)
        elif sig == signal.SIGCONT:
            self.stopped.discard(pid)

    def close(self) -> None:
        for pid in list(self.stopped):
            self.signal_group(pid, signal.SIGCONT)
        self._channel.close()
        terminate_all(self.procs)

    # --- the coordinator's view ---
    def status(self) -> dict[str, Any] | None:
        """`coordinator status --json`, or None while the coordinator does not answer."""
        try:
            reply = self._stub.GetStatus(coordinator_pb2.StatusRequest(), timeout=5.0,
                                         metadata=(("authorization", f"Bearer {TOKEN}"),))
        except grpc.RpcError:
            return None
        return status_to_json(reply)

    def log_lines(self, since: float, until: float, name: str = "coordinator") -> list[str]:
        """Lines of a daemon's log between two times (by the HH:MM:SS its lines start
        with; lines without a time belong to the line before)."""
        lines, keep = [], False
        lo, hi = time.strftime("%H:%M:%S", time.localtime(since)), \
            time.strftime("%H:%M:%S", time.localtime(until))
        for line in (self.work / f"{name}.log").read_text(errors="replace").splitlines():
            stamp = _stamp(line)
            if stamp:
                keep = lo <= stamp <= hi
            if keep:
                lines.append(line)
        return lines


def _stamp(line: str) -> str:
    """The HH:MM:SS of a log line (`2026-01-01 12:00:00,123 ...` or `12:00:00 ...`)."""
    for token in line.split()[:3]:
        head = token[:8]
        if len(head) == 8 and head[2] == ":" and head[5] == ":" and head.replace(":", "").isdigit():
            return head
    return ""


def steady(c: Cluster, min_step: int) -> dict[str, Any] | None:
    """The status once the job is back to normal and past `min_step`, else None."""
    s = c.status()
    if s is None:
        return None
    job = s["job"]
    if job["state"] in ("done", "failed"):
        return s
    alive = [a for a in s["agents"] if a["state"] == "alive"]
    full = job["stages"] * job["replicas"] == c.args.agents
    # this epoch trained a step (members' reports are per epoch); not the recovery record's
    # stalled_s, which a coordinator restart in mid-recovery may leave unset
    trained = job["step"] > 0
    ok = (job["state"] == "running" and full and trained and len(alive) >= c.args.agents
          and job["step"] >= min_step)
    return s if ok else None


def inject(c: Cluster, kind: str, victim: str, rng: random.Random,
           before: dict[str, Any], t0: float) -> dict[str, Any]:
    """Do the fault; returns what was done and what is left to do later (restarts)."""
    out: dict[str, Any] = {"kind": kind, "victim": victim}
    if kind == "agent-kill":
        proc = c.agents[victim]
        c.signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
        out["restart_after_s"] = round(rng.uniform(2.0, 6.0), 1)
    elif kind == "worker-kill":
        pids = wait_for(lambda: c.worker_pids(victim), 10, f"the worker of {victim}", 0.1)
        out["pid"] = pids[0]
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[0], signal.SIGKILL)
    elif kind == "coordinator-kill-in-recovery":
        pids = wait_for(lambda: c.worker_pids(victim), 10, f"the worker of {victim}", 0.1)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[0], signal.SIGKILL)
        n = len(before["job"]["recoveries"])
        # the coordinator has begun the recovery (and, usually, sent the new epoch's
        # assignments) but the new epoch has not trained yet
        wait_for(lambda: (x := c.status()) and len(x["job"]["recoveries"]) > n, 30,
              "the recovery to begin", 0.1)
        time.sleep(rng.uniform(0.0, 1.0))
        out["coordinator_killed_at_s"] = round(time.time() - t0, 1)
        assert c.coordinator is not None
        c.signal_group(c.coordinator.pid, signal.SIGKILL)
        c.coordinator.wait()
        c.start_coordinator()
    elif kind == "coordinator-kill":
        assert c.coordinator is not None
        c.signal_group(c.coordinator.pid, signal.SIGKILL)
        c.coordinator.wait()
        c.start_coordinator()
        out["restarted_after_s"] = 0.0
    elif kind == "agent-stop":
        pids = [c.agents[victim].pid, *c.worker_pids(victim)]
        for pid in pids:
            c.signal_group(pid, signal.SIGSTOP)
        out["stopped_pids"] = pids
        out["resume_after_s"] = c.args.liveness_timeout + 3.0
    return out


def follow_fault(c: Cluster, fault: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """Poll until the fault's recovery (if any) trained and the job caught up; restart or
    resume the victim when due. Records when training went on again ("stall") and when the
    step passed the last step reached before the fault again ("catch-up")."""
    t0, job0 = fault["t"], before["job"]
    step0, epoch0, n_rec = job0["step"], job0["epoch"], len(job0["recoveries"])
    deadline = t0 + c.args.fault_timeout
    same_epoch = new_epoch = catch = None  # seconds after the fault
    pending = {"agent-kill": "restart_after_s", "agent-stop": "resume_after_s"}.get(fault["kind"])
    last: dict[str, Any] | None = None
    while time.time() < deadline:
        now = time.time()
        if pending and now - t0 >= fault[pending]:
            if fault["kind"] == "agent-kill":
                c.start_agent(fault["victim"])
            else:
                for pid in fault["stopped_pids"]:
                    c.signal_group(pid, signal.SIGCONT)
            fault[pending.replace("_after_s", "ed_at_s")] = round(now - t0, 1)
            pending = None
        s = c.status()
        if s is not None:
            last = s
            job = s["job"]
            if job["state"] == "failed":
                break
            recs = [r for r in job["recoveries"][n_rec:] if not r["planned"]]
            done = job["state"] == "done"
            if same_epoch is None and (job["epoch"] == epoch0 and job["step"] > step0 or done):
                same_epoch = now - t0
            if new_epoch is None and (job["epoch"] > epoch0 and job["step"] > 0 or done):
                new_epoch = now - t0
            if recs and catch is None and (job["epoch"] > epoch0 and job["step"] >
                                           recs[0]["last_step"] or done):
                catch = now - t0
            settled = job["state"] == "running" and job["step"] > 0 and (
                not recs or job["epoch"] > epoch0)
            if not pending and settled and (
                    (recs and catch is not None) or done
                    or (fault["kind"] == "coordinator-kill" and same_epoch is not None)):
                break
        time.sleep(0.5)
    job = (last or before)["job"]
    recovered = any(not r["planned"] for r in job["recoveries"][n_rec:])
    fault.update({
        # a recovery: the new epoch's first step; none (an adopted job): the next step
        "stall_s": new_epoch if recovered else same_epoch,
        "catch_up_s": catch if recovered else same_epoch,
        "state_after": job["state"], "message_after": job["message"],
    })
    fault["recovered"] = fault["stall_s"] is not None and job["state"] != "failed"
    if not fault["recovered"]:
        fault["coordinator_log"] = c.log_lines(t0 - 5, time.time())[-80:]
    return fault


def attribute(faults: list[dict[str, Any]], final: dict[str, Any],
              first_step: dict[int, int]) -> None:
    """Give each fault the recoveries that began between it and the next fault (its own, and
    the planned grow-back that follows an agent's return), from the coordinator's record.

    The step a recovery resumed after is taken from the workers' own progress files (the
    first step the next epoch trained, minus one), not from the coordinator's record, which a
    coordinator restart in mid-recovery leaves unset; `record_ok` says whether the two agree.
    """
    recoveries = final["job"]["recoveries"]
    for i, f in enumerate(faults):
        end = faults[i + 1]["t"] if i + 1 < len(faults) else math.inf
        recs = [r for r in recoveries if f["t"] - 1 <= r["at_unix_s"] < end - 1]
        own = [r for r in recs if not r["planned"]]
        f["recoveries"] = recs
        f["back_to_full_s"] = round(max([r["at_unix_s"] + r["stalled_s"] - f["t"] for r in recs]
                                        + [f["stall_s"] or 0.0]), 1)
        for key in ("stall_s", "catch_up_s"):
            f[key] = None if f[key] is None else round(f[key], 1)
        later = sorted(e for e in first_step if e > f["epoch"])
        if own:
            r = own[0]
            resumed = first_step[later[0]] - 1 if later else None
            f.update({"reason": r["reason"], "layout": f"{r['layout_before']}->"
                      f"{r['layout_after'] or '?'}", "resumed_step": resumed,
                      "steps_lost": None if resumed is None else r["last_step"] - resumed,
                      "coordinator_stall_s": round(r["stalled_s"], 1) or None,
                      "detect_s": round(r["at_unix_s"] - f["t"], 1),
                      "record_ok": r["stalled_s"] > 0 and r["resumed_step"] == resumed,
                      "lost_checkpoint": resumed is None or resumed < f["checkpoint_step"]})
        elif f["recovered"]:
            f.update({"reason": "(no recovery: the job went on)", "layout": "-", "detect_s": None,
                      "resumed_step": None, "steps_lost": 0, "coordinator_stall_s": None,
                      "record_ok": True, "lost_checkpoint": False})


def run_chaos(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rng = random.Random(args.seed)
    kinds = [args.kinds[i % len(args.kinds)] for i in range(args.faults)]
    rng.shuffle(kinds)
    c = Cluster(args, work, args.seed)
    faults: list[dict[str, Any]] = []
    try:
        c.start_coordinator()
        for i in range(args.agents):
            c.start_agent(f"agent-{i}")
        s = wait_for(lambda: steady(c, 1), 600, "the job to train its first step")
        started = time.time()
        for i, kind in enumerate(kinds):
            at = s["job"]["step"] + rng.randint(*args.gap_range)
            if at >= args.steps - 10:
                _note(f"no steps left for fault {i + 1} (it would fall at step {at})")
                break
            s = wait_for(lambda at=at: steady(c, at), args.fault_timeout,
                      f"the job to pass step {at} at its full layout")
            if s["job"]["state"] in ("done", "failed"):
                break
            members = [a for row in s["plan"]["grid"] for a in row]
            names = c.names_by_id()
            victim = names[rng.choice(members)] if kind != "coordinator-kill" else "coordinator"
            before = c.status() or s
            fault = {"n": i + 1, "t": time.time(), "step": before["job"]["step"],
                     "epoch": before["job"]["epoch"],
                     "checkpoint_step": before["job"]["checkpoint_step"],
                     "load": round(os.getloadavg()[0], 1)}
            fault.update(inject(c, kind, victim, rng, before, fault["t"]))
            _note(f"fault {i + 1}/{len(kinds)}: {kind} of {victim} at step {fault['step']}")
            follow_fault(c, fault, before)
            faults.append(fault)
            recs = (c.status() or s)["job"]["recoveries"][len(before["job"]["recoveries"]):]
            _note(f"  -> {recs[0]['reason'][:90] if recs else 'no recovery'}; stall "
                  f"{_fmt(fault['stall_s'], '.1f')} s, recovered {fault['recovered']}")
            if not fault["recovered"]:
                break
        done = wait_for(lambda: (x := c.status()) and x["job"]["state"] in ("done", "failed")
                     and x, args.fault_timeout + 20 * args.steps, "the job to finish")
        # let the last heartbeats land and workers exit before reading their files
        time.sleep(2)
        final = c.status() or done
        elapsed = time.time() - started
    finally:
        c.close()
    result = outcome(work, list(c.agents), final)
    attribute(faults, final, result["epoch_first_step"])
    return {"faults": faults, "final": final, "seconds": elapsed, "load_end": os.getloadavg(),
            **result}


def run_baseline(args: argparse.Namespace, work: Path, seed: int) -> dict[str, Any]:
    c = Cluster(args, work, seed)
    t0 = time.time()
    try:
        c.start_coordinator()
        for i in range(args.agents):
            c.start_agent(f"agent-{i}")
        final = wait_for(lambda: (x := c.status()) and x["job"]["state"] in ("done", "failed")
                      and x, 600 + 20 * args.steps, f"the uninterrupted job (seed {seed})")
        time.sleep(2)
        final = c.status() or final
    finally:
        c.close()
    return {"seed": seed, "final": final, "seconds": time.time() - t0,
            **outcome(work, list(c.agents), final)}


def outcome(work: Path, names: list[str], final: dict[str, Any]) -> dict[str, Any]:
    """The job's loss curve, validation loss and the state of every checkpoint on disk."""
    job_id = final["job"]["id"]
    curve: dict[int, tuple[int, float]] = {}  # step -> (epoch, loss) of the newest epoch
    vals: dict[int, list[float]] = {}
    first: dict[int, int] = {}  # epoch -> the first step its workers trained
    for name in names:
        for p in sorted((work / name / "work").glob(f"{job_id}-e*-r*.progress.jsonl")):
            epoch = int(p.name[len(job_id) + 2:].split("-")[0])
            for line in p.read_text(errors="replace").splitlines():
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e.get("event") == "step":
                    first[epoch] = min(first.get(epoch, e["step"]), e["step"])
                if e.get("event") == "step" and isinstance(e.get("loss"), float):
                    if e["step"] not in curve or curve[e["step"]][0] <= epoch:
                        curve[e["step"]] = (epoch, e["loss"])
                elif e.get("event") == "done" and e.get("val_loss"):
                    vals.setdefault(epoch, []).append(e["val_loss"])
    val = statistics.median(vals[max(vals)]) if vals else None
    return {"loss_curve": [[s, curve[s][1]] for s in sorted(curve)], "val_loss": val,
            "epoch_first_step": first,
            "train_loss": final["job"]["loss"], "checkpoints": check_checkpoints(
                work, names, job_id, final["job"]["total_steps"])}


def check_checkpoints(work: Path, names: list[str], job_id: str, last: int) -> dict[str, Any]:
    """Verify every step on every agent against its manifest."""
    intact = corrupt = incomplete = leftovers = 0
    bad: list[str] = []
    final_holders: dict[int, int] = {}
    for name in names:
        root = ondisk.job_dir(work / name / "checkpoints", job_id)
        for d in sorted(root.glob("stage-*")):
            stage = int(d.name.split("-")[1])
            for f in d.iterdir():
                if ondisk.TMP_RE.match(f.name) or ondisk.PART_RE.match(f.name):
                    leftovers += 1
                    bad.append(f"{name}/{d.name}/{f.name}: leftover")
            for step in ondisk.steps_available(root, stage):
                why = ondisk.verify(root, stage, step, job_id=job_id)
                if why is None:
                    intact += 1
                    if step == last:
                        final_holders[stage] = final_holders.get(stage, 0) + 1
                elif "no manifest" in why:
                    incomplete += 1
                    bad.append(f"{name}/{d.name}/step {step}: {why}")
                else:
                    corrupt += 1
                    bad.append(f"{name}/{d.name}/step {step}: {why}")
    return {"intact": intact, "corrupt": corrupt, "incomplete": incomplete,
            "leftovers": leftovers, "problems": bad,
            "final_step_holders": {str(k): v for k, v in sorted(final_holders.items())}}


def _fmt(x: Any, spec: str = "") -> str:
    return "-" if x is None else format(x, spec)


def table(faults: list[dict[str, Any]]) -> str:
    w = max([16] + [len(f["kind"]) for f in faults])
    head = (f"{'#':>2} {'kind':<{w}} {'victim':<11} {'step':>5} {'ckpt':>5} {'layout':<9} "
            f"{'resumed':>7} {'lost':>4} {'detect':>6} {'stall s':>7} {'coord s':>7} "
            f"{'catch s':>7} {'full s':>6} {'grow':>4} {'load':>5}  reason")
    lines = [head]
    for f in faults:
        planned = [r for r in f["recoveries"] if r["planned"]]
        lines.append(
            f"{f['n']:>2} {f['kind']:<{w}} {f['victim']:<11} {f['step']:>5} "
            f"{f['checkpoint_step']:>5} {f.get('layout', '?'):<9} "
            f"{_fmt(f.get('resumed_step')):>7} {_fmt(f.get('steps_lost')):>4} "
            f"{_fmt(f.get('detect_s'), '.1f'):>6} "
            f"{_fmt(f['stall_s'], '.1f'):>7} {_fmt(f.get('coordinator_stall_s'), '.1f'):>7} "
            f"{_fmt(f['catch_up_s'], '.1f'):>7} {_fmt(f.get('back_to_full_s'), '.1f'):>6} "
            f"{len(planned):>4} {f['load']:>5.1f}  "
            f"{(f.get('reason') or 'NOT RECOVERED')[:70]}")
    return "\n".join(lines)


def summarize(args: argparse.Namespace, chaos: dict[str, Any],
              baselines: list[dict[str, Any]]) -> dict[str, Any]:
    faults = chaos["faults"]
    rec = [f for f in faults if f["recovered"]]
    lost = [f["steps_lost"] for f in rec if f.get("steps_lost") is not None]
    stalls = [f["stall_s"] for f in rec if f["stall_s"] is not None]
    coord = [f["coordinator_stall_s"] for f in rec if f.get("coordinator_stall_s")]
    ck = chaos["checkpoints"]
    job = chaos["final"]["job"]
    s: dict[str, Any] = {
        "faults": len(faults), "recovered": len(rec),
        "by_kind": {k: sum(f["kind"] == k for f in faults) for k in args.kinds},
        "job_state": job["state"], "job_step": job["step"], "epochs": job["epoch"],
        "recoveries_total": len(job["recoveries"]),
        "planned_recoveries": sum(r["planned"] for r in job["recoveries"]),
        "corrupt_checkpoints": ck["corrupt"], "incomplete_checkpoints": ck["incomplete"],
        "leftover_files": ck["leftovers"], "intact_checkpoints": ck["intact"],
        "lost_checkpoints": sum(bool(f.get("lost_checkpoint")) for f in faults),
        "wrong_recovery_records": sum(not f.get("record_ok", True) for f in faults),
        "steps_lost_max": max(lost, default=None),
        "steps_lost_median": statistics.median(lost) if lost else None,
        "stall_median_s": statistics.median(stalls) if stalls else None,
        "stall_max_s": max(stalls, default=None),
        "coordinator_stall_median_s": statistics.median(coord) if coord else None,
        "train_loss": chaos["train_loss"], "val_loss": chaos["val_loss"],
    }
    if baselines:
        base = baselines[0]
        s["baseline_train_loss"], s["baseline_val_loss"] = base["train_loss"], base["val_loss"]
        s["d_train_loss"] = chaos["train_loss"] - base["train_loss"]
        s["d_val_loss"] = (chaos["val_loss"] - base["val_loss"]
                           if chaos["val_loss"] and base["val_loss"] else None)
        b = dict(map(tuple, base["loss_curve"]))  # type: ignore[arg-type]
        diffs = [abs(loss - b[st]) for st, loss in chaos["loss_curve"] if st in b]
        s["curve_max_abs_diff"] = max(diffs, default=None)
        s["curve_steps_compared"] = len(diffs)
        tail = [loss for st, loss in base["loss_curve"] if st > args.steps - 20]
        s["noise_step_to_step_std"] = statistics.stdev(tail) if len(tail) > 1 else None
        if len(baselines) > 1:
            other = baselines[1]
            s["noise_seed_train"] = abs(other["train_loss"] - base["train_loss"])
            s["noise_seed_val"] = (abs(other["val_loss"] - base["val_loss"])
                                   if other["val_loss"] and base["val_loss"] else None)
    noise = s.get("noise_seed_val") or s.get("noise_step_to_step_std")
    # integrity (issue 43): honest faults, a slow agent and lossy links exclude nobody
    rows = chaos["final"].get("agents", [])
    s["excluded"] = [a["id"] for a in rows if a.get("exclusion")]
    s["evidence"] = {a["id"]: [e["kind"] for e in a.get("evidence", [])] for a in rows
                     if a.get("evidence")}
    s["targets"] = {
        "nobody excluded": not s["excluded"],
        "20 faults": len(faults) >= 20,
        "every fault recovered": len(rec) == len(faults) and job["state"] == "done",
        "0 corrupt or lost checkpoints": ck["corrupt"] == 0 and s["lost_checkpoints"] == 0,
        f"steps lost <= {args.checkpoint_every}": bool(lost) and max(lost) <=
        args.checkpoint_every,
        "median stall < 20 s": s["stall_median_s"] is not None and s["stall_median_s"] < 20,
        "final loss within noise": (None if s.get("d_val_loss") is None or noise is None
                                    else abs(s["d_val_loss"]) <= noise),
    }
    return s


def summary_text(s: dict[str, Any]) -> str:
    def f(key: str, spec: str = ".4f") -> str:
        return _fmt(s.get(key), spec)

    lines = [
        f"faults {s['faults']} ({', '.join(f'{k} {v}' for k, v in s['by_kind'].items())}), "
        f"recovered {s['recovered']}; job {s['job_state']} at step {s['job_step']} after "
        f"{s['epochs']} epochs, {s['recoveries_total']} recoveries "
        f"({s['planned_recoveries']} planned grow-backs)",
        f"checkpoints: {s['intact_checkpoints']} intact, {s['corrupt_checkpoints']} corrupt, "
        f"{s['incomplete_checkpoints']} without manifest, {s['leftover_files']} temp/partial "
        f"leftovers; {s['lost_checkpoints']} recoveries resumed before the counted checkpoint; "
        f"{s['wrong_recovery_records']} coordinator recovery records wrong (no stall, or a "
        f"resume step the workers disagree with)",
        f"steps lost: max {f('steps_lost_max', '')}, median {f('steps_lost_median', '')}; "
        f"stall: median {f('stall_median_s', '.1f')} s, max {f('stall_max_s', '.1f')} s "
        f"(coordinator's stalled_s median {f('coordinator_stall_median_s', '.1f')} s)",
        f"final train loss {f('train_loss')} (uninterrupted {f('baseline_train_loss')}), "
        f"val loss {f('val_loss')} (uninterrupted {f('baseline_val_loss')}, diff "
        f"{f('d_val_loss', '+.2e')}); loss curve max |diff| {f('curve_max_abs_diff', '.2e')} "
        f"over {s.get('curve_steps_compared', 0)} steps; noise: seed+1 val "
        f"{f('noise_seed_val', '.4f')}, train {f('noise_seed_train', '.4f')}, step-to-step "
        f"std {f('noise_step_to_step_std', '.4f')}",
        f"integrity: excluded {s['excluded'] or 'nobody'}; evidence {s['evidence'] or 'none'}",
        "targets: " + "; ".join(f"{k}: {'not measured' if v is None else 'met' if v else 'MISSED'}"
                                for k, v in s["targets"].items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dtfm-chaos-") as tmp:
        root = Path(args.workdir or tmp)
        baselines = []
        if not args.no_baseline:
            for seed in (args.seed, args.seed + 1):
                work = root / f"baseline-seed{seed}"
                work.mkdir(parents=True, exist_ok=True)
                _note(f"uninterrupted run, seed {seed}, {args.steps} steps ({work})")
                baselines.append(run_baseline(args, work, seed))
                b = baselines[-1]
                _note(f"  -> {b['final']['job']['state']} train loss {b['train_loss']:.4f} "
                      f"val {b['val_loss']} in {b['seconds']:.0f} s")
        work = root / "chaos"
        work.mkdir(parents=True, exist_ok=True)
        _note(f"chaos run: {args.faults} faults, {args.steps} steps ({work})")
        chaos = run_chaos(args, work)
    print(table(chaos["faults"]))
    s = summarize(args, chaos, baselines)
    print(summary_text(s))
    for p in chaos["checkpoints"]["problems"][:20]:
        print(f"  checkpoint problem: {p}")
    for f in chaos["faults"]:
        if not f["recovered"]:
            print(f"fault {f['n']} ({f['kind']} of {f['victim']}) did not recover: "
                  f"{f['message_after']}")
            print("\n".join(f"    {line}" for line in f.get("coordinator_log", [])))
    result = {"args": {k: v for k, v in vars(args).items()}, "summary": s,
              "faults": chaos["faults"], "chaos_seconds": chaos["seconds"],
              "chaos": {k: chaos[k] for k in ("train_loss", "val_loss", "checkpoints",
                                              "loss_curve")},
              "final_job": chaos["final"]["job"],
              "baselines": [{k: b[k] for k in ("seed", "train_loss", "val_loss", "seconds",
                                               "checkpoints", "loss_curve")}
                            for b in baselines], "time": time.time()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
