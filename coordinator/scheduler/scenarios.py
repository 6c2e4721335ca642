"""The paper's five network scenarios (PAPER.md, "Network scenarios") as data.

Each scenario is 64 devices for 8 stages x 8 replicas; `world` can be scaled to more devices
per city for scaling runs. Device order follows the paper's published code (the order a
network-blind placement uses). Pure data plus numpy: no torch, no grpc.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from coordinator.scheduler.network import Network

SCENARIOS = ("dc-ondemand", "dc-spot", "multi-dc", "regional", "world")

# The paper's reproduction inputs: c_DP and c_PP in GB for GPT-3 XL on 8 x 8.
PAPER_DP_GB = 0.65
PAPER_PP_GB = 0.471
PAPER_STAGES = 8
PAPER_REPLICAS = 8

WORLD_CITIES = ("Oregon", "Virginia", "Ohio", "Tokyo", "Seoul", "London", "Frankfurt", "Ireland")
# Upper triangle, row city -> later cities: (delay ms, bandwidth Gbit/s).
_WORLD_LINKS: dict[tuple[str, str], tuple[float, float]] = {
    ("Oregon", "Virginia"): (67, 0.79), ("Oregon", "Ohio"): (49, 1.10),
    ("Oregon", "Tokyo"): (96, 0.523), ("Oregon", "Seoul"): (124, 0.46),
    ("Oregon", "London"): (136, 0.42), ("Oregon", "Frankfurt"): (143, 0.404),
    ("Oregon", "Ireland"): (124, 0.482),
    ("Virginia", "Ohio"): (11, 1.12), ("Virginia", "Tokyo"): (143, 0.524),
    ("Virginia", "Seoul"): (172, 0.50), ("Virginia", "London"): (76, 1.16),
    ("Virginia", "Frankfurt"): (90, 1.02), ("Virginia", "Ireland"): (67, 1.05),
    ("Ohio", "Tokyo"): (130, 0.694), ("Ohio", "Seoul"): (159, 0.529),
    ("Ohio", "London"): (86, 1.05), ("Ohio", "Frankfurt"): (99, 0.799),
    ("Ohio", "Ireland"): (77, 1.14),
    ("Tokyo", "Seoul"): (34, 1.10), ("Tokyo", "London"): (210, 0.366),
    ("Tokyo", "Frankfurt"): (223, 0.36), ("Tokyo", "Ireland"): (199, 0.465),
    ("Seoul", "London"): (238, 0.342), ("Seoul", "Frankfurt"): (235, 0.358),
    ("Seoul", "Ireland"): (228, 0.335),
    ("London", "Frankfurt"): (14, 1.14), ("London", "Ireland"): (12, 1.09),
    ("Frankfurt", "Ireland"): (24, 1.08),
}

REGIONS = ("Virginia", "Oregon", "California", "Ohio")
_REGIONAL_LINKS: dict[tuple[str, str], tuple[float, float]] = {
    ("Virginia", "Oregon"): (67, 1.15), ("Virginia", "California"): (59, 1.05),
    ("Virginia", "Ohio"): (11, 1.12), ("Oregon", "California"): (12, 1.25),
    ("Oregon", "Ohio"): (49, 1.10), ("California", "Ohio"): (52, 1.02),
}
_IN_REGION = (5.0, 2.0)  # 5 ms / 2 Gbit/s inside a region or city


def _sites(
    names: tuple[str, ...],
    per_site: int,
    links: dict[tuple[str, str], tuple[float, float]],
    inside: tuple[float, float],
) -> Network:
    """Devices grouped by site (site i holds devices i*per_site ..), symmetric links."""
    k = len(names)
    d = np.zeros((k, k))
    b = np.zeros((k, k))
    for i in range(k):
        d[i, i], b[i, i] = inside
    for (x, y), (ms, gbps) in links.items():
        i, j = names.index(x), names.index(y)
        d[i, j] = d[j, i] = ms
        b[i, j] = b[j, i] = gbps
    site = np.repeat(np.arange(k), per_site)
    return Network(d[np.ix_(site, site)], b[np.ix_(site, site)])


def _blocks(sizes: list[int], inside: tuple[float, float], outside: tuple[float, float]) -> Network:
    site = np.repeat(np.arange(len(sizes)), sizes)
    same = site[:, None] == site[None, :]
    return Network(np.where(same, inside[0], outside[0]), np.where(same, inside[1], outside[1]))


def dc_ondemand() -> Network:
    """8 machines x 8 GPUs; 0 ms; 100 Gbit/s inside a machine, 3.125 Gbit/s between."""
    return _blocks([8] * 8, (0.0, 100.0), (0.0, 3.125))


def dc_spot() -> Network:
    """8 machines x 4 GPUs (100 Gbit/s inside) plus 32 single-GPU machines; else 1.25 Gbit/s."""
    return _blocks([4] * 8 + [1] * 32, (0.0, 100.0), (0.0, 1.25))


def multi_dc() -> Network:
    """Devices 0-31 Ohio, 32-63 Virginia; 1 ms / 5 Gbit/s inside, 11 ms / 1.12 across."""
    return _blocks([32, 32], (1.0, 5.0), (11.0, 1.12))


def regional() -> Network:
    """16 devices each in Virginia, Oregon, California, Ohio."""
    return _sites(REGIONS, 16, _REGIONAL_LINKS, _IN_REGION)


def world(per_city: int = 8) -> Network:
    """`per_city` devices in each of 8 cities (Oregon first); 8 gives the paper's 64."""
    if per_city < 1:
        raise ValueError(f"per_city must be >= 1, got {per_city}")
    return _sites(WORLD_CITIES, per_city, _WORLD_LINKS, _IN_REGION)


def behind_nat(net: Network, hidden: Sequence[int], relay: int,
               relay_gbps: float = math.inf) -> tuple[Network, np.ndarray]:
    """`net` with the devices in `hidden` behind NATs (nobody can dial them), and the relay
    (the coordinator) sitting beside device `relay`, its uplink carrying at most
    `relay_gbps`. A link with one hidden end is direct (the hidden end dials out); a link
    between two hidden devices goes through the relay: the delay of both hops, the narrower
    hop's rate, as `coordinator/links/relayed.py` prices a measured one. Returns the network
    (relayed links priced for one flow alone) and the mask of relayed links
    (`coordinator/scheduler/relay.py` shares the uplink among a placement's flows)."""
    n = net.size
    if not (0 <= relay < n) or any(not 0 <= h < n for h in hidden):
        raise ValueError(f"devices must be in 0..{n - 1}: relay {relay}, hidden {list(hidden)}")
    if relay_gbps <= 0:
        raise ValueError(f"relay_gbps must be > 0, got {relay_gbps}")
    h = np.zeros(n, dtype=bool)
    h[list(hidden)] = True
    relayed = h[:, None] & h[None, :] & ~np.eye(n, dtype=bool)
    hop_ms = net.delay_ms[:, relay].copy()  # device -> relay; relay -> device taken alike
    hop_gbps = np.minimum(net.bandwidth_gbps[:, relay], relay_gbps)
    hop_gbps[relay] = relay_gbps
    delay = np.where(relayed, hop_ms[:, None] + hop_ms[None, :], net.delay_ms)
    bandwidth = np.where(relayed, np.minimum(hop_gbps[:, None], hop_gbps[None, :]),
                         net.bandwidth_gbps)
    return Network(delay, bandwidth), relayed


def get_scenario(name: str, per_city: int | None = None) -> Network:
    """The scenario called `name`; `per_city` scales `world` only."""
    builders = {
        "dc-ondemand": dc_ondemand,
        "dc-spot": dc_spot,
        "multi-dc": multi_dc,
        "regional": regional,
    }
    if name == "world":
        return world(per_city or 8)
    if name not in builders:
        raise ValueError(f"unknown scenario {name!r}; known scenarios: {', '.join(SCENARIOS)}")
    if per_city not in (None, 8):
        raise ValueError(f"only the world scenario can be scaled, not {name!r}")
    return builders[name]()


def world_links(per_city: int, mbps_per_gbps: float) -> tuple[
        list[list[float]], list[list[float]], list[str]]:
    """The paper's world-wide matrix for `per_city` agents in each of its 8 cities, with
    bandwidth scaled from Gbit/s to `mbps_per_gbps` Mbit/s per Gbit/s (one machine must carry
    every link). Returns one-way delays (ms), bandwidths (Mbit/s) and each agent's city."""
    net = world(per_city=per_city)
    delay = [[0.0 if i == j else float(v) for j, v in enumerate(row)]
             for i, row in enumerate(net.delay_ms)]
    bandwidth = [[0.0 if i == j else float(v) * mbps_per_gbps for j, v in enumerate(row)]
                 for i, row in enumerate(net.bandwidth_gbps)]
    cities = [c for c in WORLD_CITIES for _ in range(per_city)]
    return delay, bandwidth, cities


def nat_agents(cities: list[str], count: int) -> tuple[list[int], list[list[int]]]:
    """Which agents sit behind NAT routers for `--nat count`: (alone behind a NAT of its own,
    groups behind one shared NAT). Spread over the cities, so no one region holds them all;
    where a city has two agents, two of the chosen share one site (one NAT, one LAN), as a lab
    with two boxes would: they reach each other directly, nobody else reaches either."""
    n = len(cities)
    if not 0 <= count <= n:
        raise ValueError(f"--nat {count}: there are {n} agents; give 0 to {n}")
    if count == 0:
        return [], []
    per_city = n // len(dict.fromkeys(cities))
    if count >= 2 and per_city >= 2:
        pair = [0, 1]  # the first city's two agents: one site
        rest = list(range(2, n))
        step = len(rest) / (count - 2) if count > 2 else 0.0
        alone = [rest[int(k * step)] for k in range(count - 2)]
        return alone, [pair]
    step = n / count
    return [int(k * step) for k in range(count)], []
