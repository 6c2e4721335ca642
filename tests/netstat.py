"""Which TCP ports a process's network namespace listens on, read from /proc (no `ss`).

`/proc/PID/net/tcp{,6}` lists the sockets of PID's network namespace: on an emulated WAN
host (dtfm/wan: one namespace per host) that is what the host has open to the world. With
`owned=True` only sockets held by PID and its descendants count (their fds' inodes), for
tests on loopback, whose namespace other processes share."""

from __future__ import annotations

import os
from pathlib import Path

LISTEN = "0A"  # the kernel's TCP_LISTEN in /proc/net/tcp's "st" column


def _tree(pid: int) -> list[int]:
    """PID and its descendants (by /proc/*/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return out


def _inodes(pids: list[int]) -> set[str]:
    found = set()
    for p in pids:
        try:
            fds = os.listdir(f"/proc/{p}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{p}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                found.add(link[8:-1])
    return found


def listening_tcp_ports(pid: int, owned: bool = False) -> set[int]:
    """The TCP ports in LISTEN in PID's network namespace (IPv4 and IPv6); with `owned`,
    only those PID or its descendants hold."""
    inodes = _inodes(_tree(pid)) if owned else None
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == LISTEN and (inodes is None or f[9] in inodes):
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports
