"""``WanEmulator``: build an emulated wide-area network on one machine, and tear it down.

Owns the lifecycle that tests and benchmarks use: from an N x N one-way delay matrix (and an
optional bandwidth matrix) it creates one network namespace per host, each with a TUN device
and an address in a private /24, starts the forwarding process (:mod:`dtfm.wan.emulator`), and
runs commands inside the hosts. On exit (also on an exception or SIGTERM in the main thread) it
ends the processes it started and any others still inside its namespaces, stops the emulator,
and deletes exactly the namespaces it created.

While it runs, any link's delay or rate and any host's compute speed can change
(:meth:`WanEmulator.set_link`, :meth:`WanEmulator.set_compute`, or ``python -m dtfm.wan set``
against :attr:`WanEmulator.control_socket`), so tests and benchmarks can script "this link
degrades at step 40".

Hosts may sit behind a NAT (``nat=``, ``shared_nat=``: a private address, peers see the NAT's
public address and a mapped port, nothing comes in that the host did not open) or a stateful
firewall (``firewall=``: a public address that cannot be dialled); :mod:`dtfm.wan.nat` says how
they behave. :meth:`WanEmulator.address` is where a host binds, :meth:`WanEmulator.public_address`
what its peers see, :meth:`WanEmulator.dialable` whether one host can open a connection to
another.

Traffic stays inside the namespaces: the only route each host has besides ``lo`` is the /24
on its TUN (a NATed host: its LAN /24 and a route to the public /24), and the emulator forwards
only between the addresses it assigned.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from dtfm.procs import terminate_all
from dtfm.wan import nat as reach
from dtfm.wan import netns

log = logging.getLogger(__name__)

DEFAULT_MTU = 65000
DEFAULT_IFNAME = "wan0"
NAME_PREFIX = "dtfm-"
READY_TIMEOUT_S = 20.0
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]

Matrix = Sequence[Sequence[float]]
OptMatrix = Sequence[Sequence[float | None]]


def _check_matrix(name: str, m: Sequence[Sequence[Any]], n: int | None) -> int:
    rows = len(m)
    if rows < 1:
        raise ValueError(f"{name} must have at least one row")
    if n is not None and rows != n:
        raise ValueError(f"{name} has {rows} rows; expected {n}")
    for i, row in enumerate(m):
        if len(row) != rows:
            raise ValueError(f"{name} must be square: row {i} has {len(row)} entries, not {rows}")
    return rows


class WanEmulator:
    """An emulated WAN: N hosts, each in its own network namespace, one-way delay per pair.

    ``delay_ms[i][j]`` is the one-way delay from host i to host j in milliseconds and
    ``bandwidth_mbps[i][j]`` the rate of that direction in Mbit/s (``None``, ``inf`` or a
    missing matrix: unlimited). Diagonals are ignored. ``queue_ms`` caps each link's queue
    (a packet that would wait longer is dropped; default unbounded, so no loss). ``sysctls``
    are ``net.*`` settings applied in every host (e.g. larger ``net.ipv4.tcp_rmem`` for
    links whose bandwidth-delay product exceeds the default TCP buffers). ``subnet`` picks X
    in 10.X.0.0/24 (default random). ``nat`` (hosts each behind a NAT of its own),
    ``shared_nat`` (groups of hosts behind one NAT together) and ``firewall`` (hosts behind a
    stateful firewall) make hosts unreachable from outside, as :mod:`dtfm.wan.nat` describes.
    Use it as a context manager::

        with WanEmulator(delay_ms=[[0, 40], [40, 0]], bandwidth_mbps=[[0, 20], [20, 0]]) as wan:
            server = wan.popen(1, ["python", "-m", "http.server", "--bind", wan.address(1)])
            subprocess.run(wan.command(0, ["curl", f"http://{wan.address(1)}:8000/"]))
    """

    def __init__(
        self,
        delay_ms: Matrix,
        bandwidth_mbps: OptMatrix | None = None,
        *,
        mtu: int = DEFAULT_MTU,
        queue_ms: float | None = None,
        subnet: int | None = None,
        sysctls: Mapping[str, str] | None = None,
        log_level: str = "INFO",
        nat: Sequence[int] = (),
        firewall: Sequence[int] = (),
        shared_nat: Sequence[Sequence[int]] = (),
    ) -> None:
        n = _check_matrix("delay_ms", delay_ms, None)
        if n > 253:
            raise ValueError(f"at most 253 hosts fit in a /24; got {n}")
        delays = [[0.0 if i == j else float(d) for j, d in enumerate(row)]
                  for i, row in enumerate(delay_ms)]
        for i, row in enumerate(delays):
            for j, d in enumerate(row):
                if not math.isfinite(d) or d < 0:
                    raise ValueError(f"delay_ms[{i}][{j}] must be finite and >= 0; got {d}")
        rates: list[list[float | None]] = [[None] * n for _ in range(n)]
        if bandwidth_mbps is not None:
            _check_matrix("bandwidth_mbps", bandwidth_mbps, n)
            for i, row in enumerate(bandwidth_mbps):
                for j, b in enumerate(row):
                    if i == j or b is None or b == math.inf:
                        continue
                    if not (math.isfinite(float(b)) and float(b) > 0):
                        raise ValueError(f"bandwidth_mbps[{i}][{j}] must be > 0; got {b}")
                    rates[i][j] = float(b)
        if not 576 <= mtu <= 65535:
            raise ValueError(f"mtu must be in [576, 65535]; got {mtu}")
        if queue_ms is not None and queue_ms < 0:
            raise ValueError(f"queue_ms must be >= 0; got {queue_ms}")
        self._delay_ms = delays
        self._bandwidth_mbps = rates
        self._mtu = mtu
        self._queue_ms = queue_ms
        self._log_level = log_level
        self._sysctls = dict(sysctls or {})
        for key in self._sysctls:
            if not key.startswith("net."):
                raise ValueError(f"only per-namespace net.* sysctls can be set; got {key!r}")
        self._token = secrets.token_hex(3)
        self._subnet = subnet if subnet is not None else 100 + secrets.randbelow(150)
        if not 0 <= self._subnet <= 255:
            raise ValueError(f"subnet must be in [0, 255]; got {subnet}")
        self._names = [f"{NAME_PREFIX}{self._token}-{i}" for i in range(n)]
        self._places = reach.layout([f"10.{self._subnet}.0.{i + 1}" for i in range(n)],
                                    list(nat), list(firewall), [list(g) for g in shared_nat])
        self._addresses = [p.address for p in self._places]
        self._created: list[str] = []
        self._inodes: list[int] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._emulator: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None
        self._log_path: Path | None = None
        self._compute: dict[int, float] = {}
        self._cut: set[tuple[int, int]] = set()
        self._prev_sigterm: Any = None
        self._started = False
        self._closed = False
        self.stats: dict[str, float] | None = None
        """The forwarder's counters once closed: forwarded, forwarded_bytes, dropped_*,
        late_ms_mean / late_ms_max (how far behind schedule packets were delivered)."""

    # ---------------------------------------------------------------- info

    @staticmethod
    def available() -> tuple[bool, str]:
        """(True, "") where namespaces and TUN devices can be made; else (False, why not)."""
        ok, reason = netns.availability()
        if not ok:
            return ok, reason
        probe = f"{NAME_PREFIX}probe-{secrets.token_hex(3)}"
        try:
            netns.ip("netns", "add", probe)
        except netns.NetnsError as exc:
            return False, f"cannot create a network namespace: {exc}"
        finally:
            with contextlib.suppress(netns.NetnsError):
                netns.delete_namespace(probe)
        return True, ""

    @property
    def size(self) -> int:
        return len(self._names)

    @property
    def delay_ms(self) -> list[list[float]]:
        """One-way delays (row = from, column = to), diagonal 0."""
        return [list(r) for r in self._delay_ms]

    @property
    def bandwidth_mbps(self) -> list[list[float | None]]:
        """Rates in Mbit/s (row = from, column = to); None = unlimited."""
        return [list(r) for r in self._bandwidth_mbps]

    @property
    def namespace_inodes(self) -> list[int]:
        """Inodes of the namespaces (identity that outlives their names, for leak checks)."""
        return list(self._inodes)

    @property
    def emulator_pid(self) -> int | None:
        return None if self._emulator is None else self._emulator.pid

    @property
    def control_socket(self) -> str:
        """The forwarder's control socket (for ``python -m dtfm.wan set --control``)."""
        self._require_running()
        assert self._workdir is not None
        return str(Path(self._workdir.name) / "control.sock")

    def compute_file(self, i: int) -> str:
        """The file host ``i``'s compute slowdown factor is written to: start its workers with
        ``DTFM_COMPUTE_SLOWDOWN_FILE`` set to it and :meth:`set_compute` slows them live."""
        self._require_running()
        assert self._workdir is not None
        return str(Path(self._workdir.name) / "compute" / str(self._index(i)))

    @property
    def cut(self) -> set[tuple[int, int]]:
        """The directed links (src, dst) cut by :meth:`set_link`: they drop every packet."""
        return set(self._cut)

    @property
    def compute(self) -> dict[int, float]:
        """Hosts whose compute was slowed, and by what factor (1: as fast as it is)."""
        return dict(self._compute)

    def set_link(self, src: int, dst: int, *, delay_ms: float | None = None,
                 bandwidth_mbps: float | None | str = "keep", both_ways: bool = False,
                 cut: bool | None = None) -> None:
        """Change the link src -> dst (and dst -> src with ``both_ways``) while it runs:
        ``delay_ms`` None keeps the delay, ``bandwidth_mbps`` "keep" keeps the rate and None
        lifts the limit; ``cut`` True drops every packet on it (both hosts still reach every
        other host), False carries them again. Applies to packets sent from now on."""
        change: dict[str, Any] = {"src": self._index(src), "dst": self._index(dst)}
        if cut is not None:
            change["cut"] = cut
        if delay_ms is not None:
            change["delay_ms"] = delay_ms
        if bandwidth_mbps != "keep":
            change["bandwidth_mbps"] = bandwidth_mbps
        changes = [change] + ([{**change, "src": change["dst"], "dst": change["src"]}]
                              if both_ways else [])
        self.set_links(changes)

    def set_links(self, changes: Sequence[Mapping[str, Any]]) -> None:
        """Apply several link changes at once (``{"src", "dst", "delay_ms"?,
        "bandwidth_mbps"?, "cut"?}`` each, as the control socket takes them)."""
        self._apply(self._control({"links": [dict(c) for c in changes]}))

    def set_compute(self, i: int, factor: float) -> None:
        """Make host ``i``'s workers compute ``factor`` times slower from their next step (1:
        back to full speed); they must have been started with ``compute_file(i)``."""
        self._apply(self._control({"compute": {str(self._index(i)): factor}}))

    def _control(self, message: dict[str, Any]) -> dict[str, Any]:
        from dtfm.wan.emulator import request

        self._require_running()
        if not self.emulator_running:
            raise RuntimeError(f"the WAN emulator has exited: {self.emulator_log()}")
        return request(self.control_socket, message)

    def _apply(self, answer: dict[str, Any]) -> None:
        self._delay_ms = [[float(x) for x in row] for row in answer["delay_ms"]]
        self._bandwidth_mbps = [[None if x is None else float(x) for x in row]
                                for row in answer["bandwidth_mbps"]]
        self._compute = {int(h): float(f) for h, f in answer["compute"].items()}
        self._cut = {(int(i), int(j)) for i, j in answer.get("cut", [])}

    def address(self, i: int) -> str:
        """IPv4 address of host ``i`` (inside its namespace): where it binds. Behind a NAT it is
        private (192.168.1.x, the same for hosts behind different NATs) and only hosts behind
        the same NAT reach it."""
        return self._addresses[self._index(i)]

    def public_address(self, i: int) -> str:
        """The address host ``i``'s peers see: its NAT's public address if it is behind a NAT
        (with a mapped port per connection), else its own."""
        return self._places[self._index(i)].public_address

    def reachability(self, i: int) -> str:
        """``"public"``, ``"firewall"`` or ``"nat"``."""
        return self._places[self._index(i)].reachability

    def nat_site(self, i: int) -> int | None:
        """Which NAT host ``i`` sits behind (hosts with the same one share a LAN); None if it
        is not behind a NAT."""
        return self._places[self._index(i)].site

    def dialable(self, src: int, dst: int) -> bool:
        """Whether host ``src`` can open a connection to host ``dst`` at ``address(dst)``: a
        public host from anywhere, a NATed host only from behind the same NAT, a firewalled
        host from nowhere."""
        mode = self.reachability(dst)
        if mode == reach.NAT:
            return self.nat_site(src) == self.nat_site(dst) and self._index(src) != dst
        return mode == reach.PUBLIC and self._index(src) != dst

    def hosts(self) -> list[dict[str, Any]]:
        """Every host: index, namespace, own address, public address, reachability, NAT."""
        return [{"host": i, "namespace": self._names[i], "address": p.address,
                 "public_address": p.public_address, "reachability": p.reachability,
                 "nat": p.site} for i, p in enumerate(self._places)]

    def namespace(self, i: int) -> str:
        """Name of host ``i``'s network namespace."""
        return self._names[self._index(i)]

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside host ``i``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(i), *argv]

    def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside host ``i``; the process is killed when the emulator closes."""
        self._require_running()
        proc: subprocess.Popen[Any] = subprocess.Popen(self.command(i, argv), **kwargs)
        self._procs.append(proc)
        return proc

    def _index(self, i: int) -> int:
        if not 0 <= i < len(self._names):
            raise IndexError(f"host {i} out of range [0, {len(self._names)})")
        return i

    def _require_running(self) -> None:
        if not self._started or self._closed:
            raise RuntimeError("the WAN emulator is not running (use it as a context manager)")

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> WanEmulator:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> None:
        if self._started:
            raise RuntimeError("a WanEmulator can be started once")
        ok, reason = netns.availability()
        if not ok:
            raise RuntimeError(f"cannot emulate a WAN here: {reason}")
        self._started = True
        self._install_sigterm()
        try:
            self._create_hosts()
            self._start_emulator()
        except BaseException:
            self.close()
            raise
        log.info(
            "WAN up: %d hosts %s in namespaces %s (emulator pid %d)",
            self.size, [f"{p.address} ({p.reachability} {p.public_address})"
                        if p.reachability != reach.PUBLIC else p.address
                        for p in self._places], self._names, self.emulator_pid,
        )

    def _create_hosts(self) -> None:
        for name, addr, place in zip(self._names, self._addresses, self._places, strict=True):
            if netns.namespace_exists(name):
                raise RuntimeError(f"namespace {name} already exists; refusing to reuse it")
            inode = netns.create_namespace(name)
            self._created.append(name)
            self._inodes.append(inode)
            netns.add_tun(name, DEFAULT_IFNAME, addr, 24, self._mtu)
            if place.reachability == reach.NAT:  # its LAN is connected; the Internet via the NAT
                netns.add_route(name, f"10.{self._subnet}.0.0/24", DEFAULT_IFNAME)
            if self._sysctls:
                netns.set_sysctls(name, self._sysctls)

    def _start_emulator(self) -> None:
        self._workdir = tempfile.TemporaryDirectory(prefix=f"dtfm-wan-{self._token}-")
        work = Path(self._workdir.name)
        (work / "compute").mkdir()
        spec = {
            "hosts": [
                {"namespace": name, "ifname": DEFAULT_IFNAME, "address": place.address,
                 "reachability": place.reachability, "public_address": place.public_address,
                 "site": place.site}
                for name, place in zip(self._names, self._places, strict=True)
            ],
            "delay_ms": self._delay_ms,
            "bandwidth_mbps": self._bandwidth_mbps,
            "queue_ms": self._queue_ms,
            "watch_stdin": True,
            "cleanup_on_orphan": True,
            "stats_path": str(work / "stats.json"),
            "control_socket": str(work / "control.sock"),
            "compute_dir": str(work / "compute"),
        }
        spec_path = work / "spec.json"
        spec_path.write_text(json.dumps(spec))
        self._log_path = work / "emulator.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p
        )
        with open(self._log_path, "wb") as logf:
            self._emulator = subprocess.Popen(
                [sys.executable, "-m", "dtfm.wan.emulator", "--spec", str(spec_path),
                 "--log-level", self._log_level],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=logf,
                env=env,
                start_new_session=True,  # terminal Ctrl-C goes to us; we stop it in order
            )
        assert self._emulator.stdout is not None
        out = self._emulator.stdout
        deadline = time.monotonic() + READY_TIMEOUT_S
        line = b""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([out], [], [], 0.2)
            if ready:
                line = out.readline()
                break
            if self._emulator.poll() is not None:
                break
        if line.strip() != b"ready":
            raise RuntimeError(
                f"WAN emulator did not start (exit {self._emulator.poll()}): {self.emulator_log()}"
            )

    def emulator_log(self, tail: int = 4000) -> str:
        """The last ``tail`` characters of the forwarding process's log."""
        if self._log_path is None:
            return ""
        try:
            return self._log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def close(self) -> None:
        """Kill started processes, stop the emulator, delete the namespaces. Idempotent."""
        if self._closed or not self._started:
            return
        self._closed = True
        errors: list[str] = []
        try:
            self._stop_processes()
        except Exception as exc:  # keep tearing down
            errors.append(f"stopping processes: {exc}")
        for name in self._created:
            try:
                netns.kill_namespace_processes(name)
            except Exception as exc:
                errors.append(f"killing processes in {name}: {exc}")
        try:
            self._stop_emulator()
        except Exception as exc:
            errors.append(f"stopping the emulator: {exc}")
        for name in self._created:
            try:
                netns.delete_namespace(name)
            except Exception as exc:
                errors.append(f"deleting {name}: {exc}")
        if self._workdir is not None:
            with contextlib.suppress(OSError, ValueError):
                self.stats = json.loads((Path(self._workdir.name) / "stats.json").read_text())
            log.debug("emulator log:\n%s", self.emulator_log())
            self._workdir.cleanup()
        self._restore_sigterm()
        if errors:
            log.error("WAN teardown incomplete: %s", "; ".join(errors))
            raise RuntimeError("WAN teardown incomplete: " + "; ".join(errors))
        log.info("WAN down: namespaces %s deleted", self._created)

    def _stop_processes(self) -> None:
        terminate_all(self._procs, grace_s=3.0, group=False)
        for proc in self._procs:
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()

    @property
    def emulator_running(self) -> bool:
        """Whether the forwarding process is alive (if it is not, no packet moves)."""
        return self._emulator is not None and self._emulator.poll() is None

    def _stop_emulator(self) -> None:
        emu = self._emulator
        if emu is None:
            return
        if emu.poll() is not None:
            log.error("the WAN emulator had exited early (%s):\n%s", emu.returncode,
                      self.emulator_log())
        elif terminate_all([emu], grace_s=5.0, group=False):
            log.warning("the emulator did not stop on SIGTERM; killed it")
        for stream in (emu.stdin, emu.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

    # SIGTERM in the main thread becomes SystemExit, so ``with`` blocks unwind and clean up.

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGTERM)
        if current is not signal.SIG_DFL:
            return  # someone else handles it; leave theirs alone

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            if self._closed:
                return  # already tearing down: let it finish
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, on_sigterm)
        self._prev_sigterm = current

    def _restore_sigterm(self) -> None:
        if self._prev_sigterm is None:
            return
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._prev_sigterm)
        self._prev_sigterm = None
