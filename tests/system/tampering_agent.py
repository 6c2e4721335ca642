"""`python -m tests.system.tampering_agent start ...`: `agent start` whose relay flips one bit
of the first data frame it forwards (issue 43, item 5): a hostile relay agent. A seam of the
tests, not a product flag: it overrides the one method through which a relay forwards a
frame's bytes (`Relay.outgoing`). Once: after that the coordinator no longer routes through it.
"""

from __future__ import annotations

import logging

from agent.cli import main
from dtfm.net import dataplane as dp
from dtfm.net.relay import Relay

_flipped = [False]


def _flip_once(self: Relay, header: dp.Header, chunk: bytes) -> bytes:
    if _flipped[0] or header.stream == dp.CONTROL_STREAM or not chunk:
        return chunk
    _flipped[0] = True
    logging.getLogger(__name__).warning("tampering relay: flipped a bit of a frame from rank "
                                        "%d to rank %d", header.src, header.dst)
    at = len(chunk) // 2  # in the payload, past the header's tag
    return chunk[:at] + bytes([chunk[at] ^ 0x10]) + chunk[at + 1:]


if __name__ == "__main__":
    Relay.outgoing = _flip_once  # type: ignore[method-assign]
    raise SystemExit(main())
