"""The rendezvous store, listening on rank 0's own address only.

`init_process_group(init_method="tcp://...")` makes rank 0 host its TCPStore on every
interface, so anyone who reaches any of the machine's addresses can write keys into the world's
rendezvous (the store has no authentication). Here rank 0 binds the listening socket itself to
the address the assignment names for it (`master_addr`) and hands it to the store
(`master_listen_fd`); the other ranks dial that address as before. Where that address is not
on this machine (rank 0 behind NAT, its advertised address forwarded to it), the store falls
back to every interface and says so: firewall the port (docs/operations.md).

The store also serves a new gloo group's member addresses in one round trip instead of two
per member (`GroupAddressStore`): over a 200 ms link those round trips were most of the time
a worker spent creating its groups.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Sequence
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


class ForwardingStore(dist.Store):
    """A store that passes every call to `inner`: the base for a store that changes a few
    (a python `dist.Store` subclass must implement each method torch may call)."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner

    def set(self, key: str, value: bytes | str) -> None:
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(list(keys))
        else:
            self.inner.wait(list(keys), timeout)

    def add(self, key: str, value: int) -> int:
        return self.inner.add(key, value)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    def append(self, key: str, value: bytes | str) -> None:
        self.inner.append(key, value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.inner.multi_get(keys)

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        self.inner.multi_set(keys, values)

    def has_extended_api(self) -> bool:
        return self.inner.has_extended_api()


class GroupAddressStore(ForwardingStore):
    """The world's store, with a new gloo group's addresses fetched in one round trip.

    Creating a gloo group, each member publishes its address under `PREFIX/<group rank>`,
    then for every member in turn waits for that key and reads it: 2 x size sequential round
    trips to rank 0's host (8 for a 4-stage pipeline's group, 300-400 ms each between the
    emulated cities). Told what comes (`expect`, by `world.py` around each group it creates),
    the first wait for `PREFIX/0` after this rank published `PREFIX/<its rank>` waits for all
    `size` keys at once and reads them with one `multi_get`; the per-member waits and reads
    that follow are answered from that. Anything else, and everything when not told, passes
    straight through, so what gloo receives is byte for byte what the store holds.
    """

    def __init__(self, inner: dist.Store) -> None:
        super().__init__(inner)
        self._expect: tuple[int, int] | None = None  # (group size, this rank's group rank)
        self._prefix: str | None = None  # the key prefix this rank published its address under
        self._fetched: dict[str, bytes] = {}
        self.batched = 0  # groups whose addresses came in one fetch (the tests count them)

    def expect(self, size: int | None, group_rank: int = 0) -> None:
        """The next group created has `size` members and this rank is `group_rank` in it;
        None when it is created (a stale hint must not apply to a later group)."""
        self._expect = None if size is None else (size, group_rank)
        self._prefix = None
        self._fetched.clear()

    # what group creation calls, with the one shortcut
    def set(self, key: str, value: bytes | str) -> None:
        if self._expect is not None and key.endswith(f"/{self._expect[1]}"):
            self._prefix = key[: key.rfind("/") + 1]
        self.inner.set(key, value)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        keys = list(keys)
        if self._expect is not None and self._prefix is not None and keys == [self._prefix + "0"]:
            members = [f"{self._prefix}{i}" for i in range(self._expect[0])]
            super().wait(members, timeout)
            self._fetched = dict(zip(members, self.inner.multi_get(members), strict=True))
            self._expect = None
            self.batched += 1
            return
        if keys and all(k in self._fetched for k in keys):
            return
        super().wait(keys, timeout)

    def get(self, key: str) -> bytes:
        got = self._fetched.pop(key, None)
        return got if got is not None else self.inner.get(key)
