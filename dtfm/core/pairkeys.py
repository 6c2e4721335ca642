"""The keys two ranks share to protect their data-plane frames (issue 43, item 5).

The coordinator draws a fresh random master per epoch (`new_master`) and gives each rank,
inside its own assignment only, its row (`keys_for`): the key it shares with each other rank.
key(a, b) = HMAC-SHA256(master, label | min | max), so both ends derive the same key and a
third rank (a relay agent, say) holds none of the pair's. Here, not in dtfm/net/framemac.py
(which uses the keys), because the one place assignments are built (dtfm/core/assignment.py)
hands them out; with them the names of the protection modes. Pure Python.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

from protos.dtfm.v1 import common_pb2

KEY_BYTES = 32
_PAIR = struct.Struct("!II")
# how frames are protected (`coordinator start --frames`, dtfm/net/framemac.py), by name
FRAMES = {"mac": common_pb2.FRAMES_MAC, "encrypt": common_pb2.FRAMES_ENCRYPT,
          "off": common_pb2.FRAMES_OFF}


def frames_name(wire: int) -> str:
    """The name of a `DataPlane.frames` value (ValueError: one this dtfm does not know)."""
    for name, value in FRAMES.items():
        if value == wire:
            return name
    raise ValueError(f"the data plane asks for frame protection {wire}, which this dtfm does "
                     f"not know: run the same dtfm on the coordinator and the agents")


def new_master() -> bytes:
    """A fresh random master for one epoch's pair keys (the coordinator's only, never sent)."""
    return secrets.token_bytes(KEY_BYTES)


def pair_key(master: bytes, a: int, b: int) -> bytes:
    """The key ranks `a` and `b` share (either order)."""
    lo, hi = sorted((a, b))
    return hmac.new(master, b"dtfm-pair-v1\0" + _PAIR.pack(lo, hi), hashlib.sha256).digest()


def keys_for(master: bytes, rank: int, world: int) -> list[bytes]:
    """`rank`'s row: per rank in rank order the key it shares with it (b"" for itself)."""
    return [b"" if r == rank else pair_key(master, rank, r) for r in range(world)]
