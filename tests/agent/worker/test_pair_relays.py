"""A pair of dial-only ranks meets at its own relay (TransportConfig.pair_relays), not the
default one: the peer table carries it through the environment, and two meshes exchange a
tensor through that relay while the default relay is not even running."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch

from agent.worker.transport import TransportConfig
from agent.worker.transport.mesh import Mesh
from dtfm.net.relay import Relay
from dtfm.rpc import free_port

SECRET = b"epoch-secret-of-the-test"


def test_pair_relay_overrides_the_default_and_survives_the_env(tmp_path: Path) -> None:
    cfg = TransportConfig("j", 2, SECRET, {0: None, 1: None, 2: None},
                          relay="10.0.0.1:7170", pair_relays={(0, 2): "10.0.0.9:7171"})
    assert cfg.relay_for(2, 0) == "10.0.0.9:7171"
    assert cfg.relay_for(0, 1) == "10.0.0.1:7170"
    assert cfg.mode(0, 2) == cfg.mode(2, 0) == "relay"
    (tmp_path / "s").write_bytes(SECRET)
    back = TransportConfig.from_env({"DTFM_TRANSPORT": cfg.to_env(str(tmp_path / "s"))})
    assert back.pair_relays == {(0, 2): "10.0.0.9:7171"} and back.relay == cfg.relay
    with pytest.raises(ValueError, match="low rank, high rank"):
        TransportConfig("j", 2, SECRET, {0: None, 1: None}, pair_relays={(1, 0): "h:1"})
    # no default relay, but the pair has its own: it still meets there
    own = TransportConfig("j", 2, SECRET, {0: None, 1: None}, pair_relays={(0, 1): "h:1"})
    assert own.mode(0, 1) == "relay"


@pytest.mark.timeout(60)
def test_two_dialers_meet_at_their_pair_relay() -> None:
    relay = Relay(None, pair_timeout_s=10)
    addr = relay.start_in_thread()
    relay.admit("j", 2, SECRET, 2)
    dead = f"127.0.0.1:{free_port()}"  # the default relay: nobody listens there
    meshes = [Mesh(TransportConfig("j", 2, SECRET, {0: None, 1: None}, relay=dead,
                                   pair_relays={(0, 1): addr},
                                   timeout=timedelta(seconds=20)), r) for r in (0, 1)]
    try:
        buf = torch.zeros(8)
        work = meshes[1].recv(0, 0, 3, buf)
        meshes[0].send(1, 0, 3, torch.arange(8.0)).wait()
        work.wait(timedelta(seconds=20))
        assert torch.equal(buf, torch.arange(8.0))
        assert relay.forwarded("j") > 0
    finally:
        for m in meshes:
            m.close()
        relay.stop()
