"""``WanEmulator``: build an emulated wide-area network on one machine, and tear it down.

Owns the lifecycle that tests and benchmarks use: from an N x N one-way delay matrix (and an
optional bandwidth matrix) it creates one network namespace per host, each with a TUN device
and an address in a private /24, starts the forwarding process (:mod:`dtfm.wan.emulator`), and
runs commands inside the hosts. On exit (also on an exception or SIGTERM in the main thread) it
ends the processes it started and any others still inside its namespaces, stops the emulator,
and deletes exactly the namespaces it created.

While it runs, any link's delay or rate and any host's compute speed can change
(:meth:`WanEmulator.set_link`, ``wan.live.set_compute`` (:mod:`dtfm.wan.live`), or
``python -m dtfm.wan set`` against :attr:`WanEmulator.control_socket`), so tests and benchmarks
can script "this link degrades at step 40".

Hosts may sit behind a NAT (``nat=``, ``shared_nat=``: a private address, peers see the NAT's
public address and a mapped port, nothing comes in that the host did not open) or a stateful
firewall (``firewall=``: a public address that cannot be dialled); :mod:`dtfm.wan.nat` says how
they behave. :meth:`WanEmulator.address` is where a host binds, :meth:`WanEmulator.public_address`
what its peers see, :meth:`WanEmulator.dialable` whether one host can open a connection to
another.

The harness owns the lifecycle (the order of the steps up and down) and keeps the calls tests
use most; the rest is its collaborators', each with a public interface: ``topology``
(:mod:`dtfm.wan.topology`: hosts, addresses, the delay and bandwidth matrices), ``sites``
(:class:`dtfm.wan.nat.Sites`: NAT and firewall hosts, who can dial whom), ``live``
(:mod:`dtfm.wan.live`: changes while it runs), ``processes`` (:mod:`dtfm.wan.processes`:
commands inside the hosts) and ``forwarder`` (:mod:`dtfm.wan.forwarder_process`: the
forwarding process).

Traffic stays inside the namespaces: the only route each host has besides ``lo`` is the /24
on its TUN (a NATed host: its LAN /24 and a route to the public /24), and the emulator forwards
only between the addresses it assigned.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from types import FrameType, TracebackType
from typing import Any

from dtfm.wan import nat as reach
from dtfm.wan import netns
from dtfm.wan.forwarder_process import ForwarderProcess
from dtfm.wan.live import LiveChanges
from dtfm.wan.processes import HostProcesses
from dtfm.wan.topology import DEFAULT_IFNAME, NAME_PREFIX, Matrix, OptMatrix, Topology, check_links

log = logging.getLogger(__name__)

DEFAULT_MTU = 65000


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
        delays, rates = check_links(delay_ms, bandwidth_mbps)
        if not 576 <= mtu <= 65535:
            raise ValueError(f"mtu must be in [576, 65535]; got {mtu}")
        if queue_ms is not None and queue_ms < 0:
            raise ValueError(f"queue_ms must be >= 0; got {queue_ms}")
        self._mtu = mtu
        self._queue_ms = queue_ms
        self._sysctls = dict(sysctls or {})
        for key in self._sysctls:
            if not key.startswith("net."):
                raise ValueError(f"only per-namespace net.* sysctls can be set; got {key!r}")
        token = secrets.token_hex(3)
        subnet = subnet if subnet is not None else 100 + secrets.randbelow(150)
        if not 0 <= subnet <= 255:
            raise ValueError(f"subnet must be in [0, 255]; got {subnet}")
        self.topology = Topology(delays, rates, subnet=subnet, token=token, nat=nat,
                                 firewall=firewall, shared_nat=shared_nat)
        """The hosts, their namespaces and addresses, and the links as they are now."""
        self.sites = self.topology.sites
        """Where each host sits (public, firewalled, behind which NAT) and who can dial whom."""
        self.forwarder = ForwarderProcess(token, log_level, self._require_running)
        """The forwarding process: its pid, log, control socket."""
        self.live = LiveChanges(self.topology, self.forwarder)
        """Changes while it runs: links (delay, rate, cut) and hosts' compute speed."""
        self.processes = HostProcesses(self.topology.namespace, self._require_running)
        """The commands started inside the hosts (ended when it closes)."""
        self._created: list[str] = []
        self._inodes: list[int] = []
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
        return self.topology.size

    @property
    def delay_ms(self) -> list[list[float]]:
        """One-way delays (row = from, column = to), diagonal 0."""
        return self.topology.delay_ms

    @property
    def bandwidth_mbps(self) -> list[list[float | None]]:
        """Rates in Mbit/s (row = from, column = to); None = unlimited."""
        return self.topology.bandwidth_mbps

    @property
    def namespace_inodes(self) -> list[int]:
        """Inodes of the namespaces (identity that outlives their names, for leak checks)."""
        return list(self._inodes)

    @property
    def emulator_pid(self) -> int | None:
        return self.forwarder.pid

    @property
    def control_socket(self) -> str:
        """The forwarder's control socket (for ``python -m dtfm.wan set --control``)."""
        return self.forwarder.control_socket

    def set_link(self, src: int, dst: int, *, delay_ms: float | None = None,
                 bandwidth_mbps: float | None | str = "keep", both_ways: bool = False,
                 cut: bool | None = None) -> None:
        """Change the link src -> dst (and back with ``both_ways``) while it runs, as
        :meth:`dtfm.wan.live.LiveChanges.set_link` says."""
        self.live.set_link(src, dst, delay_ms=delay_ms, bandwidth_mbps=bandwidth_mbps,
                           both_ways=both_ways, cut=cut)

    def set_links(self, changes: Sequence[Mapping[str, Any]]) -> None:
        """Apply several link changes at once (:meth:`dtfm.wan.live.LiveChanges.set_links`)."""
        self.live.set_links(changes)

    def forget_nat(self) -> int:
        """Every NAT drops its mappings while it runs
        (:meth:`dtfm.wan.live.LiveChanges.forget_nat`)."""
        return self.live.forget_nat()

    def address(self, i: int) -> str:
        """IPv4 address of host ``i`` (inside its namespace): where it binds. Behind a NAT it is
        private (192.168.1.x, the same for hosts behind different NATs) and only hosts behind
        the same NAT reach it."""
        return self.sites.address(i)

    def public_address(self, i: int) -> str:
        """The address host ``i``'s peers see: its NAT's public address if it is behind a NAT
        (with a mapped port per connection), else its own."""
        return self.sites.public_address(i)

    def dialable(self, src: int, dst: int) -> bool:
        """Whether host ``src`` can open a connection to host ``dst`` at ``address(dst)``
        (:meth:`dtfm.wan.nat.Sites.dialable`)."""
        return self.sites.dialable(src, dst)

    def namespace(self, i: int) -> str:
        """Name of host ``i``'s network namespace."""
        return self.topology.namespace(i)

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside host ``i``'s namespace."""
        return self.processes.command(i, argv)

    def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside host ``i``; the process is killed when the emulator closes."""
        return self.processes.popen(i, argv, **kwargs)

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
            self.forwarder.start(self.topology, self._queue_ms)
        except BaseException:
            self.close()
            raise
        log.info(
            "WAN up: %d hosts %s in namespaces %s (emulator pid %d)",
            self.size, [f"{p.address} ({p.reachability} {p.public_address})"
                        if p.reachability != reach.PUBLIC else p.address
                        for p in self.sites.places], self.topology.names, self.emulator_pid,
        )

    def _create_hosts(self) -> None:
        for name, place in zip(self.topology.names, self.sites.places, strict=True):
            if netns.namespace_exists(name):
                raise RuntimeError(f"namespace {name} already exists; refusing to reuse it")
            inode = netns.create_namespace(name)
            self._created.append(name)
            self._inodes.append(inode)
            netns.add_tun(name, DEFAULT_IFNAME, place.address, 24, self._mtu)
            if place.reachability == reach.NAT:  # its LAN is connected; the Internet via the NAT
                netns.add_route(name, self.topology.lan, DEFAULT_IFNAME)
            if self._sysctls:
                netns.set_sysctls(name, self._sysctls)

    def emulator_log(self, tail: int = 4000) -> str:
        """The last ``tail`` characters of the forwarding process's log."""
        return self.forwarder.log(tail)

    def close(self) -> None:
        """Kill started processes, stop the emulator, delete the namespaces. Idempotent."""
        if self._closed or not self._started:
            return
        self._closed = True
        errors: list[str] = []
        try:
            self.processes.stop()
        except Exception as exc:  # keep tearing down
            errors.append(f"stopping processes: {exc}")
        for name in self._created:
            try:
                netns.kill_namespace_processes(name)
            except Exception as exc:
                errors.append(f"killing processes in {name}: {exc}")
        try:
            self.forwarder.stop()
        except Exception as exc:
            errors.append(f"stopping the emulator: {exc}")
        for name in self._created:
            try:
                netns.delete_namespace(name)
            except Exception as exc:
                errors.append(f"deleting {name}: {exc}")
        self.stats = self.forwarder.finish()
        self._restore_sigterm()
        if errors:
            log.error("WAN teardown incomplete: %s", "; ".join(errors))
            raise RuntimeError("WAN teardown incomplete: " + "; ".join(errors))
        log.info("WAN down: namespaces %s deleted", self._created)

    @property
    def emulator_running(self) -> bool:
        """Whether the forwarding process is alive (if it is not, no packet moves)."""
        return self.forwarder.running

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
