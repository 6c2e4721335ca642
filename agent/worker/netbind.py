"""Which network interface the worker's collective backend binds to, and why.

gloo (and NCCL's bootstrap) pick the address they advertise to peers from the host name, which
on many distributions resolves to loopback (Debian maps it to 127.0.1.1). A cross-host job then
fails at `init_process_group` with "Gloo connectFullMesh failed ... Connection refused
remote=[127.0.0.1]": every rank tells its peers to connect to their own loopback. The only
reliable fix is to name the interface, through GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, before
the process group is created. This module owns that choice, in order of precedence:

1. `DTFM_BIND_INTERFACE` (the agent's `--bind-interface`): the operator's explicit choice;
   it must name an interface of this host.
2. A GLOO_SOCKET_IFNAME already in the environment: the operator set it; respect it.
3. The interface that holds the assignment's `bind_addr` (the address this rank's agent
   advertises to peers; an IP or a host name). A loopback `bind_addr` means a one-machine
   job: the loopback interface.
4. The interface holding the local address that routes to `master_addr`, unless that is
   loopback.
5. Nothing: the backend's own default.

Imports nothing from torch; `choose()` reads the environment it is given, `apply()` writes it.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import MutableMapping
from dataclasses import dataclass

from dtfm.core.events import WorkerEnv

log = logging.getLogger(__name__)

ENV_BIND_INTERFACE = WorkerEnv.BIND_INTERFACE  # set by dtfm.launcher
GLOO_ENV = "GLOO_SOCKET_IFNAME"
NCCL_ENV = "NCCL_SOCKET_IFNAME"
SIOCGIFADDR = 0x8915
IF_INET6 = "/proc/net/if_inet6"


@dataclass(frozen=True)
class BindChoice:
    """The interface to bind (None: leave the backend's default) and the reason, for the log."""

    interface: str | None
    reason: str


def interface_names() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def ipv4_of(interface: str) -> str | None:
    """The primary IPv4 address of an interface (SIOCGIFADDR), or None if it has none."""
    req = struct.pack("256s", interface.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)
        except OSError:
            return None
    return socket.inet_ntoa(res[20:24])


def ipv6_interfaces(path: str = IF_INET6) -> dict[str, str]:
    """IPv6 address (compressed text) -> interface name, from /proc/net/if_inet6."""
    out: dict[str, str] = {}
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and len(parts[0]) == 32:
                    out[str(ipaddress.IPv6Address(int(parts[0], 16)))] = parts[5]
    except OSError:
        pass
    return out


def interface_holding(address: str) -> str | None:
    """The interface that holds an IP address; any loopback address maps to loopback."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if ip.is_loopback:
        return loopback_interface()
    if ip.version == 6:
        return ipv6_interfaces().get(str(ip))
    for name in interface_names():
        if ipv4_of(name) == str(ip):
            return name
    return None


def loopback_interface() -> str:
    for name in interface_names():
        if ipv4_of(name) == "127.0.0.1":
            return name
    return "lo"


def resolve(host: str) -> list[str]:
    """The IP addresses a host name (or literal) resolves to, IPv4 first; ValueError if none."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            raise ValueError(
                f"the assignment's bind_addr {host!r} does not resolve to an address ({e}); "
                f"fix the agent's advertised address or pass --bind-interface"
            ) from e
        raise
    addrs = [str(info[4][0]) for info in infos]
    return sorted(dict.fromkeys(addrs), key=lambda a: ":" in a)


def route_source(master_addr: str, port: int = 9) -> str | None:
    """The local address the kernel would use to reach master_addr (UDP connect sends nothing)."""
    try:
        infos = socket.getaddrinfo(master_addr, port, type=socket.SOCK_DGRAM)
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return str(s.getsockname()[0])
    except OSError:
        return None


def _explicit(env: MutableMapping[str, str]) -> BindChoice | None:
    name = env.get(ENV_BIND_INTERFACE, "")
    if name:
        names = interface_names()
        if name not in names:
            raise ValueError(
                f"--bind-interface {name!r} ({ENV_BIND_INTERFACE}) is not a network interface "
                f"of this host; it has: {', '.join(names)}"
            )
        return BindChoice(name, f"--bind-interface ({ENV_BIND_INTERFACE})")
    if env.get(GLOO_ENV):
        return BindChoice(env[GLOO_ENV], f"{GLOO_ENV} already set in the environment")
    return None


def _from_bind_addr(bind_addr: str) -> BindChoice | None:
    if not bind_addr:
        return None
    for addr in resolve(bind_addr):
        name = interface_holding(addr)
        if name:
            return BindChoice(name, f"it holds bind_addr {bind_addr} ({addr})")
    log.warning(
        "no interface of this host holds bind_addr %s (behind NAT?); using the route to the "
        "master instead", bind_addr,
    )
    return None


def _from_route(master_addr: str) -> BindChoice | None:
    src = route_source(master_addr) if master_addr else None
    if src is None or ipaddress.ip_address(src.split("%")[0]).is_loopback:
        return None
    name = interface_holding(src)
    return BindChoice(name, f"it holds {src}, the route to master {master_addr}") if name else None


def choose(
    bind_addr: str, master_addr: str, env: MutableMapping[str, str] | None = None
) -> BindChoice:
    """The interface to bind, by the precedence in the module docstring."""
    env = os.environ if env is None else env
    for choice in (_explicit(env), _from_bind_addr(bind_addr), _from_route(master_addr)):
        if choice is not None:
            return choice
    return BindChoice(None, "no interface holds bind_addr or routes to the master")


def listen_host(bind_addr: str, choice: BindChoice) -> str:
    """The local address the dtfm data plane listens on: `bind_addr` where this host holds
    it; else (a forwarded or NATed address) the chosen interface's IPv4; else every
    interface. The listener authenticates every peer before reading a frame."""
    for addr in resolve(bind_addr) if bind_addr else []:
        if interface_holding(addr):
            return addr
    if choice.interface and (ip := ipv4_of(choice.interface.split(",")[0])):
        return ip
    return "0.0.0.0"


def apply(
    choice: BindChoice, backend: str, env: MutableMapping[str, str] | None = None
) -> None:
    """Export the choice for the backend (NCCL gets an exact-match `=name`) and log it."""
    env = os.environ if env is None else env
    if choice.interface is None:
        log.info("collectives bind to the backend's default interface: %s", choice.reason)
        return
    if not env.get(GLOO_ENV) or env.get(ENV_BIND_INTERFACE):
        env[GLOO_ENV] = choice.interface
    if backend == "nccl" and (not env.get(NCCL_ENV) or env.get(ENV_BIND_INTERFACE)):
        env[NCCL_ENV] = "=" + choice.interface.split(",")[0]
    log.info("collectives bind to interface %s: %s", choice.interface, choice.reason)
