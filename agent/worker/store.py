"""The rendezvous store, listening on rank 0's own address only.

`init_process_group(init_method="tcp://...")` makes rank 0 host its TCPStore on every
interface, so anyone who reaches any of the machine's addresses can write keys into the world's
rendezvous (the store has no authentication). Here rank 0 binds the listening socket itself to
the address the assignment names for it (`master_addr`) and hands it to the store
(`master_listen_fd`); the other ranks dial that address as before. Where that address is not
on this machine (rank 0 behind NAT, its advertised address forwarded to it), the store falls
back to every interface and says so: firewall the port (docs/operations.md).
"""

from __future__ import annotations

import errno
import logging
import socket
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger(__name__)


def rendezvous_store(master_addr: str, port: int, rank: int, world_size: int,
                     timeout: timedelta) -> dist.TCPStore:
    """The world's TCPStore: hosted by rank 0 on `master_addr` only, a client elsewhere."""
    if rank != 0:
        return dist.TCPStore(master_addr, port, world_size, False, timeout)
    listener = bind_listener(master_addr, port)
    if listener is None:
        return dist.TCPStore(master_addr, port, world_size, True, timeout)
    # The store serves on this descriptor from now on (libuv adopts it, no duplicate).
    return dist.TCPStore(master_addr, port, world_size, True, timeout,
                         master_listen_fd=listener.detach())


def bind_listener(host: str, port: int) -> socket.socket | None:
    """A socket listening on `host:port` only; None when `host` is not an address of ours."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRNOTAVAIL:
            log.warning("rendezvous address %s is not on this machine (NAT?): the store "
                        "listens on every interface; firewall port %d to the agents", host, port)
            return None
        raise dist.DistNetworkError(
            f"cannot listen on rendezvous address {host}:{port} ({exc.strerror}): another "
            f"process holds the port, or the address is wrong") from exc
    log.info("rendezvous store listens on %s:%d only", host, port)
    return sock
