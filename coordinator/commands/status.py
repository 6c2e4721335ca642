"""`coordinator status` and `coordinator links`: query a running coordinator, print for people
or for scripts. The JSON shape is an interface other tools rely on (`agents[].id`, `.state`).
`status --watch` redraws `watch_frame` in place.
"""

from __future__ import annotations

import time
from typing import Any

from coordinator.daemon.reconcile import save_line
from coordinator.daemon.statusjson import (  # noqa: F401 - re-exported: the JSON lives there
    job_state_name,
    local_steps,
    reach_to_json,
    status_to_json,
)
from coordinator.integrity.status import integrity_lines
from coordinator.job.prediction import prediction_gap
from coordinator.job.replanlog import replans_to_text
from dtfm.core.breakdown import Breakdown
from dtfm.core.breakdown import line as breakdown_line
from dtfm.core.limits import OMITTED_METADATA
from dtfm.core.words import stages_x_replicas
from dtfm.rpc import is_loopback
from protos.dtfm.v1 import coordinator_pb2


def omitted_agents(trailers: object) -> int:
    """Agent rows the coordinator left out of a GetStatus answer (its trailing metadata)."""
    for key, value in trailers or ():  # type: ignore[attr-defined]
        if key == OMITTED_METADATA and str(value).isdigit():
            return int(value)
    return 0


def _reach_cell(r: dict[str, Any]) -> str:
    """The REACH column: the verdict, how many dialers got through, or the operator's word."""
    if r["overridden"]:
        return f"{r['verdict']} (--reachable)"
    counted = [d for d in r["dials"] if not d["outvoted"]]  # a lone dissent does not count
    ok = sum(d["ok"] for d in counted)
    if r["verdict"] == "unknown":
        return "checking" if r["summary"] else "-"
    return f"{r['verdict']} ({ok}/{len(counted)})"


def _ago(seconds: float) -> str:
    return f"{seconds:.1f}s ago" if seconds < 120 else time.strftime(
        "%H:%M:%S", time.localtime(time.time() - seconds))


def _split(worker: dict[str, Any]) -> str:
    """Where a worker's last step went (`dtfm.core.breakdown`; an older agent: compute,
    waiting on neighbours, data-parallel sync)."""
    if not worker["step_s"]:
        return "-"
    if worker.get("breakdown"):
        return breakdown_line(Breakdown(**worker["breakdown"]))
    return (f"{worker['step_s']:.2f}s = compute {worker['compute_s']:.2f} + pipeline wait "
            f"{worker['pp_wait_s']:.2f} + dp sync {worker['dp_s']:.2f}")


def breakdown_lines(data: dict[str, Any]) -> list[str]:
    """The job's step, measured (the mean of its workers' last steps) and predicted, split
    into the same parts: where the time goes, for an operator deciding what to fix."""
    lines = []
    if m := data.get("breakdown"):
        lines.append(f"step split, measured (mean of the workers' last steps): "
                     f"{breakdown_line(Breakdown(**m))}")
    if p := (data["plan"] or {}).get("predicted_breakdown"):
        lines.append(f"step split, predicted: {breakdown_line(Breakdown(**p), predicted=True)}")
    return lines


def _device(device: dict[str, Any]) -> str:
    """`cuda 98.1/312 TFLOP/s 139.5 GiB free`: kind, fp32/bf16 speed, free memory."""
    speed = f"{device['flops'] / 1e12:.3g}" if device["flops"] else "?"
    if device["flops_bf16"]:
        speed += f"/{device['flops_bf16'] / 1e12:.3g}"
    memory = device["free_memory_bytes"] or device["memory_bytes"]
    return f"{device['kind']} {speed} TFLOP/s {memory / 2**30:.1f} GiB free"


def status_to_text(status: coordinator_pb2.ClusterStatus) -> str:
    data = status_to_json(status)
    j = data["job"]
    lines = []
    if j["model"]:
        lines.append(f"job {j['id']}: {j['state']}  model {j['model']}  epoch {j['epoch']}  "
                     f"step {j['step']}/{j['total_steps']}  loss {j['loss']:.4f}  "
                     + (f"val loss {j['val_loss']:.4f} (step {j['val_step']})  "
                        if j["val_step"] else "")
                     + f"{j['tokens_per_s']:.0f} tok/s")
        if j["predicted_step_s"]:
            lines.append(f"  {step_time_line(data)}")
        lines.extend(f"  {line}" for line in breakdown_lines(data))
        if j["message"]:
            lines.append(f"  {j['message']}")
        saves = j["state_saves"]
        if line := save_line(saves["failures"], saves["error"], saves["saved_unix_s"],
                             data["time"]):
            lines.append(f"  {line}")
        if j["stages"]:
            lines.append(f"  layout {j['stages']}x{j['replicas']}, checkpoint at step "
                         f"{j['checkpoint_step']}, {len(j['recoveries'])} recoveries")
        if held := j["coordinator_checkpoints"]:
            lines.append("  the coordinator holds checkpoints (no member can be dialled): "
                         + ", ".join(f"stage {c['stage']} step {c['step']} "
                                     f"({c['bytes'] / 2**20:.1f} MiB)" for c in held)
                         + f", {sum(c['bytes'] for c in held) / 2**20:.1f} MiB in all")
        if (ls := data["local_steps"]) is not None:
            lines.append(f"  local steps: sync every {ls['every']} steps, round {ls['round']}; "
                         f"per step data-parallel {ls['dp_bytes_per_step'] / 1e6:.3g} MB, "
                         f"pipeline {ls['pp_bytes_per_step'] / 1e6:.3g} MB; drift at the last "
                         f"sync {ls['drift']:.3g}")
        for r in j["recoveries"][-5:]:
            when = time.strftime("%H:%M:%S", time.localtime(r["at_unix_s"]))
            after = (f"resumed after step {r['resumed_step']}, {r['steps_lost']} steps lost, "
                     f"stalled {r['stalled_s']:.0f} s" if r["stalled_s"] else "not resumed yet")
            lines.append(f"    {when} {r['layout_before']} -> {r['layout_after'] or '?'}: "
                         f"{r['reason'][:80]} ({after})")
        lines.extend(replans_to_text(j["replans"]))
    else:
        lines.append(f"job: {j['state']} ({j['message']})")
    lines.extend(running_jobs_lines(data))
    alive = sum(a["state"] == "alive" for a in data["agents"])
    lines.append(f"agents: {alive} alive of {len(data['agents'])}")
    if data["agents"]:
        rows = [("ID", "ADDRESS", "STATE", "REACH", "LAST SEEN", "DEVICE", "WORKER",
                 "STEP SPLIT")]
        for a in data["agents"]:
            w = a["worker"]
            worker = w["state"] + (f" step {w['step']} loss {w['loss']:.3f}"
                                   if w["state"] == "training" else "")
            if len(data["jobs"]) > 1 and w["job_id"]:  # side by side: whose worker
                worker += f" ({w['job_id']})"
            rows.append((a["id"], a["address"], a["state"], _reach_cell(a["reach"]),
                         _ago(a["last_seen_ago_s"]),
                         _device(a["device"]), worker, _split(w)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
        lines.extend(f"  {a['id']}: {a['reach']['summary']}" for a in data["agents"]
                     if a["reach"]["verdict"] in ("nowhere", "some-peers")
                     and a["state"] != "left")
        lines.extend(f"  {a['id']}: {a['relay_distrusted']}" for a in data["agents"]
                     if a.get("relay_distrusted"))
    lines.extend(integrity_lines(data["agents"]))  # excluded agents, evidence (issue 43)
    lines.extend(_tuning_lines(data["agents"]))
    if data["links"] and data["links"]["estimated"]:
        estimated = data["links"]["estimated"]
        lines.append(f"links: {len(estimated)} bandwidth(s) estimated, their probes never "
                     f"settled on a rate (`coordinator links` says how):")
        lines.extend(f"  {pair}" for pair in estimated)
    if data["plan"]:
        p = data["plan"]
        lines.append(f"plan (epoch {p['epoch']}, {p['placement'] or 'scheduled'}): "
                     f"{stages_x_replicas(p['stages'], p['replicas'])}, cost {p['cost']:.3f} s "
                     f"= DP {p['dp_cost']:.3f} + "
                     f"2 x PP {p['pp_cost']:.3f}; communication alone "
                     f"{p['predicted_comm_s']:.2f} s a step")
        splits = p["layer_splits"] or [0] * len(p["grid"])
        for s, (row, layers, shares) in enumerate(zip(p["grid"], splits, p["dp_shares"],
                                                      strict=True)):
            held = f" ({layers} layers)" if layers else ""
            if shares and max(shares) - min(shares) > 1e-9:  # uneven: say who owns what
                row = [f"{a} ({x:.0%} of gradients)" for a, x in zip(row, shares, strict=True)]
            lines.append(f"  stage {s}{held}: {'  '.join(row)}")
        if p["sync_note"]:
            lines.append(f"  replicas sync {p['sync_note']}")
        if p.get("outer_delay"):
            lines.append(f"  outer step one round late (--outer-delay 1): each sync's "
                         f"exchange overlaps the next {p['sync_every']} steps")
        if p.get("pipeline_delay"):
            lines.append("  pipeline flushes only at sync points (--pipeline-delay 1): each "
                         "step trains on the weights from two steps before")
    return "\n".join(lines)


def running_jobs_lines(data: dict[str, Any]) -> list[str]:
    """Where jobs run side by side: one line per running job (the first is the one above)
    with its state, step and the agents it holds, and the scheduler's word on why; nothing
    for a job running alone. `data`: `status_to_json`'s."""
    jobs, more = data["jobs"], data["jobs_omitted"]
    if len(jobs) + more < 2:
        return []
    lines = [f"running jobs: {len(jobs) + more}, side by side on disjoint agents"]
    for j in jobs:
        held = j["held_agents"]
        lines.append(f"  {j['id']}: {j['state']}  model {j['model']}  step {j['step']}/"
                     f"{j['total_steps']}  loss {j['loss']:.4f}  {j['tokens_per_s']:.0f} tok/s"
                     f"  holds {len(held)} agent(s): {', '.join(held[:8]) or '-'}"
                     + (f" and {len(held) - 8} more" if len(held) > 8 else ""))
        if j["share"]:
            lines.append(f"    {j['share']}")
    if more:
        lines.append(f"  ({more} more running: `coordinator jobs` lists them all)")
    return lines


def step_time_line(data: dict[str, Any]) -> str:
    """The job's one predicted step (the running plan's, refined with the compute its workers
    measured) against the measured one, and why where they are far apart
    (`coordinator.job.prediction.prediction_gap`). `data`: `status_to_json`'s."""
    j, plan = data["job"], data["plan"] or {}
    measured = j["measured_step_s"]
    line = (f"step time: the plan ({j['placement'] or 'scheduled'} placement) predicts "
            f"{j['predicted_step_s']:.2f} s, measured "
            + (f"{measured:.2f} s" if measured else "not yet"))
    members = {a for row in plan.get("grid", []) for a in row}
    compute_measured = any(a["worker"]["compute_s"] > 0 and a["worker"]["job_id"] == j["id"]
                           for a in data["agents"] if a["id"] in members)
    gap = prediction_gap(j["predicted_step_s"], measured, plan.get("predicted_compute_s", 0.0),
                         compute_measured)
    return f"{line}; {gap}" if gap else line


def _tuning_lines(agents: list[dict[str, Any]]) -> list[str]:
    """Agents whose hosts are not tuned for long links: what it costs and the sysctl lines,
    once per distinct set of lines. Not for agents on loopback: their links have no round
    trip for TCP's buffers or slow start to matter over."""
    by_fix: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for a in agents:
        host = a["address"].rsplit(":", 1)[0].strip("[]")
        if a["tuning"] and a["state"] == "alive" and not is_loopback(host):
            by_fix.setdefault(tuple(t["line"] for t in a["tuning"]), []).append(a)
    lines = []
    for fix, group in by_fix.items():
        lines.append(f"untuned host(s) {', '.join(a['id'] for a in group)}: apply "
                     f"deploy/sysctl.d/60-dtfm-wan.conf (deploy/install.sh does), i.e. set")
        for line, t in zip(fix, group[0]["tuning"], strict=True):
            lines.append(f"    {line}    # now {t['current']}: {t['why']}")
    return lines


CLEAR_SCREEN = "\x1b[H\x1b[2J"  # cursor home, erase the screen (ANSI)


def watch_frame(body: str, every_s: float, target: str, error: str = "",
                now: float | None = None) -> str:
    """One redraw of `status --watch`: clear the screen, a header line, then the status.

    On an error the header says so and the body is whatever the last good answer was.
    """
    clock = time.strftime("%H:%M:%S", time.localtime(time.time() if now is None else now))
    head = f"coordinator {target}, every {every_s:g} s, {clock} (Ctrl-C to stop)"
    if error:
        head += f"\n{error}; retrying"
    return f"{CLEAR_SCREEN}{head}\n\n{body}\n"
