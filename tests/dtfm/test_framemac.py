"""Frames a relay cannot alter (issue 43, item 5): the per-pair MAC and AEAD framing, pure
(`dtfm.net.framemac.Direction`), then through a real relay that flips one bit of what it
forwards, between two real meshes on loopback: the receive fails naming the relay."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch

from agent.worker.transport import TransportConfig
from agent.worker.transport.mesh import Mesh
from dtfm.core import pairkeys
from dtfm.net import dataplane as dp
from dtfm.net import framemac as fm
from dtfm.net.relay import Relay

MASTER = bytes(range(32))
KEY = pairkeys.pair_key(MASTER, 0, 1)
HEADER = dp.Header(dp.job_digest("j"), 1, 0, 1, 7, 3, 64 + 32).pack()


def _sealed(mode: str, payloads: list[bytes], key: bytes = KEY) -> list[bytes]:
    tx = fm.Direction(mode, key, 0, 1)
    return [b"".join(bytes(p) for p in tx.seal(HEADER, memoryview(x))) for x in payloads]


def _open(rx: fm.Direction, wire: bytes, header: bytes = HEADER) -> bytes:
    rx.check_head(header, wire[:fm.TAG_BYTES])
    return bytes(rx.open_buffer(header, bytearray(wire[fm.TAG_BYTES:])))


@pytest.mark.parametrize("mode", [fm.MAC, fm.ENCRYPT])
def test_the_right_key_opens_frames_in_order(mode: str) -> None:
    frames = [bytes([i]) * 64 for i in range(3)]
    rx = fm.Direction(mode, KEY, 0, 1)
    assert [_open(rx, w) for w in _sealed(mode, frames)] == frames
    assert all(len(w) == 64 + fm.overhead(mode) for w in _sealed(mode, frames))


def test_encrypt_hides_the_payload_and_mac_does_not() -> None:
    secret = b"activation" * 6 + b"abcd"
    assert secret not in _sealed(fm.ENCRYPT, [secret])[0]
    assert secret in _sealed(fm.MAC, [secret])[0]


@pytest.mark.parametrize("mode", [fm.MAC, fm.ENCRYPT])
@pytest.mark.parametrize("bit", [fm.TAG_BYTES * 8 + 5, fm.TAG_BYTES * 8 + 64 * 8 - 1,
                                 (fm.TAG_BYTES + 64) * 8 + 3])  # payload first, last, tag
def test_one_flipped_bit_is_refused(mode: str, bit: int) -> None:
    wire = bytearray(_sealed(mode, [b"x" * 64])[0])
    wire[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(fm.FrameRefused, match="frame 0"):
        _open(fm.Direction(mode, KEY, 0, 1), bytes(wire))


@pytest.mark.parametrize("mode", [fm.MAC, fm.ENCRYPT])
def test_a_changed_header_is_refused_before_its_length_is_trusted(mode: str) -> None:
    wire = _sealed(mode, [b"x" * 64])[0]
    longer = dp.Header(dp.job_digest("j"), 1, 0, 1, 7, 3, 1 << 30).pack()
    with pytest.raises(fm.FrameRefused):
        fm.Direction(mode, KEY, 0, 1).check_head(longer, wire[:fm.TAG_BYTES])
    with pytest.raises(dp.FrameError, match="fewer than its 32 bytes of tags"):
        fm.Direction(mode, KEY, 0, 1).rest(31)  # a keyed peer's own lie: no room for tags
    assert fm.Direction(mode, KEY, 0, 1).rest(32) == fm.TAG_BYTES


@pytest.mark.parametrize("mode", [fm.MAC, fm.ENCRYPT])
def test_replayed_reordered_or_spliced_frames_are_refused(mode: str) -> None:
    one, two = _sealed(mode, [b"1" * 64, b"2" * 64])
    rx = fm.Direction(mode, KEY, 0, 1)
    assert _open(rx, one) == b"1" * 64
    with pytest.raises(fm.FrameRefused, match="frame 1"):  # frame 0 again
        _open(rx, one)
    with pytest.raises(fm.FrameRefused, match="frame 0"):  # the second one first
        _open(fm.Direction(mode, KEY, 0, 1), two)
    spliced = one[:fm.TAG_BYTES] + two[fm.TAG_BYTES:]  # frame 0's header, frame 1's body
    with pytest.raises(fm.FrameRefused):
        _open(fm.Direction(mode, KEY, 0, 1), spliced)


@pytest.mark.parametrize("mode", [fm.MAC, fm.ENCRYPT])
def test_another_pairs_key_or_the_other_direction_is_refused(mode: str) -> None:
    wire = _sealed(mode, [b"x" * 64])[0]
    with pytest.raises(fm.FrameRefused):  # a relay's own keys are of other pairs
        _open(fm.Direction(mode, pairkeys.pair_key(MASTER, 0, 2), 0, 1), wire)
    with pytest.raises(fm.FrameRefused):  # reflected back at its sender
        _open(fm.Direction(mode, KEY, 1, 0), wire)


def test_keys_rows_give_each_rank_its_own_pairs_only() -> None:
    rows = [pairkeys.keys_for(MASTER, r, 4) for r in range(4)]
    assert [len(k) for k in rows[1]] == [32, 0, 32, 32]
    assert rows[0][3] == rows[3][0] == pairkeys.pair_key(MASTER, 3, 0)
    held_by_2 = set(rows[2])
    assert pairkeys.pair_key(MASTER, 0, 1) not in held_by_2  # rank 2 relaying 0-1 lacks its key
    fresh = pairkeys.new_master()  # the next epoch's
    assert pairkeys.pair_key(fresh, 0, 1) != pairkeys.pair_key(MASTER, 0, 1)


def test_a_refusal_reads_back_with_its_relay() -> None:
    r = fm.Refusal(4, 3, 1, fm.MAC, "10.0.0.2:7000")
    assert fm.refusal(f"PeerError: recv failed: {fm.refusal_message(r)}") == r
    direct = fm.Refusal(0, 3, 1, fm.ENCRYPT, "")
    assert fm.refusal(fm.refusal_message(direct)) == direct
    assert fm.refusal("receive from rank 3 failed: connection reset") is None


class FlippingRelay(Relay):
    """A hostile relay: flips one bit of the first payload byte of frame `at` it forwards
    from rank 0 (a seam of the test, not a product flag)."""

    def __init__(self, at: int) -> None:
        super().__init__(pair_timeout_s=5)
        self.at, self.seen, self.flipped = at, 0, threading.Event()

    def outgoing(self, header: dp.Header, chunk: bytes) -> bytes:
        if header.src != 0 or header.stream == dp.CONTROL_STREAM or self.flipped.is_set():
            return chunk
        self.seen += 1
        if self.seen <= self.at:
            return chunk
        self.flipped.set()
        return bytes([chunk[0] ^ 1]) + chunk[1:]


def _meshes(relay: str, frames: str) -> tuple[Mesh, Mesh]:
    keys = pairkeys.keys_for(MASTER, 0, 2), pairkeys.keys_for(MASTER, 1, 2)
    return tuple(Mesh(TransportConfig(  # type: ignore[return-value]
        "job-t", 1, b"epoch", {0: None, 1: None}, relay=relay, timeout=timedelta(seconds=8),
        frames=frames, pair_keys=dict(enumerate(keys[r]))), r) for r in (0, 1))


@contextmanager
def _through(relay: Relay, frames: str) -> Iterator[tuple[Mesh, Mesh, str]]:
    """Ranks 0 and 1 of job-t meeting at `relay` (started here, stopped after), with
    `frames`: (rank 0's mesh, rank 1's, the relay's address)."""
    relay.admit("job-t", 1, b"epoch", world_size=2)
    addr = relay.start_in_thread()
    a, b = _meshes(addr, frames)
    try:
        yield a, b, addr
    finally:
        a.close()
        b.close()
        relay.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("frames", [fm.MAC, fm.ENCRYPT])
def test_a_bit_flipped_by_the_relay_fails_the_receive_naming_the_relay(frames: str) -> None:
    relay = FlippingRelay(at=1)
    with _through(relay, frames) as (a, b, addr):
        first, second = torch.zeros(256), torch.zeros(256)
        works = [b.recv(0, 5, 1, first), b.recv(0, 5, 2, second)]
        a.send(1, 5, 1, torch.arange(256.0)).wait(timedelta(seconds=8))
        a.send(1, 5, 2, torch.ones(256)).wait(timedelta(seconds=8))
        works[0].wait(timedelta(seconds=8))
        assert torch.equal(first, torch.arange(256.0))  # frame 0 went through untouched
        with pytest.raises(RuntimeError) as err:
            works[1].wait(timedelta(seconds=8))
        assert relay.flipped.is_set()
        refusal = fm.refusal(str(err.value))
        assert refusal == fm.Refusal(1, 0, 1, frames, addr), str(err.value)


@pytest.mark.timeout(60)
def test_without_protection_the_flipped_bit_arrives_unnoticed() -> None:
    """What the MAC is for: with `off`, the altered frame is delivered as sent."""
    relay = FlippingRelay(at=0)
    with _through(relay, fm.OFF) as (a, b, addr):
        got = torch.zeros(4, dtype=torch.uint8)
        work = b.recv(0, 5, 1, got)
        a.send(1, 5, 1, torch.tensor([8, 8, 8, 8], dtype=torch.uint8))
        work.wait(timedelta(seconds=8))
        assert got.tolist() == [9, 8, 8, 8]


def test_a_mesh_without_its_pair_key_refuses_to_start() -> None:
    cfg = TransportConfig("job-t", 1, b"epoch", {0: None, 1: "127.0.0.1:1"}, frames=fm.MAC,
                          pair_keys={1: b"short"})
    with pytest.raises(ValueError, match="pair key"):
        Mesh(cfg, 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("frames", [fm.MAC, fm.ENCRYPT])
def test_frames_that_wait_in_the_mailbox_are_checked_and_delivered(frames: str) -> None:
    relay = FlippingRelay(at=1 << 30)  # honest
    with _through(relay, frames) as (a, b, addr):
        b.peer(0)  # connects (to the relay), with no receive posted yet
        for tag in (1, 2):  # sent before any receive is posted: they wait in the mailbox
            a.send(1, 5, tag, torch.full((300,), float(tag))).wait(timedelta(seconds=8))
        got = [torch.zeros(300), torch.zeros(300)]
        for tag, t in zip((1, 2), got, strict=True):
            b.recv(0, 5, tag, t).wait(timedelta(seconds=8))
        assert [t[0].item() for t in got] == [1.0, 2.0]
        assert relay.forwarded_bytes == 2 * (1200 + fm.overhead(frames))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("flip", [None, (5 << 20) // 2])  # a bit in the third chunk
def test_a_frame_of_many_chunks_streams_through_the_mac(flip: int | None) -> None:
    """`send` and `receive_into` MAC a chunk at a time as it crosses the socket: a frame of
    several chunks arrives whole, and a bit flipped in a later chunk is refused."""
    payload = memoryview(bytearray(range(256)) * (5 << 12))  # 5 MiB
    a, b = socket.socketpair()
    wire = bytearray()
    sender = threading.Thread(target=fm.Direction(fm.MAC, KEY, 0, 1).send,
                              args=(a, HEADER, payload))
    sender.start()
    H = dp.HEADER_BYTES
    while len(wire) < len(payload) + H + 2 * fm.TAG_BYTES:
        wire += b.recv(1 << 20)
    sender.join()
    if flip is not None:
        wire[H + fm.TAG_BYTES + flip] ^= 4
    c, d = socket.socketpair()
    threading.Thread(target=c.sendall, args=(bytes(wire[H:]),), daemon=True).start()
    rx, out = fm.Direction(fm.MAC, KEY, 0, 1), memoryview(bytearray(len(payload)))
    try:
        rx.receive_head(d, bytes(wire[:H]))
        if flip is None:
            rx.receive_into(d, bytes(wire[:H]), out)
            assert out == payload
        else:
            with pytest.raises(fm.FrameRefused, match="frame 0"):
                rx.receive_into(d, bytes(wire[:H]), out)
    finally:
        for s in (a, b, c, d):
            s.close()


@pytest.mark.timeout(60)
def test_a_header_tag_changed_by_the_relay_is_named_as_tampering() -> None:
    """The relay flips a bit of frame 0's header tag, the first bytes after the header: the
    receive names the relay (the header is checked before its length is trusted)."""
    relay = FlippingRelay(at=0)
    relay.outgoing = lambda h, chunk: (  # type: ignore[method-assign]
        bytes([chunk[0] ^ 1]) + chunk[1:] if h.stream != dp.CONTROL_STREAM else chunk)
    with _through(relay, fm.MAC) as (a, b, addr):
        work = b.recv(0, 5, 1, torch.zeros(8))
        a.send(1, 5, 1, torch.ones(8))
        with pytest.raises(RuntimeError) as err:
            work.wait(timedelta(seconds=8))
        assert fm.refusal(str(err.value)) == fm.Refusal(0, 0, 1, fm.MAC, addr), str(err.value)
