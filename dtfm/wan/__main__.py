"""``python -m dtfm.wan``: bring up an emulated WAN by hand, or measure one.

Owns the command-line front end of :class:`dtfm.wan.WanEmulator` for people: it builds the
network from matrices given as JSON (or a spec file), prints each host's namespace and address
with a ready-to-paste ``ip netns exec`` line, and holds until Ctrl-C or SIGTERM, then tears
everything down. With ``--measure`` it instead runs the TCP probes over every ordered pair and
prints measured RTT and goodput next to what the matrices promise.

``--nat 1,2 --shared-nat 4,5 --firewall 3`` put hosts behind NATs of their own, one NAT
together, or a stateful firewall (:mod:`dtfm.wan.nat`); the listing shows each host's own
address and the address its peers see, and ``--measure`` skips the pairs whose destination
cannot be dialled from the source.

``python -m dtfm.wan set --control SOCKET ...`` changes a running emulator (the holding command
prints its control socket): a link's delay or rate, a host's compute speed, e.g.
``set --control S --link 1:2 --both-ways --delay-ms 140 --bandwidth-mbps 2``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import statistics
import sys
import threading
from pathlib import Path
from typing import Any

from dtfm.wan import probe
from dtfm.wan.harness import DEFAULT_MTU, WanEmulator

log = logging.getLogger("dtfm.wan")


def _matrix(value: Any, n: int | None, what: str) -> list[list[Any]]:
    """A JSON matrix as is; a JSON number broadcast to n x n (needs --hosts)."""
    if isinstance(value, int | float) or value is None:
        if n is None:
            raise SystemExit(f"{what}: a single number needs --hosts N")
        return [[value] * n for _ in range(n)]
    if not isinstance(value, list):
        raise SystemExit(f"{what}: expected a JSON matrix or number, got {value!r}")
    return value


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dtfm.wan",
        description="Emulate a WAN on this machine: one network namespace per host, per-pair "
        "one-way delay and bandwidth. Needs root.",
        epilog='Example: python -m dtfm.wan --delay-ms "[[0,40],[40,0]]" '
        '--bandwidth-mbps "[[0,20],[20,0]]" --measure',
    )
    p.add_argument("--spec", type=Path,
                   help='JSON file {"delay_ms": [[..]], "bandwidth_mbps": [[..]], "queue_ms": x}')
    p.add_argument("--delay-ms", help="one-way delay matrix (row = from) as JSON, or a number")
    p.add_argument("--bandwidth-mbps", help="rate matrix in Mbit/s as JSON, or a number; "
                   "default unlimited")
    p.add_argument("--hosts", type=int, help="number of hosts when the matrices are numbers")
    p.add_argument("--queue-ms", type=float, help="drop packets that would queue longer")
    p.add_argument("--mtu", type=int, default=DEFAULT_MTU)
    p.add_argument("--nat", metavar="H,H,..", help="hosts each behind a NAT of its own")
    p.add_argument("--shared-nat", action="append", default=[], metavar="H,H,..",
                   help="hosts behind one NAT together (a site's LAN); repeatable")
    p.add_argument("--firewall", metavar="H,H,..",
                   help="hosts behind a stateful firewall (public address, not dialable)")
    p.add_argument("--measure", action="store_true",
                   help="measure RTT and goodput of every ordered pair, print them, exit")
    p.add_argument("--bulk-seconds", type=float, default=2.0,
                   help="--measure: about how long each bulk transfer lasts")
    p.add_argument("--json", action="store_true",
                   help='--measure: print {"hosts": [..], "pairs": [..]} as JSON, not a table')
    p.add_argument("--log-level", default="WARNING")
    return p.parse_args(argv)


def _hosts(text: str | None, flag: str) -> list[int]:
    if not text:
        return []
    try:
        return [int(tok) for tok in text.split(",") if tok.strip()]
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: give host numbers separated by commas, "
                         "e.g. 1,2") from None


def _build(args: argparse.Namespace) -> WanEmulator:
    spec: dict[str, Any] = {}
    if args.spec is not None:
        spec = json.loads(args.spec.read_text())
    delay = spec.get("delay_ms")
    if args.delay_ms is not None:
        delay = json.loads(args.delay_ms)
    if delay is None:
        raise SystemExit("give --delay-ms or --spec")
    bandwidth = spec.get("bandwidth_mbps")
    if args.bandwidth_mbps is not None:
        bandwidth = json.loads(args.bandwidth_mbps)
    queue_ms = args.queue_ms if args.queue_ms is not None else spec.get("queue_ms")
    delay_m = _matrix(delay, args.hosts, "--delay-ms")
    bw_m = None if bandwidth is None else _matrix(bandwidth, len(delay_m), "--bandwidth-mbps")
    nat = _hosts(args.nat, "--nat") if args.nat is not None else spec.get("nat", [])
    firewall = (_hosts(args.firewall, "--firewall") if args.firewall is not None
                else spec.get("firewall", []))
    shared = ([_hosts(t, "--shared-nat") for t in args.shared_nat] if args.shared_nat
              else spec.get("shared_nat", []))
    try:
        return WanEmulator(delay_ms=delay_m, bandwidth_mbps=bw_m, mtu=args.mtu,
                           queue_ms=queue_ms, log_level=args.log_level.upper(),
                           nat=nat, firewall=firewall, shared_nat=shared)
    except ValueError as exc:
        raise SystemExit(f"invalid network: {exc}") from exc


def measure(wan: WanEmulator, bulk_seconds: float) -> list[dict[str, Any]]:
    """RTT (median and minimum of 10 TCP echoes) and goodput for every ordered pair (src, dst)
    where src can dial dst; the others are listed with ``"dialable": false`` and no
    measurement. The minimum is the emulated delay plus the least forwarding time: on a
    loaded machine the userspace forwarder adds milliseconds to the median, not to it."""
    for host in range(wan.size):
        probe.start_server(wan, host)
    rows: list[dict[str, Any]] = []
    for src in range(wan.size):
        for dst in range(wan.size):
            if src == dst:
                continue
            if not wan.dialable(src, dst):
                rows.append({"src": src, "dst": dst, "dialable": False})
                continue
            expect_rtt = wan.delay_ms[src][dst] + wan.delay_ms[dst][src]
            rate = wan.bandwidth_mbps[src][dst]
            nbytes = int(max(2e6, (rate or 200.0) * 1e6 / 8 * bulk_seconds))
            rtts = probe.echo_rtts_ms(wan, src, dst, count=10)
            rows.append({
                "src": src, "dst": dst, "dialable": True,
                "rtt_ms_expected": expect_rtt, "rtt_ms": statistics.median(rtts),
                "rtt_ms_min": min(rtts),
                "mbps_expected": rate, "mbps": probe.bulk_mbps(wan, src, dst, nbytes),
                "bulk_bytes": nbytes,
            })
    return rows


def _print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'pair':>8} {'RTT want':>9} {'RTT got':>8} {'Mbit/s want':>11} {'Mbit/s got':>10}")
    for r in rows:
        if not r["dialable"]:
            print(f"{r['src']:>3} -> {r['dst']:<2}  not dialable ({r['dst']} is behind a NAT "
                  "or firewall)")
            continue
        want = "unlim" if r["mbps_expected"] is None else f"{r['mbps_expected']:.1f}"
        print(f"{r['src']:>3} -> {r['dst']:<2} {r['rtt_ms_expected']:>9.1f} {r['rtt_ms']:>8.1f} "
              f"{want:>11} {r['mbps']:>10.1f}")


def _parse_set(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dtfm.wan set",
        description="Change a running emulated WAN: a link's delay or rate, or a host's compute "
        "speed. Prints the matrices as they are afterwards (JSON).",
        epilog="Example: python -m dtfm.wan set --control /tmp/dtfm-wan-x/control.sock "
        "--link 1:2 --both-ways --delay-ms 140 --bandwidth-mbps 2")
    p.add_argument("--control", required=True,
                   help="the emulator's control socket (printed by `python -m dtfm.wan`; "
                   "WanEmulator.control_socket)")
    p.add_argument("--link", action="append", default=[], metavar="SRC:DST",
                   help="a directed link to change (repeatable)")
    p.add_argument("--both-ways", action="store_true", help="change DST:SRC as well")
    p.add_argument("--delay-ms", type=float, help="the links' new one-way delay")
    p.add_argument("--bandwidth-mbps",
                   help="the links' new rate in Mbit/s, or 'unlimited'")
    cut = p.add_mutually_exclusive_group()
    cut.add_argument("--cut", action="store_true",
                     help="the links drop every packet (a route failure or firewall between "
                     "two hosts that still reach everyone else)")
    cut.add_argument("--heal", action="store_true", help="cut links carry packets again")
    p.add_argument("--compute", action="append", default=[], metavar="HOST:FACTOR",
                   help="host HOST's workers compute FACTOR times slower (1: full speed)")
    args = p.parse_args(argv)
    if not args.link and not args.compute:
        p.error("give --link SRC:DST (with --delay-ms, --bandwidth-mbps, --cut or --heal) or "
                "--compute HOST:FACTOR")
    if (args.link and args.delay_ms is None and args.bandwidth_mbps is None
            and not (args.cut or args.heal)):
        p.error("--link needs --delay-ms, --bandwidth-mbps, --cut or --heal")
    return args


def _pair(text: str, flag: str) -> tuple[str, str]:
    a, sep, b = text.partition(":")
    if not sep or not a or not b:
        raise SystemExit(f"{flag} {text!r}: give two numbers as A:B")
    return a, b


def set_main(argv: list[str]) -> int:
    """`python -m dtfm.wan set ...`: one request to a running emulator's control socket."""
    from dtfm.wan.emulator import request

    args = _parse_set(argv)
    links: list[dict[str, Any]] = []
    for text in args.link:
        src, dst = (int(x) for x in _pair(text, "--link"))
        change: dict[str, Any] = {"src": src, "dst": dst}
        if args.delay_ms is not None:
            change["delay_ms"] = args.delay_ms
        if args.bandwidth_mbps is not None:
            change["bandwidth_mbps"] = (None if args.bandwidth_mbps == "unlimited"
                                        else float(args.bandwidth_mbps))
        if args.cut or args.heal:
            change["cut"] = bool(args.cut)
        links.append(change)
        if args.both_ways:
            links.append({**change, "src": dst, "dst": src})
    compute = {h: float(f) for h, f in (_pair(t, "--compute") for t in args.compute)}
    try:
        answer = request(args.control, {"links": links, "compute": compute})
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(answer))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["set"]:
        return set_main(argv[1:])
    args = _parse(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    ok, reason = WanEmulator.available()
    if not ok:
        print(f"cannot emulate a WAN here: {reason}", file=sys.stderr)
        return 2
    wan = _build(args)
    with wan:
        if args.measure:
            rows = measure(wan, args.bulk_seconds)
            if args.json:
                print(json.dumps({"hosts": wan.topology.hosts(), "pairs": rows}, indent=1))
            else:
                _print_table(rows)
        else:
            for h in wan.topology.hosts():
                seen = ("" if h["reachability"] == "public" else
                        f" ({h['reachability']}, peers see {h['public_address']})")
                print(f"host {h['host']}: {h['address']:<15}{seen} netns {h['namespace']}   "
                      f"run: ip netns exec {h['namespace']} CMD")
            print(f"change it live: python -m dtfm.wan set --control {wan.control_socket} "
                  "--link SRC:DST --delay-ms MS --bandwidth-mbps MBPS | --compute HOST:FACTOR")
            print("holding; Ctrl-C or SIGTERM tears it down", flush=True)
            stop = threading.Event()
            signal.signal(signal.SIGINT, lambda *_: stop.set())
            signal.signal(signal.SIGTERM, lambda *_: stop.set())
            while not stop.wait(1.0):
                pass
    if wan.stats is not None and args.measure and not args.json:
        print(f"emulator: {wan.stats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
