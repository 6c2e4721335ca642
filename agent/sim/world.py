"""A world of sites for simulated agents: where each agent is, and its links to every other.

Drawn from a seed the coordinator is never told, so whatever the coordinator finds about the
world it found by measuring. Agents sit at sites (a data centre, a city, a campus) scattered
over a continent-sized plane; a link's one-way delay is the distance at two thirds of light
speed plus a few ms of routing (a fraction of a ms inside one site), and its bandwidth the
smaller uplink of its two ends' sites (inside a site: the site's LAN), slower the farther it
goes, as long-haul TCP is. Devices differ too: each agent gets a FLOP/s figure drawn per site.

Pure data and arithmetic: no asyncio, no grpc (the bench prices plans on it directly).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

KM_PER_MS = 200.0  # light in fibre: about two thirds of c
ROUTING_MS = 2.0  # switching and detours between sites
LAN_MS = 0.2  # one way inside a site
LAN_GBPS = 10.0
UPLINK_GBPS = (0.1, 0.5, 1.0, 2.5, 10.0)  # what a site's uplink may be
PLANE_KM = (9000.0, 4500.0)  # a continent, more or less
FLOPS = (2e12, 8e12, 20e12)  # a site's devices: a slow CPU box to a small GPU, FLOP/s
MEMORY_BYTES = 16 << 30


@dataclass(frozen=True)
class Site:
    x_km: float
    y_km: float
    uplink_gbps: float
    flops: float


@dataclass(frozen=True)
class World:
    sites: tuple[Site, ...]
    site_of: tuple[int, ...]  # per agent index

    @classmethod
    def draw(cls, seed: int, agents: int, sites: int = 0) -> World:
        """`agents` agents over `sites` sites (0: about the square root of `agents` over two,
        at least 3), unevenly: some sites hold many agents, some few."""
        rng = random.Random(seed)
        count = sites or max(3, round(math.sqrt(agents) / 2))
        drawn = tuple(Site(rng.uniform(0, PLANE_KM[0]), rng.uniform(0, PLANE_KM[1]),
                           rng.choice(UPLINK_GBPS), rng.choice(FLOPS)) for _ in range(count))
        weights = [rng.uniform(0.2, 1.0) for _ in range(count)]
        site_of = tuple(rng.choices(range(count), weights)[0] for _ in range(agents))
        return cls(drawn, site_of)

    def __len__(self) -> int:
        return len(self.site_of)

    def delay_ms(self, a: int, b: int) -> float:
        """One-way delay from agent a to agent b."""
        sa, sb = self.sites[self.site_of[a]], self.sites[self.site_of[b]]
        if sa is sb:
            return LAN_MS
        return ROUTING_MS + math.hypot(sa.x_km - sb.x_km, sa.y_km - sb.y_km) / KM_PER_MS

    def bandwidth_gbps(self, a: int, b: int) -> float:
        """Goodput of one bulk flow from a to b: the smaller uplink, less on long paths."""
        sa, sb = self.sites[self.site_of[a]], self.sites[self.site_of[b]]
        if sa is sb:
            return LAN_GBPS
        return min(sa.uplink_gbps, sb.uplink_gbps) / (1.0 + self.delay_ms(a, b) / 50.0)

    def flops(self, a: int) -> float:
        return self.sites[self.site_of[a]].flops

    def matrices(self, order: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The true (delay ms, bandwidth Gbit/s) matrices of agents `order`, in that order
        (the diagonal: 0 delay, LAN bandwidth)."""
        n = len(order)
        delay, bandwidth = np.zeros((n, n)), np.full((n, n), LAN_GBPS)
        for i, a in enumerate(order):
            for j, b in enumerate(order):
                if i != j:
                    delay[i, j], bandwidth[i, j] = self.delay_ms(a, b), self.bandwidth_gbps(a, b)
        return delay, bandwidth
