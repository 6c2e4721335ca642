"""Benchmark: measure every link of 8 x N agents on the paper's world-wide matrix, emulated.

`--per-city N` agents per city (default 1: 8 agents; 4: 32; 8: 64, where the machine can host
them) (Oregon, Virginia, Ohio, Tokyo, Seoul, London, Frankfurt, Ireland) with the
paper's one-way delays and its bandwidths scaled from Gbit/s down to tens of Mbit/s (x SCALE
Mbit/s per Gbit/s) so that one machine can carry them. Prints how long a full measurement took
and the error of every link against the emulated truth; writes bench/results/links.json.
Needs root (network namespaces). Run: `python bench/links.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from coordinator.scenarios import world_links
from dtfm.wan import WanEmulator
from dtfm.wan.cluster import WanCluster, measurement_wan

RESULTS = Path(__file__).resolve().parent / "results" / "links.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scale", type=float, default=25.0,
                        help="emulated Mbit/s per Gbit/s of the paper's matrix")
    parser.add_argument("--per-city", type=int, default=1,
                        help="agents per city: 1 (8 agents), 4 (32), 8 (64)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--workdir", default="", help="keep the daemons' logs here")
    args = parser.parse_args()
    ok, why = WanEmulator.available()
    if not ok:
        print(f"cannot emulate a WAN here: {why}", file=sys.stderr)
        return 2
    d, b, cities = world_links(args.per_city, args.scale)
    delay, bandwidth = np.array(d, dtype=float), np.array(b, dtype=float)
    n = len(delay)
    with tempfile.TemporaryDirectory(prefix="dtfm-bench-links-") as scratch, measurement_wan(
            delay.tolist(), bandwidth.tolist()) as wan:
        cluster = WanCluster(wan, Path(args.workdir or scratch), agents=n)
        ids = cluster.start(prewarm=False)  # measuring only
        print(f"{n} agents joined; measuring {n * (n - 1)} links ...", file=sys.stderr)
        started = time.monotonic()
        measured = cluster.measure()
        seconds = time.monotonic() - started
    order = [measured["agents"].index(i) for i in ids]
    got_d = np.array(measured["delay_ms"], dtype=float)[np.ix_(order, order)]
    got_b = np.array(measured["bandwidth_gbps"], dtype=float)[np.ix_(order, order)] * 1000
    rows = []
    for i in range(n):
        for j in range(n):
            if i != j:
                rows.append({
                    "from": cities[i], "to": cities[j],
                    "delay_ms": delay[i, j], "measured_delay_ms": round(got_d[i, j], 2),
                    "delay_err_pct": round(100 * (got_d[i, j] - delay[i, j])
                                           / max(delay[i, j], 1e-9), 2),
                    "delay_err_ms": round(abs(got_d[i, j] - delay[i, j]), 2),
                    "mbps": round(bandwidth[i, j], 2), "measured_mbps": round(got_b[i, j], 2),
                    "bw_err_pct": round(100 * (got_b[i, j] - bandwidth[i, j])
                                        / bandwidth[i, j], 2),
                })
    print(f"{'from':<10}{'to':<10}{'delay':>8}{'meas.':>8}{'err%':>7}"
          f"{'Mbit/s':>9}{'meas.':>8}{'err%':>7}")
    for r in rows:
        print(f"{r['from']:<10}{r['to']:<10}{r['delay_ms']:>8.1f}{r['measured_delay_ms']:>8.1f}"
              f"{r['delay_err_pct']:>7.1f}{r['mbps']:>9.2f}{r['measured_mbps']:>8.2f}"
              f"{r['bw_err_pct']:>7.1f}")
    d_err = [abs(r["delay_err_pct"]) for r in rows]
    b_err = [abs(r["bw_err_pct"]) for r in rows]
    summary = {
        "agents": n, "links": len(rows), "seconds": round(seconds, 2), "scale": args.scale,
        "seconds_per_link": round(seconds / len(rows), 3),
        # the bar: every delay within 10 % or 2 ms
        "delays_within_10pct_or_2ms": sum(abs(r["delay_err_pct"]) <= 10 or r["delay_err_ms"] <= 2
                                          for r in rows) / len(rows),
        "delay_err_pct": {"median": float(np.median(d_err)), "max": max(d_err)},
        "bandwidth_err_pct": {"median": float(np.median(b_err)), "max": max(b_err)},
        "unreachable": measured["unreachable"],
    }
    print(f"\nmeasured {len(rows)} links of {n} agents in {seconds:.1f} s; |delay error| median "
          f"{summary['delay_err_pct']['median']:.1f}% max {summary['delay_err_pct']['max']:.1f}%;"
          f" |bandwidth error| median {summary['bandwidth_err_pct']['median']:.1f}% max "
          f"{summary['bandwidth_err_pct']['max']:.1f}%")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "links": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
