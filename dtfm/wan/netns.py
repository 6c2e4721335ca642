"""Network namespaces and TUN devices for the WAN emulator.

Owns the thin, privileged layer under :mod:`dtfm.wan`: creating and deleting the named network
namespaces the emulator builds (``ip netns``), giving each a persistent TUN device with one
address, entering a namespace from Python (``setns(2)`` through ctypes, because Python 3.11 has
no ``os.setns``), opening a TUN device from inside it, and finding the processes that still live
in a namespace so that teardown can end them.

Everything here acts only on namespaces whose names the caller passes in; nothing lists and
deletes namespaces by pattern, so several emulators (and other people's namespaces) can share a
machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import logging
import os
import shutil
import signal
import struct
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

NETNS_RUN_DIR = Path("/var/run/netns")
TUN_CLONE_DEVICE = "/dev/net/tun"
CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFNAMSIZ = 16


class NetnsError(RuntimeError):
    """An ``ip`` command or a namespace syscall failed."""


_libc: ctypes.CDLL | None = None


def _get_libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    return _libc


def setns(fd: int, nstype: int = CLONE_NEWNET) -> None:
    """Move the calling thread into the namespace that ``fd`` refers to (``setns(2)``)."""
    if _get_libc().setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def namespace_path(name: str) -> Path:
    return NETNS_RUN_DIR / name


@contextlib.contextmanager
def entered(name: str) -> Iterator[None]:
    """Run the body with the calling thread inside network namespace ``name``.

    The original namespace is restored on the way out, also when the body raises. File
    descriptors opened inside (sockets, TUN devices) stay bound to the namespace.
    """
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(namespace_path(name), os.O_RDONLY | os.O_CLOEXEC)
        try:
            setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            setns(home)
    finally:
        os.close(home)


def open_tun(ifname: str) -> int:
    """Attach to TUN device ``ifname`` in the current namespace; return a non-blocking fd.

    Packets are raw IP (``IFF_NO_PI``). The device may be persistent (made by ``ip tuntap``).
    """
    if len(ifname.encode()) >= IFNAMSIZ:
        raise ValueError(f"interface name too long: {ifname!r}")
    fd = os.open(TUN_CLONE_DEVICE, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        ifr = struct.pack("16sH22x", ifname.encode(), IFF_TUN | IFF_NO_PI)
        fcntl.ioctl(fd, TUNSETIFF, ifr)
    except BaseException:
        os.close(fd)
        raise
    return fd


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS`` and raise :class:`NetnsError` with its stderr when it fails."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


def namespace_exists(name: str) -> bool:
    return namespace_path(name).exists()


def create_namespace(name: str) -> int:
    """Create network namespace ``name`` with ``lo`` up; return its inode (an identity)."""
    ip("netns", "add", name)
    ip("-n", name, "link", "set", "dev", "lo", "up")
    return os.stat(namespace_path(name)).st_ino


def add_tun(name: str, ifname: str, address: str, prefix_len: int, mtu: int) -> None:
    """Give namespace ``name`` a persistent TUN ``ifname`` with ``address/prefix_len``, up.

    The connected route for the prefix then sends every packet to that subnet into the TUN,
    where the emulator reads it. IPv6 is switched off on the device so that no router
    solicitations or other chatter reach the emulator.
    """
    ip("-n", name, "tuntap", "add", "dev", ifname, "mode", "tun")
    with contextlib.suppress(OSError), entered(name):
        Path(f"/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6").write_text("1\n")
    ip("-n", name, "link", "set", "dev", ifname, "mtu", str(mtu))
    ip("-n", name, "addr", "add", f"{address}/{prefix_len}", "dev", ifname)
    ip("-n", name, "link", "set", "dev", ifname, "up")


def add_route(name: str, prefix: str, ifname: str) -> None:
    """Route ``prefix`` (e.g. ``10.213.0.0/24``) into ``ifname`` inside namespace ``name``."""
    ip("-n", name, "route", "add", prefix, "dev", ifname)


def set_sysctls(name: str, values: Mapping[str, str]) -> None:
    """Set ``net.*`` sysctls (per-namespace ones only) inside namespace ``name``."""
    for key in values:
        if not key.startswith("net.") or "/" in key or ".." in key:
            raise ValueError(f"only per-namespace net.* sysctls can be set; got {key!r}")
    with entered(name):
        for key, value in values.items():
            path = Path("/proc/sys") / key.replace(".", "/")
            try:
                path.write_text(f"{value}\n")
            except OSError as exc:
                raise NetnsError(f"sysctl {key}={value} in {name}: {exc.strerror}") from exc


def namespace_pids(name: str) -> list[int]:
    """Pids of the processes whose network namespace is ``name`` (``ip netns pids``)."""
    proc = ip("netns", "pids", name, check=False)
    if proc.returncode != 0:
        return []
    return [int(tok) for tok in proc.stdout.split() if tok.isdigit()]


def pids_in_namespaces(inodes: Sequence[int]) -> list[int]:
    """Pids of every process whose network namespace has one of ``inodes``.

    Works after the namespace's name is gone too, which is how tests prove that nothing was
    left behind.
    """
    wanted = set(inodes)
    found: list[int] = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            ino = os.stat(f"/proc/{entry.name}/ns/net").st_ino
        except OSError:
            continue
        if ino in wanted:
            found.append(int(entry.name))
    return found


def kill_namespace_processes(name: str) -> list[int]:
    """SIGKILL every process still inside namespace ``name``; return their pids.

    Only namespaces this package created are passed here, so every process inside one was
    started (directly or not) by whoever built the emulator.
    """
    pids = [pid for pid in namespace_pids(name) if pid != os.getpid()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if pids:
        log.warning("killed %d leftover process(es) in namespace %s: %s", len(pids), name, pids)
    return pids


def delete_namespace(name: str) -> None:
    """Delete namespace ``name`` if it exists (its devices go with it)."""
    if not namespace_exists(name):
        return
    proc = ip("netns", "delete", name, check=False)
    if proc.returncode != 0 and namespace_exists(name):
        raise NetnsError(f"ip netns delete {name}: {proc.stderr.strip()}")


def availability() -> tuple[bool, str]:
    """Whether namespaces and TUN devices can be made here, and if not, why not."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False, "needs root (network namespaces and TUN devices)"
    if shutil.which("ip") is None:
        return False, "the `ip` command (iproute2) is not installed"
    if not os.path.exists(TUN_CLONE_DEVICE):
        return False, f"{TUN_CLONE_DEVICE} does not exist"
    try:
        fd = os.open(TUN_CLONE_DEVICE, os.O_RDWR | os.O_CLOEXEC)
        os.close(fd)
    except OSError as exc:
        return False, f"cannot open {TUN_CLONE_DEVICE}: {exc.strerror}"
    try:
        _get_libc().setns  # noqa: B018 - probe the symbol
    except AttributeError:
        return False, "libc has no setns()"
    return True, ""
