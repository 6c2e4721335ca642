"""Rank 0's rendezvous store listens on the assignment's master address only, not on every
interface (`agent.worker.store`): the store has no authentication, so it must not be reachable
through addresses the job never named."""

from __future__ import annotations

import errno
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from agent.worker.store import bind_listener, rendezvous_store
from dtfm.rpc import free_port


def _connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def test_store_listens_on_the_master_address_only() -> None:
    port = free_port()
    store = rendezvous_store("127.0.0.1", port, 0, 1, timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"
    # 127.0.0.2 is this machine too (all of 127/8 is loopback), but not the named address.
    assert _connects("127.0.0.1", port) and not _connects("127.0.0.2", port)


def test_a_master_address_elsewhere_falls_back_and_a_busy_port_is_a_rendezvous_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert bind_listener("192.0.2.1", free_port()) is None  # TEST-NET-1: never ours
    assert "not on this machine" in caplog.text
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        with pytest.raises(dist.DistNetworkError, match="holds the port") as err:
            bind_listener("127.0.0.1", busy.getsockname()[1])
    assert isinstance(err.value.__cause__, OSError)
    assert err.value.__cause__.errno == errno.EADDRINUSE
