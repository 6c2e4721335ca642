"""Benchmark: does a long honest run's evidence ever exclude an honest agent? (issue 43)

Trains one honest `agent local` job with the replica checks on (`--verify full`, `sharded`)
for `--steps` steps, then feeds every rank's integrity events, in step order, through the
coordinator's own `Corroboration` and ledger, each rank standing for an agent of its own (a
job with one rank per agent). A short bench (`bench/integrity.py --scores`, 20 steps) set
the checks' thresholds; this one shows what a run 50 times longer does with them: how often
each kind of evidence fires on honest copies, how many (suspect, step) pairs two reporters
other than the suspect agreed on, and which agents the ledger excluded (the goal: none).

Writes bench/results/honest.json. Run: `python bench/honest.py` (about 2 minutes for 1000
steps of gpt-tiny 2 x 3 on 2 cores); `--pp-compress int4 --sync-every 8` for the issue's
compressed, local-step variant (churn and a slowed link need a coordinator's job: not here).
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "honest.json"

from coordinator.integrity.corroborate import CONFIRMING, Corroboration  # noqa: E402
from coordinator.integrity.ledger import IntegrityLedger  # noqa: E402
from coordinator.integrity.reports import EvidenceRecord  # noqa: E402
from dtfm.core.events import IntegrityEvent  # noqa: E402
from dtfm.launcher import ProgressTail  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--pp-compress", default="none", help="the pipeline links' codec (int4, ...)")
    p.add_argument("--sync-every", type=int, default=1, help="local steps H (outer steps)")
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def train(args: argparse.Namespace, workdir: Path) -> float:
    """Run the honest job; its wall time. Progress (one line per 100 steps) on stderr."""
    cmd = [sys.executable, "-m", "agent.commands.local", "--json", "--model", args.model,
           "--stages", str(args.stages), "--replicas", str(args.replicas), "--dp-mode",
           "sharded", "--verify", "full", "--batch", str(args.batch), "--micro-batches", "2",
           "--steps", str(args.steps), "--seed", str(args.seed), "--eval-batches", "0",
           "--pp-compress", args.pp_compress, "--sync-every", str(args.sync_every),
           "--workdir", str(workdir / "work"), "--checkpoint-dir", str(workdir / "ckpt")]
    started = time.monotonic()
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            step = json.loads(line).get("step", 0) if line.startswith("{") else 0
            if step and step % 100 == 0:
                elapsed = time.monotonic() - started
                print(f"step {step}/{args.steps}, {elapsed:.0f} s, ETA "
                      f"{elapsed / step * (args.steps - step):.0f} s", file=sys.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"the honest job failed (exit {proc.returncode}); see the logs in "
                         f"{workdir / 'work'}")
    return time.monotonic() - started


def events(workdir: Path) -> list[IntegrityEvent]:
    found = [ev for path in sorted((workdir / "work").glob("rank*.progress.jsonl"))
             for ev in ProgressTail(path).read() if isinstance(ev, IntegrityEvent)]
    return sorted(found, key=lambda ev: (ev.step, ev.rank))


def replay(found: list[IntegrityEvent]) -> dict[str, Any]:
    """The coordinator's verdicts on `found`, each rank an agent `r<rank>`."""
    ledger, corroboration = IntegrityLedger(), Corroboration()
    named: dict[tuple[int, int], set[int]] = collections.defaultdict(set)
    for ev in found:
        if ev.kind in CONFIRMING and ev.suspect_rank >= 0:
            named[(ev.suspect_rank, ev.step)].add(ev.rank)
        corroboration.feed([EvidenceRecord(
            agent_id=f"r{ev.suspect_rank}" if ev.suspect_rank >= 0 else "", kind=ev.kind,
            step=ev.step, detail=ev.detail, reporter=f"r{ev.rank}",
            suspect_rank=ev.suspect_rank, score=ev.score, epoch=1, candidates=())], ledger)
    agreed = sorted(k for k, reporters in named.items() if len(reporters - {k[0]}) >= 2)
    return {"kinds": dict(collections.Counter(ev.kind for ev in found).most_common()),
            "agreed_on_one_step": [{"suspect_rank": r, "step": s} for r, s in agreed],
            "excluded": {a: {"step": x.step, "reason": x.reason}
                         for a, x in ledger.exclusions.items()}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dtfm-honest-") as tmp:
        wall = train(args, Path(tmp))
        found = events(Path(tmp))
    result = {"model": args.model, "stages": args.stages, "replicas": args.replicas,
              "steps": args.steps, "batch": args.batch, "seed": args.seed,
              "pp_compress": args.pp_compress, "sync_every": args.sync_every,
              "wall_s": round(wall, 1), "events": len(found), **replay(found)}
    print(f"{args.model} {args.stages} x {args.replicas}, {args.steps} honest steps, "
          f"--pp-compress {args.pp_compress} --sync-every {args.sync_every} ({wall:.0f} s): "
          f"{len(found)} pieces of evidence")
    print(f"{'kind':<16}{'pieces':>8}{'confirming kind':>18}")
    for kind, n in result["kinds"].items():
        print(f"{kind:<16}{n:>8}{'yes' if kind in CONFIRMING else 'no':>18}")
    print(f"(suspect, step) pairs two other reporters agreed on at one step: "
          f"{len(result['agreed_on_one_step'])}")
    print(f"agents the coordinator's rule excluded: {sorted(result['excluded']) or 'none'}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 1 if result["excluded"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
