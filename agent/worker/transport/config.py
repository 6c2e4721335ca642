"""What the data-plane transport needs to know, from the assignment, not from a store.

The peer table says which rank listens where (None: it cannot accept, it only dials), for
whom (a `limited` rank only for the dialers `direct` names: its own site's LAN, say) and
which relay two ranks meet at where neither may dial the other; with it no rank ever needs
an inbound connection it cannot take, and rendezvous needs no TCPStore on rank 0 (rank 0 may
be behind a NAT too). It comes as `pg_options` of `init_process_group`, or from the environment
(`DTFM_TRANSPORT`: JSON, the secret read from `secret_file`, never put in the JSON).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import timedelta

from dtfm.net.dataplane import may_dial, parse_addr
from dtfm.net.framemac import MODES, OFF

ENV = "DTFM_TRANSPORT"


@dataclass
class TransportConfig:
    """One rank's view of the job's data plane."""

    job: str
    epoch: int
    secret: bytes = field(repr=False)
    peers: dict[int, str | None]  # rank -> "host:port" it listens on, None: dials only
    relay: str | None = None  # "host:port" of the relay for pairs where neither listens
    # (low rank, high rank) -> "host:port" of the relay that pair meets at instead of `relay`
    # (a relay agent the coordinator chose for it by measured links)
    pair_relays: dict[tuple[int, int], str] = field(default_factory=dict)
    # ranks that listen for some peers only (reachable from one site's LAN, say): only the
    # (dialer, listener) pairs in `direct` may dial them; every other pair with one of them
    # is taken as if it did not listen
    limited: frozenset[int] = frozenset()
    direct: frozenset[tuple[int, int]] = frozenset()
    bind: str | None = None  # listen here instead of this rank's advertised address
    # take accepted connections from the agent's handoff (its abstract Unix socket name:
    # dtfm/net/handoff.py) instead of listening: the agent serves them on its one port
    handoff: str | None = None
    mailbox_bytes: int = 64 << 20  # unclaimed bytes buffered per peer before reading stops
    timeout: timedelta = timedelta(seconds=300)
    hole_punch: bool = False  # pairs at a relay try a direct connection first (punch.py)
    # how each frame is protected (dtfm/net/framemac.py): "mac", "encrypt" or "off", and
    # per peer rank the key this rank shares with it (the assignment's `pair_keys`; a relay
    # never holds it). The assignment's data plane turns "mac" on by default
    # (agent/worker/world.py); a config made by hand (tests, benchmarks) has it off
    frames: str = OFF
    pair_keys: dict[int, bytes] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.frames not in MODES:
            raise ValueError(f"frames must be one of {', '.join(MODES)}: got {self.frames!r}")
        for rank, addr in self.peers.items():
            if addr is not None:
                parse_addr(addr)  # a bad address fails here, naming it
            if rank < 0:
                raise ValueError(f"peer table names rank {rank}: ranks are >= 0")
        if self.relay is not None:
            parse_addr(self.relay)
        for (a, b), addr in self.pair_relays.items():
            if not 0 <= a < b:
                raise ValueError(f"pair_relays names pair ({a}, {b}): give (low rank, "
                                 f"high rank), both >= 0")
            parse_addr(addr)
        for dialer, listener in self.direct:
            if listener not in self.limited or self.peers.get(listener) is None \
                    or dialer not in self.peers or dialer == listener:
                raise ValueError(f"direct names rank {dialer} dialling rank {listener}: the "
                                 f"listener must be a limited rank with a listen address and "
                                 f"the dialer another rank of the peer table")

    def can_dial(self, a: int, b: int) -> bool:
        """Whether rank `a` may dial rank `b`: `b` listens, for everyone or (limited) for
        `a` among others."""
        listening = {r for r, addr in self.peers.items() if addr is not None}
        return may_dial(a, b, listening, self.limited, self.direct)

    def relay_for(self, me: int, peer: int) -> str | None:
        """The relay `me` and `peer` meet at: the pair's own, else the default."""
        return self.pair_relays.get((min(me, peer), max(me, peer)), self.relay)

    def mode(self, me: int, peer: int) -> str:
        """'dial', 'accept' or 'relay': how `me` reaches `peer`. Both ends agree, as the
        rule is symmetric: where only one end may dial the other it dials, where both may
        the higher rank dials, where neither may they meet at the pair's relay."""
        i_dial, they_dial = self.can_dial(me, peer), self.can_dial(peer, me)
        if i_dial and (not they_dial or me > peer):
            return "dial"
        if they_dial:
            return "accept"
        if self.relay_for(me, peer) is None:
            raise ValueError(f"ranks {me} and {peer} both only dial out and the peer table "
                             f"names no relay: give one (TransportConfig.relay)")
        return "relay"

    @staticmethod
    def from_env(environ: dict[str, str] | None = None) -> TransportConfig:
        env = os.environ if environ is None else environ
        raw = env.get(ENV)
        if not raw:
            raise ValueError(f"the dtfm backend needs its peer table: pass pg_options="
                             f"TransportConfig(...) to init_process_group or set {ENV}")
        try:
            d = json.loads(raw)
            with open(d["secret_file"], "rb") as f:
                secret = f.read().strip()
            return TransportConfig(
                job=str(d["job"]), epoch=int(d["epoch"]), secret=secret,
                peers={int(k): v for k, v in d["peers"].items()}, relay=d.get("relay"),
                pair_relays={_pair(k): v for k, v in d.get("pair_relays", {}).items()},
                limited=frozenset(int(r) for r in d.get("limited", [])),
                direct=frozenset(_pair(k) for k in d.get("direct", [])),
                bind=d.get("bind"), handoff=d.get("handoff"),
                timeout=timedelta(seconds=float(d.get("timeout_s", 300))),
                hole_punch=bool(d.get("hole_punch", False)),
            )
        except (KeyError, ValueError, OSError) as exc:
            raise ValueError(f"{ENV} is not a usable peer table ({exc!r}): it needs job, "
                             f"epoch, peers {{rank: 'host:port' or null}}, secret_file") from exc

    def to_env(self, secret_file: str) -> str:
        """The JSON for `ENV` (the secret stays in `secret_file`)."""
        return json.dumps({"job": self.job, "epoch": self.epoch, "secret_file": secret_file,
                           "peers": {str(k): v for k, v in self.peers.items()},
                           "relay": self.relay, "bind": self.bind, "handoff": self.handoff,
                           "pair_relays": {f"{a},{b}": v
                                           for (a, b), v in self.pair_relays.items()},
                           "limited": sorted(self.limited),
                           "direct": [f"{a},{b}" for a, b in sorted(self.direct)],
                           "timeout_s": self.timeout.total_seconds(),
                           "hole_punch": self.hole_punch})


def _pair(key: str) -> tuple[int, int]:
    """"A,B" (a pair_relays key, or a direct dial, in the JSON) as a pair of ranks."""
    a, _, b = key.partition(",")
    return int(a), int(b)
