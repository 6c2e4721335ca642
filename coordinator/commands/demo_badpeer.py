"""`coordinator demo --bad-peer [MODE]`: the loopback demo with one agent that sends wrong
numbers (issue 43, item 9).

Owns what the rehearsal changes in the demo, so `demo.py` stays the plain demo: the layout
it needs (three replicas of one stage, so that two honest agents can confirm what the third
does: docs/architecture.md, "Integrity"), the coordinator's flags (`sharded` averaging with
`--verify full`, checkpoints every 4 steps to roll back to, `--min-agents` that lets the job
shrink by the bad agent's row), the bad agent's environment (`DTFM_FAULT=*:ONSET:MODE`: its
workers attack from step ONSET on, whatever ranks they get), and the closing account read
from `coordinator status --json`: which agent, the evidence that confirmed it, the step of
onset against the step it was proven from, the rollback, and the job finishing without it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

# The bad-peer modes the checks confirm in this 1 x 3 demo (coordinator/integrity/
# corroborate.py): a scaled, flipped, noised, zeroed, replayed or NaN gradient copy, a drifted
# weight, and an averaged shard scaled, flipped or noised (the replicas' audit of the mean:
# agent/worker/avgaudit.py), zeroed, replayed or NaN. Each was run to its exclusion on
# 2026-12-07. Left out: the pipeline's modes (one stage has no pipeline) and `avg_one` (one
# stage and no spare agent: nothing can part the dispute it opens).
MODES = ("scale", "flip", "noise", "zero", "stale", "nan", "drift", "avg_scale", "avg_flip",
         "avg_noise", "avg_zero", "avg_stale", "avg_nan")
DEFAULT_MODE = "scale"
ONSET = 8  # the bad workers' first bad step: two checkpoints (every 4) are taken before it
CHECKPOINT_EVERY = 4
# the demo's flags where --bad-peer left them out: 1 x 3 trains fast on one machine
DEFAULTS = {"model": "gpt-tiny", "agents": 3, "stages": 1, "replicas": 3, "steps": 40,
            "batch": 6, "micro_batches": 1}


def add_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bad-peer", nargs="?", const=DEFAULT_MODE, default=None, choices=MODES,
                   metavar="MODE",
                   help=f"make one agent's workers send wrong numbers from step {ONSET} on "
                   f"(MODE: {', '.join(MODES)}; default {DEFAULT_MODE}: gradients x10) and "
                   f"show it caught, excluded and rolled back (1 x 3 unless set)")


def resolve(args: argparse.Namespace) -> str:
    """Fill the flags --bad-peer left out; an error message where they cannot work."""
    if args.wan is not None:
        return "--bad-peer runs on loopback: leave out --wan"
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.replicas < 3:
        return (f"--bad-peer needs --replicas 3 or more (got {args.replicas}): two honest "
                f"replicas must agree on which one is wrong")
    if args.steps <= ONSET + 10:
        return (f"--bad-peer needs --steps over {ONSET + 10} (got {args.steps}): the attack "
                f"starts at step {ONSET} and is caught within 10 steps")
    return ""


def coordinator_flags(args: argparse.Namespace) -> list[str]:
    """What the coordinator needs to catch it and go on without it."""
    return ["--dp-mode", "sharded", "--verify", "full",
            "--checkpoint-every", str(CHECKPOINT_EVERY),
            "--min-agents", str(args.agents - args.stages)]


def bad_env(env: dict[str, str], mode: str) -> dict[str, str]:
    """The bad agent's environment: every worker it runs attacks from step ONSET on."""
    return {**env, "DTFM_FAULT": f"*:{ONSET}:{mode}"}


def agent_id(state_dir: Path) -> str:
    """The id the agent in `state_dir` joined with ("" before it has)."""
    path = state_dir / "agent-id"
    return path.read_text().strip() if path.exists() else ""


def outcome(status: dict[str, Any], bad: str, mode: str) -> dict[str, Any]:
    """What happened to the bad agent and the job, from `status --json`'s document."""
    rows = {a["id"]: a for a in status["agents"]}
    row = rows.get(bad, {})
    exclusion = row.get("exclusion") or {}
    recoveries = status["job"].get("recoveries", [])
    recovery = next((r for r in recoveries if bad in r.get("reason", "")
                     or "exclu" in r.get("reason", "")), recoveries[0] if recoveries else None)
    return {
        "agent": bad, "mode": mode, "onset_step": ONSET,
        "excluded": row.get("state") == "excluded",
        "proven_from_step": exclusion.get("step", 0), "reason": exclusion.get("reason", ""),
        "evidence": [{k: e[k] for k in ("kind", "step", "reporter")}
                     for e in exclusion.get("evidence", [])],
        "others_excluded": sorted(a for a, r in rows.items()
                                  if a != bad and r.get("state") == "excluded"),
        "rollback": {k: recovery[k] for k in ("layout_before", "layout_after",
                                              "resumed_step") if k in recovery}
        if recovery else {},
    }


def outcome_text(o: dict[str, Any]) -> str:
    """The demo's account of the rehearsal, a few `demo:` lines."""
    if not o["excluded"]:
        return (f"demo: bad peer {o['agent']} ({o['mode']} from step {o['onset_step']}) was "
                f"NOT excluded; see `coordinator status` and the logs\n")
    reporters = sorted({e["reporter"] for e in o["evidence"]})
    kinds = sorted({e["kind"] for e in o["evidence"]})
    lines = [f"bad peer {o['agent']}: {o['mode']} from step {o['onset_step']}, proven bad from "
             f"step {o['proven_from_step']}, excluded: {o['reason']}",
             f"evidence that confirmed it: {', '.join(kinds)} from {', '.join(reporters)}"]
    if o["rollback"]:
        r = o["rollback"]
        lines.append(f"the job rolled back to step {r.get('resumed_step', 0)} and went on "
                     f"as {r.get('layout_after', '?')} (was {r.get('layout_before', '?')})")
    lines.append("nobody honest was excluded" if not o["others_excluded"] else
                 f"also excluded: {', '.join(o['others_excluded'])}")
    return "".join(f"demo: {line}\n" for line in lines)
