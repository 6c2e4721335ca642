"""Predicted step time of one placement: the runtime's schedule, replayed on the link matrix.

The paper's objective (`costmodel`) ranks placements by `DP-COST + 2 * PP-COST`: each
pipeline link pays its latency once and carries a replica's whole batch in one message, and
nothing overlaps. That ranks placements well, but it is not a step time: the runtime sends one
message per micro-batch (so latency is paid per micro-batch and the links of a pipeline work
at the same time), the pipeline fills and drains, devices compute, and the step ends with a
gradient-norm exchange inside each pipeline. This module replays exactly that, so the
coordinator can show a predicted step time beside the measured one and a benchmark can check
the two against each other:

- every stage runs `dtfm.core.layout.pipeline_ops` (GPipe or 1F1B), one device at a time;
- a micro-batch's activations (and later its gradient) cross a pipeline link as one message:
  serialized on that directed link at its bandwidth, then the link's one-way delay (the
  worker posts every receive of a step when the step starts, so no message waits a further
  delay for gloo's ready notice);
- forward takes a third and backward two thirds of a device's per-micro-batch compute
  (full fine-tuning); under LoRA the frozen base needs no weight gradients and forward takes
  about half (`StepShape.forward_share`, from `flops.stage_flops_by_pass`);
- after its last backward pass, a stage's data-parallel group averages gradients as the
  worker does: `sharded` as direct messages (each shard to its owner, the average straight
  back: two hops), `allreduce` as gloo's ring (2(R-1) steps at the ring's slowest link);
- each rank then sends its stage's squared gradient norm to every rank of its pipeline, and
  the step ends when the last of them has arrived;
- with compression (`StepShape.compression`), every pipeline link and data-parallel group
  sends its codec's wire bytes (`compression.Compression.choose` for this grid) and pays
  its compression time on the way;
- with local steps (`StepShape.sync_every` H > 1, `agent/worker/outer.py`) the replicas
  exchange nothing for H - 1 steps; the H-th step, after its optimizer step, averages the
  pseudo-gradients (the same bytes and exchange as a gradient average, not hidden behind
  backward). The step is priced as its average over the round: the step without data-parallel
  traffic plus 1/H of the slowest group's exchange, so the polish and the placement weigh the
  pipelines more the larger H is; with the outer step one round late (`StepShape.outer_delay`)
  the exchange runs through the next round and only what outlasts it counts
  (`exposed_exchange_s`);
- with replica checks (`StepShape.verify_s`, from `--verify`: `dtfm.core.verify`), each stage's
  data-parallel group pays its checks after averaging: the owner's scoring of the copies it
  holds (a few passes over the stage's gradient bytes at `SCORE_GBPS`) and, amortized over
  `DIGEST_EVERY` steps, the weights digest (one pass over the stage's weights at
  `DIGEST_GBPS`, a host copy included). Their bytes (R float64 per digest) are not priced.

Pure numpy, like the rest of the scheduler.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from coordinator.scheduler.compression import Compression, relative_cost
from coordinator.scheduler.dpshares import group_links, group_shares
from coordinator.scheduler.flops import FULL_FORWARD_SHARE, stage_flops_by_pass
from coordinator.scheduler.network import Network
from dtfm.core.breakdown import Breakdown
from dtfm.core.buckets import dp_bucket_count
from dtfm.core.codecs import NONE, Codec, parse_codec
from dtfm.core.layout import delayed_run_ops, layer_ranges, pipeline_ops
from dtfm.core.lora import trained_params
from dtfm.core.spec import DTYPE_BYTES, ModelSpec, check_batch
from dtfm.core.verify import DIGEST_EVERY, Verify, resolve, scores

# Replica checks' throughput, bytes per second (bench/integrity.py, one CPU thread, gpt-mini:
# scoring 5.1 MB of copies in 1.7 ms; the digest 5.1 MB in 20-80 ms on a loaded machine)
SCORE_GBPS = 3.0
DIGEST_GBPS = 0.25


@dataclass(frozen=True)
class StepTime:
    """A predicted step and where its time goes (seconds)."""

    step_s: float
    pipeline_s: float  # until the last backward pass of any device ends
    dp_s: float  # the slowest data-parallel group's all-reduce (local steps: 1/H of it)
    sync_s: float  # the norm exchange after data-parallel sync
    compute_s: float  # the busiest device's compute in one step
    sync_every: int = 1  # H: the data-parallel exchange runs once every H steps
    hidden_s: float = 0.0  # of each exchange: what the next round hides (--outer-delay 1)

    @property
    def dp_exchange_s(self) -> float:
        """One data-parallel exchange, which runs once every `sync_every` steps."""
        return self.dp_s * self.sync_every + self.hidden_s


def exposed_exchange_s(exchange_s: float, inner_s: float, every: int, delay: int) -> float:
    """What of one exchange of pseudo-gradients a round waits for: all of it at a sync point
    that waits (`delay` 0); with the outer step one round late, only what outlasts the next
    round's H - 1 inner steps (the worker polls between inner steps, so the averages' hop back
    starts at the first step's end at the earliest: `agent/worker/outer.py`)."""
    if not delay:
        return exchange_s
    return max(0.0, exchange_s - (every - 1) * inner_s)


@dataclass(frozen=True)
class StepShape:
    """What one step moves and runs: the job's sizes, not the paper's whole-batch messages."""

    micro_batches: int
    act_bytes: float  # one micro-batch's activations (and gradient) on a pipeline link
    grad_bytes: Sequence[float]  # per stage: its gradient message
    schedule: str = "gpipe"
    dp_mode: str = "sharded"
    compression: Compression | None = None  # None: every message as it is
    act_raw_bytes: int = 4  # bytes of one uncompressed activation (2 under bf16)
    sync_every: int = 1  # local steps: replicas exchange once every this many steps
    outer_delay: int = 0  # 1: local steps' exchange overlaps the next round (outer.py)
    # steps between pipeline flushes (--pipeline-delay 1: H, or `FLUSH_FREE_RUN` without
    # local steps; 1: every step flushes)
    flush_every: int = 1
    # per stage: forward's part of its compute (empty: 1/3 everywhere, full fine-tuning)
    forward_share: tuple[float, ...] = ()
    # per stage: seconds of replica checks per step (`verify_seconds`; empty: --verify off)
    verify_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every}")
        if self.flush_every < 1 or (self.flush_every > 1 and self.schedule != "1f1b"):
            raise ValueError(f"flush_every must be >= 1, and > 1 only under 1f1b, got "
                             f"{self.flush_every} under {self.schedule}")
        if not (self.act_bytes >= 0 and all(b >= 0 for b in self.grad_bytes)):
            raise ValueError("message sizes must be >= 0 bytes")
        if not all(0 < f < 1 for f in self.forward_share):
            raise ValueError(f"forward shares must be in (0, 1), got {self.forward_share}")

    def forward_of(self, stage: int) -> float:
        """Forward's part of `stage`'s compute."""
        return self.forward_share[stage] if self.forward_share else FULL_FORWARD_SHARE


def _send_s(net: Network, src: int, dst: int, nbytes: float) -> float:
    return 8.0 * nbytes / (net.bandwidth_gbps[src, dst] * 1e9)


def _codec_s(shape: StepShape, codec: Codec, raw_bytes: float, raw_size: int) -> float:
    """Seconds to compress and decompress a message of `raw_bytes` uncompressed bytes."""
    if codec.lossless or shape.compression is None:
        return 0.0
    fp32_gb = raw_bytes / raw_size * 4 / 1e9  # the codec's cost is quoted per GB of fp32
    return fp32_gb * shape.compression.codec_s_per_gb * relative_cost(codec)


def _act_message(shape: StepShape, codec: Codec) -> tuple[float, float]:
    """(wire bytes, codec seconds) of one micro-batch's activations (or gradient)."""
    raw = shape.act_raw_bytes
    wire = codec.wire_bytes(round(shape.act_bytes / raw), raw)
    return float(wire), _codec_s(shape, codec, shape.act_bytes, raw)


def _pipeline(net: Network, devices: Sequence[int], shape: StepShape,
              compute: Sequence[float], codecs: Sequence[Codec] | None = None) -> list[float]:
    """End of each stage's last op in one pipeline (device order = stage order); `codecs[j]`
    compresses the link from stage j to j+1 (both directions). With `shape.flush_every` > 1:
    of that many steps that do not flush between them (`--pipeline-delay 1`)."""
    s, m = len(devices), shape.micro_batches
    msgs = [_act_message(shape, c) for c in (codecs or [NONE] * (s - 1))]
    n = shape.flush_every
    ops = [delayed_run_ops(j, s, m, n) if n > 1 else pipeline_ops(shape.schedule, j, s, m)
           for j in range(s)]
    forward = [shape.forward_of(j) for j in range(s)]
    arrive_f: list[dict[int, float]] = [{} for _ in range(s)]
    arrive_b: list[dict[int, float]] = [{} for _ in range(s)]
    link_f, link_b = [0.0] * s, [0.0] * s  # when link j->j+1 (fwd) / j+1->j (bwd) is free
    free, ptr = [0.0] * s, [0] * s
    while any(ptr[j] < len(ops[j]) for j in range(s)):
        moved = False
        for j in range(s):
            while ptr[j] < len(ops[j]):
                kind, i = ops[j][ptr[j]]
                first, last = j == 0, j == s - 1
                dep = (0.0 if first else arrive_f[j].get(i)) if kind == "F" else (
                    0.0 if last else arrive_b[j].get(i))
                if dep is None:
                    break
                share = forward[j] if kind == "F" else 1.0 - forward[j]
                end = max(free[j], dep) + compute[j] * share
                free[j] = end
                ptr[j] += 1
                moved = True
                if kind == "F" and not last:
                    a, b = devices[j], devices[j + 1]
                    wire, codec_s = msgs[j]
                    done = max(end, link_f[j]) + _send_s(net, a, b, wire) + codec_s
                    link_f[j] = done
                    arrive_f[j + 1][i] = done + net.delay_ms[a, b] / 1000.0
                elif kind == "B" and not first:
                    a, b = devices[j], devices[j - 1]
                    wire, codec_s = msgs[j - 1]
                    done = max(end, link_b[j - 1]) + _send_s(net, a, b, wire) + codec_s
                    link_b[j - 1] = done
                    arrive_b[j - 1][i] = done + net.delay_ms[a, b] / 1000.0
        if not moved:  # cannot happen with the schedules above; be loud if it ever does
            raise RuntimeError(f"schedule {shape.schedule!r} deadlocks in the step model")
    return free


def _dp_seconds(net: Network, group: Sequence[int], grad_bytes: float, mode: str,
                codec: Codec = NONE, codec_s: float = 0.0,
                shares: Sequence[float] | None = None) -> float:
    """The group's gradient averaging as the worker does it.

    `sharded`: the stage's gradients travel in `buckets.dp_bucket_count` buckets; replica k
    owns `dpshares.group_shares` of each. Every replica sends its copy of shard k of each
    bucket straight to k as backward fills the bucket; k sums the copies and sends the
    average straight back to everyone. Each directed link sends its messages in the order
    they were posted (every first-hop copy, then the averages as each bucket completes), so
    the second hop of one bucket overlaps the first of the next; an empty shard sends
    nothing. `allreduce`: gloo's ring, 2(R-1) steps of 1/R of the gradients around the group
    in rank order, each as slow as the ring's slowest link. Compressed (`sharded` only), a
    shard travels as `codec`'s wire bytes and costs its part of `codec_s` (the whole
    buffer's compression time) on the way. `shares`: other shares than `group_shares`'
    (to compare them)."""
    r = len(group)
    if r == 1:
        return 0.0
    delay, per_byte = group_links(net, group)
    wire = grad_bytes * codec.ratio_to(4)
    if mode == "allreduce":
        hop = delay + wire / r * per_byte + codec_s / r
        return 2 * (r - 1) * float(max(hop[k, (k + 1) % r] for k in range(r)))
    shares = np.asarray(group_shares(net, group, wire) if shares is None else shares)
    buckets = dp_bucket_count(grad_bytes)
    owns = shares > 0
    # seconds a message of shard k of one bucket holds the link it goes out on
    copy = (wire / buckets) * shares[None, :] * per_byte + codec_s / buckets * shares[None, :]
    average = (wire / buckets) * shares[:, None] * per_byte + codec_s / buckets * shares[:, None]
    np.fill_diagonal(delay, -np.inf)  # nothing arrives from oneself: out of every max
    busy = np.zeros((r, r))  # when directed link i -> k has sent everything posted so far
    arrivals = []
    for _ in range(buckets):  # every replica's copies, as backward fills the buckets
        busy = busy + copy
        arrivals.append((busy + delay).max(axis=0))
    end = 0.0
    for ready in arrivals:  # owner k sends bucket b's average once its copies are all in
        sends = np.maximum(busy, ready[:, None]) + average
        busy = np.where(owns[:, None], sends, busy)
        end = max(end, float((busy + delay)[owns].max()))
    return end


def _grid_and_compute(grid: Sequence[Sequence[int]], shape: StepShape,
                      compute_s: Sequence[Sequence[float]] | None) -> tuple[np.ndarray,
                                                                             np.ndarray]:
    g = np.asarray(grid, dtype=np.int64)
    if g.ndim != 2 or g.size == 0:
        raise ValueError("a grid must be a non-empty list of equally long rows")
    s, r = g.shape
    if len(shape.grad_bytes) != s:
        raise ValueError(f"{len(shape.grad_bytes)} gradient sizes for {s} stages")
    comp = np.zeros((s, r)) if compute_s is None else np.asarray(compute_s, dtype=float)
    if comp.shape != (s, r) or not (np.isfinite(comp).all() and (comp >= 0).all()):
        raise ValueError(f"compute_s must be a {s}x{r} grid of seconds >= 0")
    return g, comp


def simulate_step(net: Network, grid: Sequence[Sequence[int]], shape: StepShape,
                  compute_s: Sequence[Sequence[float]] | None = None,
                  memo: dict[tuple[object, ...], object] | None = None) -> StepTime:
    """Predicted step of `grid` (grid[stage][replica] -> device) on `net`.

    `compute_s[stage][replica]`: seconds of forward + backward compute of one micro-batch on
    that tasklet's device (None: communication only). `memo`: a dict kept across calls for
    the same `net` and `shape` (a search's), remembering each pipeline's and each
    data-parallel group's time, since a swap changes at most two of each.
    """
    g, comp = _grid_and_compute(grid, shape, compute_s)
    return _simulate(net, net, g, shape, comp, _codecs(net, g, shape),
                     {} if memo is None else memo)


def step_breakdown(net: Network, grid: Sequence[Sequence[int]], shape: StepShape,
                   compute_s: Sequence[Sequence[float]] | None = None) -> Breakdown:
    """`simulate_step`'s prediction split as `dtfm.core.breakdown` splits a measured step,
    each part the step time it costs, taken away in turn with the codecs this grid gets on
    `net` held fixed: `codec` is what compressing costs (the step with free codecs), then
    `transfer` what the pipeline links' bandwidth costs (every pipeline link unbounded, its
    delay kept), then `sync_wait` what the data-parallel exchange costs (none at all);
    `compute` is the mean tasklet's compute in a step, and `latency_bubble` the rest: delays,
    the pipeline filling and draining (idle devices) and the norm exchange. The parts add up
    to the predicted step; `other` is 0 (nothing else is priced)."""
    g, comp = _grid_and_compute(grid, shape, compute_s)
    codecs = _codecs(net, g, shape)
    free = shape if shape.compression is None else replace(
        shape, compression=replace(shape.compression, codec_s_per_gb=0.0))
    wide = Network(net.delay_ms, np.full_like(net.bandwidth_gbps, UNBOUNDED_GBPS))
    full = _simulate(net, net, g, shape, comp, codecs, {}).step_s
    no_codec = _simulate(net, net, g, free, comp, codecs, {}).step_s
    no_transfer = _simulate(wide, net, g, free, comp, codecs, {}).step_s
    no_sync = _simulate(wide, net, g, free, comp, codecs, {}, dp_free=True).step_s
    compute = float(comp.mean()) * shape.micro_batches
    return Breakdown(step_s=full, compute=compute, codec=full - no_codec,
                     transfer=no_codec - no_transfer, sync_wait=no_transfer - no_sync,
                     latency_bubble=no_sync - compute)


UNBOUNDED_GBPS = 1e12  # a link whose bytes take no time: `step_breakdown`'s "no transfer"


def _simulate(pp_net: Network, dp_net: Network, g: np.ndarray, shape: StepShape,
              comp: np.ndarray, codecs: tuple[list[list[Codec]], list[Codec]],
              memo: dict[tuple[object, ...], object], dp_free: bool = False) -> StepTime:
    """`simulate_step` with the pipelines on `pp_net`, the data-parallel groups on `dp_net`
    (`dp_free`: none at all) and the codecs given."""
    s, r = g.shape
    pp_codecs, dp_codecs = codecs

    def pipeline(k: int) -> list[float]:
        devices, work, codecs = g[:, k].tolist(), comp[:, k].tolist(), [row[k] for row in pp_codecs]
        key = ("pp", *devices, *work, *codecs)
        if key not in memo:
            memo[key] = _pipeline(pp_net, devices, shape, work, codecs)
        return memo[key]  # type: ignore[return-value]

    def dp_group(j: int) -> float:
        if dp_free:
            return 0.0
        key = ("dp", j, *g[j].tolist(), dp_codecs[j])
        if key not in memo:
            memo[key] = _dp_seconds(dp_net, g[j].tolist(), shape.grad_bytes[j], shape.dp_mode,
                                    dp_codecs[j],
                                    _codec_s(shape, dp_codecs[j], shape.grad_bytes[j], 4))
        return memo[key]  # type: ignore[return-value]

    net = dp_net  # the norm exchange's delays: the same on both
    # (stage, replica); without flushes between steps, of `runs` steps, then taken per step
    last_b = np.array([pipeline(k) for k in range(r)]).T
    runs = shape.flush_every
    dp = np.array([dp_group(j) for j in range(s)])
    if shape.verify_s and r > 1:
        dp = dp + np.asarray(shape.verify_s)
    if shape.sync_every > 1:  # the step without data-parallel traffic, plus 1/H of it
        inner = _finish(g, last_b, np.zeros(s), net) / runs
        exchange = float(dp.max())
        waited = exposed_exchange_s(exchange, inner, shape.sync_every, shape.outer_delay)
        return StepTime(step_s=inner + waited / shape.sync_every,
                        pipeline_s=float(last_b.max()) / runs, dp_s=waited / shape.sync_every,
                        sync_s=inner - float(last_b.max()) / runs,
                        compute_s=float(comp.max() * shape.micro_batches),
                        sync_every=shape.sync_every, hidden_s=exchange - waited)
    finish = _finish(g, last_b, dp, net) / runs  # runs > 1 here: one replica, nothing in dp
    dp_end = last_b.max(axis=1) / runs + dp
    return StepTime(step_s=float(finish), pipeline_s=float(last_b.max()) / runs,
                    dp_s=float(dp.max()), sync_s=float(finish - dp_end.max()),
                    compute_s=float(comp.max() * shape.micro_batches))


def _finish(g: np.ndarray, last_b: np.ndarray, dp: np.ndarray, net: Network) -> float:
    """When the step ends: each stage's data-parallel averaging after its last backward pass
    (`dp`, per stage), then every rank's norm reaching every rank of its pipeline."""
    s, r = g.shape
    dp_end = last_b.max(axis=1) + dp
    delay = net.delay_ms / 1000.0
    finish = dp_end.max()
    if s > 1:
        for k in range(r):
            col = g[:, k]
            arrive = dp_end[:, None] + delay[col[:, None], col[None, :]]
            np.fill_diagonal(arrive, 0.0)
            finish = max(finish, float(np.maximum(arrive.max(axis=0), dp_end).max()))
    return float(finish)


def dp_shares(net: Network, grid: Sequence[Sequence[int]], shape: StepShape) -> list[list[float]]:
    """Per stage, each replica's share of the sharded gradient exchange
    (`dpshares.group_shares` over the stage's wire bytes): what the coordinator sends in the
    assignments and what `simulate_step` replays."""
    g = np.asarray(grid, dtype=np.int64)
    _, dp_codecs = _codecs(net, g, shape)
    return [group_shares(net, g[j].tolist(), shape.grad_bytes[j] * dp_codecs[j].ratio_to(4))
            for j in range(g.shape[0])]


def _codecs(net: Network, g: np.ndarray,
            shape: StepShape) -> tuple[list[list[Codec]], list[Codec]]:
    """The codec of every pipeline link (`[j][k]`: stage j -> j+1 of pipeline k) and of every
    stage's data-parallel group, as the coordinator would assign them for this grid."""
    s, r = g.shape
    if shape.compression is None or not shape.compression.active:
        return [[NONE] * r for _ in range(s - 1)], [NONE] * s
    chosen = shape.compression.choose(net, g.tolist())
    return ([[parse_codec(n) for n in row] for row in chosen.pp],
            [parse_codec(n) for n in chosen.dp])


def step_shape(spec: ModelSpec, stages: int, replicas: int, global_batch: int,
               micro_batches: int, schedule: str = "gpipe", act_dtype: str = "fp32",
               splits: Sequence[int] | None = None, dp_mode: str = "sharded",
               compression: Compression | None = None, sync_every: int = 1,
               lora_rank: int = 0, lora_targets: str = "", verify: str = "off",
               outer_delay: int = 0, pipeline_delay: int = 0) -> StepShape:
    """The messages of one step of `spec` as the runtime sends them (fp32 gradients: of the
    adapters only under LoRA, `lora_rank` > 0, whose stages also spend a larger part of their
    compute forward: a frozen base's backward costs about one forward, not two), how they are
    compressed (None: not at all), how often replicas sync (`sync_every`) and the pipeline
    flushes (`pipeline_delay` 1: at sync points)."""
    check_batch(global_batch, micro_batches, replicas)
    micro_size = global_batch // (replicas * micro_batches)
    ranges = layer_ranges(spec.n_layers, stages, splits)
    grads = [trained_params(spec, b, e, lora_rank, lora_targets) * DTYPE_BYTES["fp32"]
             for b, e in ranges]
    forward = tuple(stage_flops_by_pass(spec, b, e, 1.0, lora_rank, lora_targets).forward_share
                    for b, e in ranges) if lora_rank else ()
    return StepShape(micro_batches=micro_batches,
                     act_bytes=spec.activation_bytes(micro_size, act_dtype),
                     grad_bytes=grads, schedule=schedule, dp_mode=dp_mode,
                     compression=compression, act_raw_bytes=DTYPE_BYTES[act_dtype],
                     sync_every=sync_every, outer_delay=outer_delay if sync_every > 1 else 0,
                     flush_every=flush_every(pipeline_delay, sync_every, schedule),
                     forward_share=forward,
                     verify_s=verify_seconds(verify, dp_mode, grads, [
                         spec.stage_params(b, e) * DTYPE_BYTES["fp32"] for b, e in ranges],
                         sync_every))


FLUSH_FREE_RUN = 8  # steps priced between flushes without local steps (evaluations, checkpoints)


def flush_every(pipeline_delay: int, sync_every: int, schedule: str) -> int:
    """Steps between the pipeline's flushes as the worker runs them (agent/worker/delayed.py):
    every step without `--pipeline-delay 1`; with it, each sync point, or without local steps
    (one replica) the evaluations and checkpoints, priced as every `FLUSH_FREE_RUN` steps."""
    if not pipeline_delay or schedule != "1f1b":
        return 1
    return sync_every if sync_every > 1 else FLUSH_FREE_RUN


def verify_seconds(verify: str, dp_mode: str, grad_bytes: Sequence[float],
                   weight_bytes: Sequence[float], sync_every: int = 1) -> tuple[float, ...]:
    """Per stage, the replica checks' seconds per step at `--verify` level `verify`: scoring
    (a handful of passes over the gradient bytes the owners hold, synchronous steps only) and
    the weights digest every `DIGEST_EVERY` steps (with local steps: every sync point)."""
    level = resolve(verify, dp_mode)
    if level == Verify.OFF:
        return ()
    every = sync_every if sync_every > 1 else DIGEST_EVERY
    return tuple((g / (SCORE_GBPS * 1e9) if scores(level) and sync_every == 1 else 0.0)
                 + w / (DIGEST_GBPS * 1e9) / every
                 for g, w in zip(grad_bytes, weight_bytes, strict=True))


def placed_step_s(net: Network, grid: Sequence[Sequence[int]], shape: StepShape,
                  compute: np.ndarray | None = None,
                  memo: dict[tuple[object, ...], object] | None = None) -> float:
    """Predicted step of `grid` when `compute[device][stage]` is one micro-batch of that stage
    on that device (None: communication only): each tasklet's compute follows its device."""
    g = np.asarray(grid, dtype=np.int64)
    comp = None if compute is None else compute[g, np.arange(g.shape[0])[:, None]]
    return simulate_step(net, g.tolist(), shape, comp, memo).step_s


POLISH_KICK = 3  # random swaps that move a restart away from the best grid so far
POLISH_STALE_KICKS = 30  # restarts in a row that found nothing better: the polish stops


def _descend(net: Network, g: np.ndarray, cur: float, shape: StepShape,
             compute: np.ndarray | None, deadline: float,
             memo: dict[tuple[object, ...], object] | None = None) -> tuple[np.ndarray, float]:
    """Swap any two tasklets while that shortens the predicted step (first improvement),
    until `deadline`: a pass over every pair is quadratic in the devices, so the clock is
    read at every pair, not only between passes."""
    cells = [(j, k) for j in range(g.shape[0]) for k in range(g.shape[1])]
    improved = True
    while improved:
        improved = False
        for p, q in itertools.combinations(cells, 2):
            if time.perf_counter() >= deadline:
                return g, cur
            cand = g.copy()
            cand[p], cand[q] = g[q], g[p]
            value = placed_step_s(net, cand, shape, compute, memo)
            if value < cur - 1e-12:
                g, cur, improved = cand, value, True
    return g, cur


def polish(net: Network, grids: Sequence[Sequence[Sequence[int]]], shape: StepShape,
           seconds: float = 2.0, compute: np.ndarray | None = None, seed: int = 0
           ) -> tuple[list[list[int]], float]:
    """Iterated swap descent on the simulated step time from each of `grids`; the best grid
    and step.

    The paper's objective charges every pipeline link a replica's whole batch at once; the
    runtime pipelines micro-batches and shards data parallelism as direct messages, so the
    objective's optimum is not always the fastest step. Starting from the search's answer and
    from other grids, this swaps any two tasklets while that shortens the predicted step.
    A swap descent stops in the nearest local optimum, and on the world matrix those differ
    by several per cent; so once every start has descended, the best grid is kicked by a few
    random swaps and descended again (iterated local search), until `seconds` are spent or
    `POLISH_STALE_KICKS` restarts in a row found nothing better. `compute[device][stage]`:
    seconds of one micro-batch of that stage on that device (None: communication only), so a
    swap that moves a stage onto a slower device pays for it. `seed` makes the kicks
    repeatable."""
    deadline = time.perf_counter() + seconds
    memo: dict[tuple[object, ...], object] = {}  # one net, one shape: pipelines and groups
    best_grid: np.ndarray | None = None
    best = np.inf
    for start in grids:
        g = np.asarray(start, dtype=np.int64)
        g, cur = _descend(net, g, placed_step_s(net, g, shape, compute, memo), shape,
                          compute, deadline, memo)
        if cur < best:
            best, best_grid = cur, g
    assert best_grid is not None, "polish needs at least one grid"
    rng, stale = np.random.default_rng(seed), 0
    while best_grid.size > 1 and stale < POLISH_STALE_KICKS and time.perf_counter() < deadline:
        kicked = best_grid.copy()
        flat = kicked.reshape(-1)
        for _ in range(POLISH_KICK):
            a, b = rng.choice(flat.size, 2, replace=False)
            flat[a], flat[b] = flat[b], flat[a]
        g, cur = _descend(net, kicked, placed_step_s(net, kicked, shape, compute, memo),
                          shape, compute, deadline, memo)
        if cur < best - 1e-12:
            best, best_grid, stale = cur, g, 0
        else:
            stale += 1
    return best_grid.tolist(), float(best)
