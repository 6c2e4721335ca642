"""Which codec each link uses: the bytes the cost model counts, and the choice for `auto`.

Over the Internet a step's time is the bytes on its slowest links, so a job may compress
pipeline messages (`--pp-compress`) and data-parallel gradients (`--dp-compress`), see
`dtfm.core.codecs`. A setting is either one codec for every link or `auto`: the scheduler
picks, per pipeline link and per data-parallel group, the codec under which that link moves
its bytes fastest, counting the time to compress and decompress them:

    seconds per uncompressed GB on link (d, d') under codec c
        = 8 * ratio(c) / beta(d, d')  +  codec_s_per_gb   (the second term: lossy codecs only)

where `ratio(c)` is the codec's wire bytes over the uncompressed bytes, and the codec's time
is the quantizers' (`CODEC_S_PER_GB`) times its `relative_cost` (top-k sorts; int4h
rotates). Latency is the same under every codec, so it takes no part in the choice; and
since every term is proportional to the bytes, the choice does not depend on the message
size, only on the link and the device (a GPU compresses ~100x faster than a CPU core). A
lossier codec is taken only when it cuts the link's time per GB by at least `MIN_GAIN` over
the less lossy one chosen so far (`none`, then `int8`, then `int4`, and for data-parallel
groups then `int3`, which only their error feedback makes usable),
so a link gives up precision only for a real saving: fast links (a data centre's, or
loopback under a CPU's slow codec) stay exact. (int3 sends 15 % fewer bytes than int4, short
of `MIN_GAIN`, so under this rule `auto` never takes it: it is there for jobs that ask for
it, `--dp-compress int3`, and for `auto` should the rule change.) A data-parallel group uses
one codec for all its members (its replicas must decode the same averaged gradients), so its
choice compares the group's cost, `max over d of sum over d'` of the per-pair times.

A pipeline link may also ask for int4h (int4's bytes after a block Hadamard rotation): its
rotation and noise cost about twice the quantizers' time (`ROTATE_COST`), which the ladder and
the step model count. `auto` does not take it yet (`dtfm.core.codecs.PP_LOSSINESS` says why);
were it on the ladder in int4's place, a CPU-bound link whose saving plain int4 only just
justified would stay on int8. `coordinator plan` prints the bandwidths below which each rung
pays (`pp_thresholds_gbps`).

`Compression` is the job's setting as the cost model (`costmodel.CostModel`, `plan_cost`) and
the step model (`steptime`) see it; `Compression.choose` gives the codec of every link of one
grid (`dtfm.core.codecs.LinkCodecs`), which the coordinator writes into the assignments and
`coordinator plan` prints. With both settings `none` nothing changes: the paper's costs are
computed exactly as before.

Pure numpy, like the rest of the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from coordinator.scheduler.network import Network
from dtfm.core.codecs import (
    AUTO,
    DP_LOSSINESS,
    NONE,
    PP_LOSSINESS,
    Codec,
    LinkCodecs,
    parse_codec,
)

MIN_GAIN = 0.25  # a lossier codec must cut a link's seconds per GB by at least a quarter
# Compressing plus decompressing one GB of fp32 values, seconds. CPU: measured on one core of
# the development machine (int8 7 + 4 ns, int4 3 + 7 ns per element, 4 bytes each, on a
# loaded machine), rounded up. CUDA: an estimate for a memory-bound kernel chain (~10 bytes
# of traffic per element at ~1.5 TB/s, plus launches); no GPU has measured it yet.
CODEC_S_PER_GB = {"cpu": 3.0, "cuda": 0.02}
TOPK_COST = 1.5  # top-k also sorts each block: about half again the quantizers' time
# int4h also rotates every block both ways and draws noise for the gradients' stochastic
# rounding: 2.0x int4's time, forward and backward together, measured on one CPU core
# (bench/codec_cost.py, docs/benchmarks.md)
ROTATE_COST = 2.0


def relative_cost(codec: Codec) -> float:
    """A codec's compute over the plain quantizers' (int8 / int4), which `codec_s_per_gb`
    quotes."""
    return {"topk": TOPK_COST, "int4h": ROTATE_COST}.get(codec.kind, 1.0)


def codec_seconds_per_gb(kinds: Iterable[str]) -> float:
    """The slowest device's codec time per GB among `kinds` ("cpu", "cuda"; unknown: cpu)."""
    return max((CODEC_S_PER_GB.get(k, CODEC_S_PER_GB["cpu"]) for k in kinds),
               default=CODEC_S_PER_GB["cpu"])


def _options(setting: str, dp: bool, what: str, allowed: bool = True) -> tuple[Codec, ...]:
    """The codecs a setting lets a link use, least lossy first: one, or the ladder of `auto`
    (data-parallel groups go further down it than pipeline links: `DP_LOSSINESS`)."""
    if not allowed or (setting or "none") == "none":
        return (NONE,)
    if setting == AUTO:
        return tuple(Codec(k) for k in (DP_LOSSINESS if dp else PP_LOSSINESS))
    return (parse_codec(setting, topk=dp, what=what),)


@dataclass(frozen=True)
class Compression:
    """A job's compression setting, as the cost and step models use it.

    `pp` / `dp`: `none`, a codec name, or `auto`. `dp_allowed=False` (a ring all-reduce,
    which cannot sum quantized messages) keeps data-parallel traffic exact. `act_raw_bytes`:
    bytes of an uncompressed activation (4, or 2 when training in bf16); gradients are fp32.
    """

    pp: str = "none"
    dp: str = "none"
    codec_s_per_gb: float = CODEC_S_PER_GB["cpu"]
    act_raw_bytes: int = 4
    grad_raw_bytes: int = 4
    dp_allowed: bool = True
    pp_options: tuple[Codec, ...] = field(init=False, repr=False, compare=False)
    dp_options: tuple[Codec, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (np.isfinite(self.codec_s_per_gb) and self.codec_s_per_gb >= 0):
            raise ValueError(f"codec seconds per GB must be >= 0, got {self.codec_s_per_gb}")
        object.__setattr__(self, "pp_options", _options(self.pp, False, "--pp-compress"))
        object.__setattr__(self, "dp_options",
                           _options(self.dp, True, "--dp-compress", self.dp_allowed))

    @classmethod
    def for_job(cls, pp: str, dp: str, *, dtype: str = "fp32", dp_mode: str = "sharded",
                device_kinds: Iterable[str] = ("cpu",)) -> Compression:
        """The setting of a job: its flags, its training dtype and its devices."""
        return cls(pp=pp, dp=dp, codec_s_per_gb=codec_seconds_per_gb(device_kinds),
                   act_raw_bytes=2 if dtype == "bf16" else 4, dp_allowed=dp_mode == "sharded")

    @property
    def active(self) -> bool:
        """Whether any link may be compressed (False: the paper's model, unchanged)."""
        return any(not c.lossless for c in (*self.pp_options, *self.dp_options))

    # -- seconds per uncompressed GB --------------------------------------------------------
    def per_gb(self, codec: Codec, bandwidth_gbps: np.ndarray, raw_bytes: int) -> np.ndarray:
        """Seconds to move one uncompressed GB over each link under `codec`."""
        wire = 8.0 * codec.ratio_to(raw_bytes) / bandwidth_gbps
        if codec.lossless:
            return wire
        return wire + self.codec_s_per_gb * relative_cost(codec)

    @staticmethod
    def ladder(times: Sequence[np.ndarray]) -> np.ndarray:
        """Index of the option each entry takes: the least lossy, unless a lossier one cuts
        the time by `MIN_GAIN` over the choice so far (options least lossy first)."""
        chosen = np.zeros(np.shape(times[0]), dtype=np.int64)
        best = np.asarray(times[0], dtype=float)
        for o in range(1, len(times)):
            better = times[o] <= (1.0 - MIN_GAIN) * best
            chosen = np.where(better, o, chosen)
            best = np.where(better, times[o], best)
        return chosen

    # -- pipeline links ---------------------------------------------------------------------
    def pp_per_gb(self, net: Network) -> tuple[np.ndarray, np.ndarray]:
        """(option index, seconds per uncompressed GB) of every directed link."""
        times = [self.per_gb(c, net.bandwidth_gbps, self.act_raw_bytes)
                 for c in self.pp_options]
        chosen = self.ladder(times)
        return chosen, np.choose(chosen, times)

    def pp_thresholds_gbps(self) -> list[tuple[str, float]]:
        """(codec, link bandwidth in Gbit/s below which `auto` takes it or a lossier one) for
        each lossy pipeline option: the reason `coordinator plan` gives, found by bisection
        on the bandwidth. Below it the link always takes that codec or a lossier one. (The
        ladder compares each rung with the choice so far, so just under the first threshold
        it may jump straight to 4 bits, skipping int8 in a window a few per cent wide: the
        threshold printed for 4 bits is the one below which they hold all the way down.)
        inf: at any bandwidth (free codecs); 0: never."""
        def rungs(gbps: np.ndarray) -> np.ndarray:
            return self.ladder([self.per_gb(c, gbps, self.act_raw_bytes)
                                for c in self.pp_options])

        grid = np.geomspace(1e-9, 1e9, 1801)  # Gbit/s, 2.3 % apart: a modem's to past a NIC's
        chosen = rungs(grid)
        out = []
        for o in range(1, len(self.pp_options)):
            below = np.flatnonzero(chosen < o)  # where the link keeps a less lossy codec
            if below.size == 0 or below[0] == 0:
                out.append((self.pp_options[o].name, float("inf") if below.size == 0 else 0.0))
                continue
            lo, hi = grid[below[0] - 1], grid[below[0]]  # the lowest change, then bisect it
            for _ in range(40):
                mid = (lo * hi) ** 0.5
                lo, hi = (mid, hi) if rungs(np.array([mid]))[0] >= o else (lo, mid)
            out.append((self.pp_options[o].name, float(lo)))
        return out

    def pp_link_cost(self, net: Network, pp_gb: float) -> np.ndarray:
        """The paper's pipeline link cost `alpha + 8 S / beta`, for compressed bytes."""
        return net.delay_ms / 1000.0 + pp_gb * self.pp_per_gb(net)[1]

    # -- data-parallel groups ---------------------------------------------------------------
    def dp_matrices(self, net: Network, dp_gb: float,
                    replicas: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per option (bandwidth part, whole cost) of every pair's share of the paper's
        sharded all-reduce: `2 (alpha + c_DP / R * seconds per GB)`, zero on the diagonal."""
        out = []
        alpha = net.delay_ms / 1000.0
        for c in self.dp_options:
            band = 2.0 * dp_gb / replicas * self.per_gb(c, net.bandwidth_gbps,
                                                        self.grad_raw_bytes)
            full = 2.0 * alpha + band
            np.fill_diagonal(band, 0.0)
            np.fill_diagonal(full, 0.0)
            out.append((band, full))
        return out

    def dp_group_costs(self, matrices: Sequence[tuple[np.ndarray, np.ndarray]],
                       groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(cost, option index) of every group (row of `groups`): one codec per group."""
        g = np.asarray(groups)
        band = [m[0][g[:, :, None], g[:, None, :]].sum(axis=2).max(axis=1) for m in matrices]
        full = [m[1][g[:, :, None], g[:, None, :]].sum(axis=2).max(axis=1) for m in matrices]
        chosen = self.ladder(band)
        return np.choose(chosen, full), chosen

    # -- one grid ---------------------------------------------------------------------------
    def choose(self, net: Network, grid: Sequence[Sequence[int]]) -> LinkCodecs:
        """The codec of every pipeline link and data-parallel group of `grid`."""
        g = np.asarray(grid, dtype=np.int64)
        s = g.shape[0]
        chosen, _ = self.pp_per_gb(net)
        pp = [[self.pp_options[int(chosen[g[j, k], g[j + 1, k]])].name
               for k in range(g.shape[1])] for j in range(s - 1)]
        if g.shape[1] > 1:
            _, dp_idx = self.dp_group_costs(self.dp_matrices(net, 1.0, g.shape[1]), g)
            dp = [self.dp_options[int(i)].name for i in dp_idx]
        else:
            dp = ["none"] * s
        return LinkCodecs(pp=pp, dp=dp)
