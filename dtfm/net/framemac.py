"""Frames a relay cannot alter: a per-pair MAC (or AEAD encryption) on every data-plane frame
(issue 43, item 5).

Why: a relay (`dtfm/net/relay.py`) is often a volunteer agent. It holds the epoch's key (it
must prove it in the handshake with each end), so the handshake says nothing about what it
forwards afterwards: it could flip bits of an activation or a gradient and nobody would know.

Keys: the coordinator, which is trusted, draws a fresh random master per epoch and gives each
rank, inside its own assignment only, the key it shares with each other rank
(`DataPlane.pair_keys`, dtfm/core/pairkeys.py): key(a, b) = HMAC-SHA256(master, label | a |
b), a < b.
The master never leaves the coordinator's memory (nothing keeps it: an epoch's keys are not
needed after its assignments are sent). A relay agent is a member and gets its own row
(the keys of its own pairs); the pairs it relays are never its own (both their ends only
dial, while a relay agent is reachable from everywhere), so it never holds their key.

Frames (`dtfm.net.dataplane.Header`, then the payload): with protection on, the header's
length counts 32 more bytes (`overhead`), so a relay forwards them without knowing the mode:

- every protected frame: header | header tag | ... , the header tag the first 16 bytes of
  HMAC-SHA256(direction key, frame number | header), checked before the receiver trusts the
  header's length (`Direction.check_head`; a truncated HMAC-SHA256 is a PRF: a forgery
  succeeds with probability 2^-128 per try, and a failed try ends the connection);
- `mac` (the default): ... | payload | tag, the tag a GMAC (AES-256-GCM authenticating,
  encrypting nothing) under the direction key of the header and the payload, a 1 MiB chunk
  at a time, with the frame number in every nonce (`_ChunkedGmac`). The tag is the full 16
  bytes. GMAC was measured against HMAC-SHA256 and Poly1305 over the payload on one core
  of this shared machine, best of 10 over 16 MiB: GMAC 10.6, Poly1305 5.5, HMAC-SHA256
  about 0.5-1 GB/s, and AES-GCM releases the GIL while Poly1305 holds it
  (`bench/transport.py` prints each mode's sealing rate and transport cost);
- `encrypt`: ... | AES-256-GCM(direction key, nonce = frame number, aad = header,
  payload) (ciphertext, then its 16-byte tag): the payload is also hidden from the relay;
  a message is at most `MAX_ENCRYPTED` (2 GiB) bytes in this mode;
- `off`: header | payload, as before.

The direction key is HMAC-SHA256(pair key, label | src | dst): a frame of one direction is
refused in the other (reflection). Each direction numbers its frames from 0 (`Direction`),
and the number is in the tag's key (or the nonce) but not on the wire: a frame replayed,
dropped, or moved is checked under another number and refused, as is a header spliced onto
another payload. A number never repeats under one key: the key is fresh per epoch and pair,
and one connection per pair and epoch carries frames (`agent/worker/transport/mesh.py` never
replaces a connection a frame has crossed). The control frames of the punch on a relay
circuit (`dtfm/net/punch.py`) are not protected: a relay that lies there can only keep a pair
on itself or make it time out, which it can do by dropping frames anyway.

A frame that fails is `FrameRefused`; its message (`refusal_message`) names the pair and the
path (the relay, or the direct connection), and `refusal` reads it back on the coordinator,
which blames the relay (coordinator/links/relaytrust.py). Pure but for the socket helpers.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import socket
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from dtfm.core.pairkeys import KEY_BYTES
from dtfm.net.dataplane import FrameError, recv_exact, recv_into_exact

MAC, ENCRYPT, OFF = "mac", "encrypt", "off"
MODES = (MAC, ENCRYPT, OFF)
TAG_BYTES = 16
MAX_ENCRYPTED = (1 << 31) - 1  # the most one AES-GCM call takes (`encrypt` frames)
# MACed (and, on a socket, sent or received) a chunk at a time: a chunk is MACed while it
# is still in cache, and the MAC of one overlaps the transfer of the next
_CHUNK = 1 << 20
_PAIR = struct.Struct("!II")
_SEQ = struct.Struct("!Q")
_NONCE = struct.Struct("!IQ")  # a chunk's index, the frame's number
_LAST_CHUNK = 0xFFFF_FFFF  # the index of the frame's final tag


class FrameRefused(ConnectionError):
    """A frame failed its check: altered, replayed, reordered or spliced on the way."""


def overhead(mode: str) -> int:
    """Bytes a frame carries beyond its payload in `mode`: the header's tag and the
    payload's (`Direction`)."""
    return 0 if mode == OFF else 2 * TAG_BYTES


class Direction:
    """One direction (`src` -> `dst`) of a pair's connection: the sender seals its frames,
    the receiver opens them, each counting frames from 0. One thread uses each side.

    A frame's header is checked on its own first (`check_head`), so its length is trusted
    before anything is read or allocated for it: a relay that changes a length is caught
    there, not mistaken for two ends that disagree on a tensor's shape."""

    def __init__(self, mode: str, key: bytes, src: int, dst: int) -> None:
        if mode not in MODES:
            raise ValueError(f"frame protection must be one of {', '.join(MODES)}: got {mode!r}")
        if mode != OFF and len(key) != KEY_BYTES:
            raise ValueError(f"ranks {src} and {dst} have no {KEY_BYTES}-byte pair key "
                             f"({len(key)} bytes) for --frames {mode}: the coordinator and "
                             f"agent disagree on the wire format (run the same dtfm on both)")
        self.mode, self.src, self.dst = mode, src, dst
        self.seq = 0  # the next frame's number
        self._key = hmac.new(key, b"dtfm-frame-v1\0" + mode.encode() + _PAIR.pack(src, dst),
                             hashlib.sha256).digest() if mode != OFF else b""
        self._gcm = AESGCM(self._key) if mode != OFF else None
        self._aead = self._gcm if mode == ENCRYPT else None

    @property
    def overhead(self) -> int:
        return overhead(self.mode)

    def rest(self, length: int) -> int:
        """Bytes of a frame whose header says `length` that follow its header tag
        (`FrameError` where that is too short to hold the payload's tag)."""
        if self.mode == OFF:
            return length
        if length < self.overhead:
            raise FrameError(f"a frame from rank {self.src} claims {length} bytes, fewer than "
                             f"its {self.overhead} bytes of tags: dropped, connection closed")
        return length - TAG_BYTES

    def skip(self) -> None:
        """Count a frame read past unchecked (refused for its length, its header checked)."""
        self.seq += 1

    def head_tag(self, header: bytes) -> bytes:
        """The next frame's header tag: HMAC-SHA256(direction key, label | number | header)
        truncated to 16 bytes (a PRF truncated to 128 bits: a forgery succeeds with
        probability 2^-128 per try, and each failed try ends the connection)."""
        msg = b"head\0" + _SEQ.pack(self.seq) + header
        return hmac.new(self._key, msg, hashlib.sha256).digest()[:TAG_BYTES]

    def check_head(self, header: bytes, tag: bytes) -> None:
        if not hmac.compare_digest(self.head_tag(header), tag):
            raise FrameRefused(f"frame {self.seq}")

    def _nonce(self) -> bytes:
        """The next frame's number as a 12-byte nonce, and count it."""
        seq, self.seq = self.seq, self.seq + 1
        return b"\0" * 4 + _SEQ.pack(seq)

    def _mac(self, header: bytes) -> _ChunkedGmac:
        """The next frame's payload MAC, fed its header so far (and count the frame)."""
        assert self._gcm is not None
        seq, self.seq = self.seq, self.seq + 1
        return _ChunkedGmac(self._gcm, seq, header)

    def _tag(self, header: bytes, payload: memoryview) -> bytes:
        """The next frame's payload MAC (and count it)."""
        mac = self._mac(header)
        for i in range(0, len(payload), _CHUNK):
            mac.update(payload[i:i + _CHUNK])
        return mac.finalize()

    def seal(self, header: bytes, payload: memoryview) -> list[bytes | memoryview]:
        """What follows `header` on the wire for the next frame."""
        if self.mode == OFF:
            return [payload]
        head = self.head_tag(header)
        if self._aead is None:
            return [head, payload, self._tag(header, payload)]
        if len(payload) > MAX_ENCRYPTED:
            raise ValueError(f"a {len(payload)}-byte message is over the {MAX_ENCRYPTED} bytes "
                             f"one AES-GCM call encrypts (--frames encrypt): use --frames mac")
        out = bytearray(len(payload) + TAG_BYTES)
        self._aead.encrypt_into(self._nonce(), payload, header, out)
        return [head, out]

    def open_into(self, header: bytes, sealed: memoryview, out: memoryview) -> None:
        """Check the next frame's `sealed` bytes (its payload, or ciphertext, and tag; its
        header tag checked already) and put the payload in `out` (`len(sealed) - 16`
        bytes; `out` may be `sealed`'s first bytes in `mac` mode); `FrameRefused` when it
        fails."""
        seq, n = self.seq, len(out)
        if self._aead is None:
            if not hmac.compare_digest(self._tag(header, sealed[:n]), sealed[n:]):
                raise FrameRefused(f"frame {seq}")
            if out.obj is not sealed.obj:
                out[:] = sealed[:n]
            return
        try:
            self._aead.decrypt_into(self._nonce(), sealed, header, out)
        except InvalidTag:
            raise FrameRefused(f"frame {seq}") from None

    def receive_head(self, sock: socket.socket, header: bytes) -> None:
        """Read and check the header tag that follows `header` on `sock` (nothing when off)."""
        if self.mode != OFF:
            self.check_head(header, recv_exact(sock, TAG_BYTES))

    def receive_into(self, sock: socket.socket, header: bytes, out: memoryview) -> None:
        """Read the next frame's payload (and tag) from `sock` into `out`, checked."""
        if self.mode == OFF:
            recv_into_exact(sock, out)
            return
        if self._aead is None:  # each chunk MACed as it lands, while the next one arrives
            seq, mac = self.seq, self._mac(header)
            for i in range(0, len(out), _CHUNK):
                recv_into_exact(sock, out[i:i + _CHUNK])
                mac.update(out[i:i + _CHUNK])
            if not hmac.compare_digest(mac.finalize(), recv_exact(sock, TAG_BYTES)):
                raise FrameRefused(f"frame {seq}")
            return
        sealed = memoryview(bytearray(len(out) + TAG_BYTES))
        recv_into_exact(sock, sealed)
        self.open_into(header, sealed, out)

    def open_buffer(self, header: bytes, buf: bytearray) -> bytearray:
        """The payload of the next frame read whole into `buf` (payload and tag), checked."""
        if self.mode == OFF:
            return buf
        n = len(buf) - TAG_BYTES
        out = bytearray(n) if self._aead is not None else buf
        with memoryview(buf) as sealed, memoryview(out) as view:
            self.open_into(header, sealed, view[:n])
        if out is buf:
            del buf[n:]
        return out

    def send(self, sock: socket.socket, header: bytes, payload: memoryview) -> None:
        """Send `header`, then the sealed `payload` (in `mac` mode each chunk MACed just
        before it is sent: the MAC overlaps the transfer and reads bytes still in cache)."""
        if self.mode == MAC and len(payload) <= _CHUNK:  # one write: one segment, one wake-up
            head = self.head_tag(header)
            sock.sendall(b"".join((header, head, payload, self._tag(header, payload))))
            return
        if self.mode == MAC:
            sock.sendall(header + self.head_tag(header))
            mac = self._mac(header)
            for i in range(0, len(payload), _CHUNK):
                mac.update(payload[i:i + _CHUNK])
                sock.sendall(payload[i:i + _CHUNK])
            sock.sendall(mac.finalize())
            return
        parts = self.seal(header, payload)
        sock.sendall(header)
        for part in parts:
            sock.sendall(part)


class _ChunkedGmac:
    """A frame's MAC in `mac` mode, fed its payload a chunk at a time (`_CHUNK` bytes, the
    last one shorter): each chunk's GMAC (AES-256-GCM with it as associated data and nothing
    to encrypt) under the nonce (chunk index, frame number), then the tag = GMAC of the
    header and the chunk tags in order under the nonce (2^32 - 1, frame number). GMAC with a
    nonce used once is a secure MAC (NIST SP 800-38D): a changed chunk changes its tag except
    with probability about 2^-128 per try, and the final tag binds the header, the order and
    the number of chunks. Chunked because a GMAC call takes at most 2^31 - 1 bytes, and so
    the ends MAC each chunk as it crosses the socket; AES-GCM releases the GIL meanwhile."""

    def __init__(self, gcm: AESGCM, seq: int, header: bytes) -> None:
        self._gcm, self._seq, self._parts = gcm, seq, [header]

    def _gmac(self, index: int, data: bytes | memoryview) -> bytearray:
        out = bytearray(TAG_BYTES)
        self._gcm.encrypt_into(_NONCE.pack(index, self._seq), b"", data, out)
        return out

    def update(self, chunk: memoryview) -> None:
        self._parts.append(self._gmac(len(self._parts) - 1, chunk))

    def finalize(self) -> bytes:
        return bytes(self._gmac(_LAST_CHUNK, b"".join(self._parts)))


# The refusal as a worker reports it and the coordinator reads it back (`refusal`).
_REFUSAL = re.compile(r"frame (\d+) from rank (\d+) to rank (\d+) failed its integrity check "
                      r"\((\w+)\): (?:it was altered, replayed or reordered by relay (\S+)|"
                      r"on a direct connection)")


@dataclass(frozen=True)
class Refusal:
    """A refused frame as a worker's error names it: the pair, and the relay ("": direct)."""

    seq: int
    src: int
    dst: int
    mode: str
    relay: str


def refusal_message(r: Refusal) -> str:
    """The words of a refused frame: what, where, and whom it blames."""
    head = (f"frame {r.seq} from rank {r.src} to rank {r.dst} failed its integrity check "
            f"({r.mode}): ")
    if r.relay:
        return head + (f"it was altered, replayed or reordered by relay {r.relay} (only the "
                       f"two ranks hold their pair's key, so neither of them could have "
                       f"produced it); the frame is refused and the pair is re-routed away "
                       f"from that relay")
    return head + (f"on a direct connection: rank {r.src} sent a frame its pair key does not "
                   f"vouch for (a faulty or hostile peer); the frame is refused")


def refusal(error: str) -> Refusal | None:
    """The refused frame a worker's `error` reports, or None when it reports none."""
    m = _REFUSAL.search(error)
    if m is None:
        return None
    return Refusal(int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4),
                   m.group(5) or "")
