"""Device memory a stage needs, and whether a plan's stages fit the devices holding them.

Owns the memory side of uneven devices: what one tasklet holds at its peak (weights, their
gradients and AdamW's two moments, the data-parallel gradient buckets, and the activations
autograd keeps for the micro-batches in flight) and the check that names the device that
does not fit and by how much. The compute side lives in `compute`.

Devices that share one memory (several agents training on one host's CPUs and RAM, or
several on one GPU) each report the whole of it; counting each report once per agent would
accept a plan eight agents on one 23 GiB box cannot hold. So the check also takes
each device's memory pool (`DeviceInfo.memory_pool`, agent/probing/device.py) and holds the sum of
the stages a pool's devices carry against the pool's memory, once.

Counted the way the worker really trains (pinned against torch by
`tests/coordinator/scheduler/test_memory_torch.py`):
- parameters stay fp32 whatever the training dtype (bf16 is autocast): 4 bytes of weight,
  4 of gradient, 8 of AdamW state = 16 bytes per parameter (4 of AdamW state, 12 in all, with
  `--moments-dtype bf16`), plus 4 more for the gradient buckets when the stage has
  data-parallel peers, and 8 more for the outer optimizer's anchor and momentum with local
  steps (`--sync-every` > 1, agent/worker/outer.py), 4 more with `--outer-delay 1` (the
  pseudo-gradient in flight), 16 more with `--pipeline-delay 1` (the weights of the two
  steps in flight, each with its gradient; agent/worker/delayed.py); under LoRA that is the
  adapters only,
  and the frozen base costs its weights alone, in the training dtype (2 bytes under bf16);
- per token of a micro-batch, a layer keeps its two LayerNorm inputs in fp32 and 6d + 2ff
  elements in the compute dtype, plus LayerNorm statistics and the attention's log-sum-exp;
  the first stage keeps the token ids, the last the head's inputs and the fp32 log-softmax;
  under bf16 every micro-batch's graph also holds its own bf16 copies of the matmul weights
  (under LoRA of the adapters only: the frozen base is bf16 already, nothing to cast);
- the Llama block (`_llama_saved`) keeps per token its RMSNorms' fp32 inputs and outputs, the
  rotated q and k, v, the attention output and 4 ff of SwiGLU, plus each layer's rotary
  tables;
- GPipe keeps all M micro-batches of a step, 1F1B at most S - stage;
- the worker process itself (interpreter, torch, gloo) holds `WORKER_RUNTIME_BYTES` before any
  model state: little beside one stage of a large model, but eight workers on one machine's
  memory pay it eight times (a gpt-small worker peaks at 0.37 GiB, bench/headline.py).
What it leaves out (allocator slack, the CUDA context, transient workspaces) makes the
figure a lower bound: a stage that does not fit here cannot fit on the device.

Pure Python: no torch, grpc or protobuf.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dtfm.core.layout import delayed_warmup, layer_ranges
from dtfm.core.lora import stage_adapter_params, trained_params
from dtfm.core.spec import DTYPE_BYTES, ModelSpec

PARAM_STATE_BYTES = 16  # fp32 weight + gradient + AdamW exp_avg + exp_avg_sq
DP_BUCKET_BYTES = 4  # the data-parallel averager's fp32 copy of every gradient
WORKER_RUNTIME_BYTES = 256 * 2**20  # a worker process's own memory, rounded down
POOL_NAMES_SHOWN = 4  # agents named in a shared pool's message
FP32 = 4


@dataclass(frozen=True)
class MemoryShape:
    """What decides a stage's memory besides its layer range."""

    spec: ModelSpec
    stages: int
    replicas: int
    micro_size: int  # sequences per micro-batch
    micro_batches: int
    schedule: str = "gpipe"
    dtype: str = "fp32"  # the training (autocast) dtype
    moments_dtype: str = "fp32"  # what AdamW stores its two moments in
    sync_every: int = 1  # > 1: local steps, with an fp32 anchor and momentum per parameter
    lora_rank: int = 0  # > 0: a frozen base (weights only, in `dtype`) plus adapters that train
    lora_targets: str = ""
    outer_delay: int = 0  # 1: local steps also hold the pseudo-gradient in flight
    pipeline_delay: int = 0  # 1: two copies of the trained weights, each with its gradient


OUTER_STATE_BYTES = 2 * FP32  # local steps: the anchor and the outer momentum, fp32
# --pipeline-delay 1: the weights of the two steps in flight, each copy with its gradient
DELAYED_COPIES_BYTES = 2 * 2 * FP32


def param_state_bytes(moments_dtype: str = "fp32") -> int:
    """Bytes per parameter of weight, gradient (both fp32) and AdamW's two moments."""
    return 2 * FP32 + 2 * DTYPE_BYTES[moments_dtype]


def matmul_params(spec: ModelSpec, begin: int, end: int) -> int:
    """Weights of the matrix multiplies in layers [begin, end) and, on the last stage, the head."""
    n = (end - begin) * spec.layer_matmul_params()
    return n + (spec.d_model * spec.vocab_size if end == spec.n_layers else 0)


def activation_bytes(spec: ModelSpec, begin: int, end: int, sequences: int,
                     dtype: str = "fp32", lora_rank: int = 0, lora_targets: str = "") -> int:
    """Bytes autograd keeps for one micro-batch of `sequences` in layers [begin, end).

    Under LoRA (`lora_rank` > 0) the activations are counted as for full fine-tuning, which
    errs high (a frozen projection keeps no input of its own for a weight gradient; measured
    up to 15 % high for the Llama block, a few per cent for GPT's); the bf16 weight copies are
    the adapters' alone."""
    act = DTYPE_BYTES[dtype]
    per_layer, per_layer_fixed, head = (_llama_saved(spec, dtype) if spec.arch == "llama"
                                        else _gpt_saved(spec, dtype))
    per_token = (end - begin) * per_layer
    if begin == 0:
        per_token += 8  # int64 token ids
    if end == spec.n_layers:
        per_token += head + spec.vocab_size * FP32 + 8  # fp32 log-softmax, int64 targets
    cast = (stage_adapter_params(spec, begin, end, lora_rank, lora_targets) if lora_rank
            else matmul_params(spec, begin, end))
    weights = 2 * cast if dtype != "fp32" else 0
    fixed = (end - begin) * per_layer_fixed * act
    return sequences * spec.seq_len * per_token + weights + fixed


def _gpt_saved(spec: ModelSpec, dtype: str) -> tuple[int, int, int]:
    """Per token: a GPT layer's bytes, its sequence-independent elements, the head's bytes."""
    d, ff, act = spec.d_model, spec.d_ff, DTYPE_BYTES[dtype]
    per_layer = 2 * d * FP32 + (6 * d + 2 * ff) * act + (4 + spec.n_heads) * FP32
    return per_layer, 0, d * FP32 + d * act + 8  # ln_f: input, mean and rstd; head input


def _llama_saved(spec: ModelSpec, dtype: str) -> tuple[int, int, int]:
    """Per token: a Llama layer's bytes, its sequence-independent elements, the head's bytes.

    Each RMSNorm keeps its fp32 input, its normalised value and its 1/rms; its output is kept
    once in fp32 or, under autocast, as one compute-dtype copy per matmul reading it (q, k, v
    after the first norm; gate, up after the second). Attention keeps the rotated q and k, v,
    its output and the log-sum-exp per head; the SwiGLU MLP 4 x ff (gate, up, silu, product).
    Each layer also keeps its rotary cos and sin tables (seq_len x head_dim each)."""
    d, act = spec.d_model, DTYPE_BYTES[dtype]
    q, kv = spec.n_heads * spec.head_size, spec.kv_heads * spec.head_size
    copies = 2 if dtype == "fp32" else 5
    per_layer = (4 * d * FP32 + copies * d * act + (2 * q + 2 * kv + 4 * spec.d_ff) * act
                 + (spec.n_heads + 2) * FP32)
    head = 2 * d * FP32 + d * act + FP32
    return per_layer, 2 * spec.seq_len * spec.head_size, head


def micro_batches_held(schedule: str, stage: int, stages: int, micro_batches: int,
                       pipeline_delay: int = 0) -> int:
    """Micro-batches whose activations a stage holds at once (GPipe: all; 1F1B: S - stage;
    without flushes between steps, its warm-up's and one more: `layout.delayed_warmup`)."""
    if schedule == "1f1b" and pipeline_delay:
        return delayed_warmup(stage, stages, micro_batches) + 1
    if schedule == "1f1b":
        return min(micro_batches, stages - stage)
    return micro_batches


def stage_bytes(shape: MemoryShape, stage: int, begin: int, end: int) -> int:
    """Peak bytes on one device holding `stage` with layers [begin, end)."""
    per_param = (param_state_bytes(shape.moments_dtype)
                 + (DP_BUCKET_BYTES if shape.replicas > 1 else 0)
                 + (OUTER_STATE_BYTES if shape.sync_every > 1 else 0)
                 + (FP32 if shape.sync_every > 1 and shape.outer_delay else 0)
                 + (DELAYED_COPIES_BYTES if shape.pipeline_delay else 0))
    held = micro_batches_held(shape.schedule, stage, shape.stages, shape.micro_batches,
                              shape.pipeline_delay)
    params = shape.spec.stage_params(begin, end)
    trained = trained_params(shape.spec, begin, end, shape.lora_rank, shape.lora_targets)
    # LoRA: the base has no gradient and no AdamW state, and is held in the training dtype
    # (bf16 under --dtype bf16: agent/worker/lora.py); the adapters stay fp32 masters
    frozen = params * DTYPE_BYTES[shape.dtype] if shape.lora_rank else 0
    return (WORKER_RUNTIME_BYTES + frozen + per_param * trained
            + held * activation_bytes(shape.spec, begin, end, shape.micro_size, shape.dtype,
                                      shape.lora_rank, shape.lora_targets))


def stages_bytes(shape: MemoryShape, splits: Sequence[int] | None = None) -> list[int]:
    """Peak bytes per stage for a layer split (None: even)."""
    ranges = layer_ranges(shape.spec.n_layers, shape.stages, splits)
    return [stage_bytes(shape, j, b, e) for j, (b, e) in enumerate(ranges)]


@dataclass(frozen=True)
class Shortfall:
    """A device that cannot hold its stage, or a memory pool that cannot hold the stages of
    every device drawing from it (`pool` set; `device` and `stage` are then its first)."""

    device: int
    stage: int
    needed: int
    available: int
    pool: str = ""
    devices: tuple[int, ...] = ()  # the pool's devices
    stages: tuple[int, ...] = ()  # the stage each of them holds

    @property
    def missing(self) -> int:
        return self.needed - self.available

    def describe(self, names: Sequence[str] | None = None) -> str:
        """What does not fit, naming devices by `names` (by index without)."""
        needs = f"{gib(self.needed)} ({self.needed} bytes)"
        has = (f"{gib(self.available)} ({self.available} bytes), {gib(self.missing)} short")
        if not self.pool:
            who = names[self.device] if names is not None else f"device {self.device}"
            return f"{who} cannot hold stage {self.stage}: it needs {needs} but has {has}"
        agents = [names[d] if names is not None else f"device {d}" for d in self.devices]
        listed = ", ".join(agents[:POOL_NAMES_SHOWN]) + (
            ", ..." if len(agents) > POOL_NAMES_SHOWN else "")
        held = ", ".join(map(str, sorted(set(self.stages))))
        return (f"the {len(agents)} agents sharing one machine's memory ({listed}; memory pool "
                f"{self.pool[:12]}) cannot hold stages {held} together: they need {needs} but "
                f"the machine has {has}")


def advice(moments_dtype: str = "fp32") -> str:
    """What to try when a plan does not fit; bf16 moments only where they are not on yet."""
    bf16 = ("store AdamW's moments in bf16 (--moments-dtype bf16: 12 instead of 16 bytes per "
            "parameter), " if moments_dtype == "fp32" else "")
    return (f"use more pipeline stages or agents on other machines, {bf16}fewer replicas per "
            "machine, fewer or smaller micro-batches, or devices with more memory")


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def shortfalls(grid: Sequence[Sequence[int]], needed: Sequence[int],
               available: Sequence[int], pools: Sequence[str] | None = None) -> list[Shortfall]:
    """Every device of `grid` whose stage needs more than it has, and (with `pools`, one id per
    device, "" for a device's own memory) every pool its devices together overfill; worst
    first.

    `available[device]` 0 means unknown: that device is not checked. A pool has the most any
    of its devices reported (each saw the whole pool, at slightly different moments)."""
    out = [Shortfall(d, j, needed[j], available[d]) for j, row in enumerate(grid) for d in row
           if 0 < available[d] < needed[j]]
    if pools is not None:
        out += pool_shortfalls(grid, needed, available, pools)
    return sorted(out, key=lambda s: (-s.missing, s.stage, s.device))


def pool_shortfalls(grid: Sequence[Sequence[int]], needed: Sequence[int],
                    available: Sequence[int], pools: Sequence[str]) -> list[Shortfall]:
    """Every memory pool shared by two or more of `grid`'s devices whose stages, summed, need
    more than the pool has."""
    members: dict[str, list[tuple[int, int]]] = {}
    for j, row in enumerate(grid):
        for d in row:
            if pools[d]:
                members.setdefault(pools[d], []).append((d, j))
    out = []
    for pool, held in members.items():
        room = max(available[d] for d, _ in held)
        total = sum(needed[j] for _, j in held)
        if len(held) > 1 and 0 < room < total:
            out.append(Shortfall(held[0][0], held[0][1], total, room, pool=pool,
                                 devices=tuple(d for d, _ in held),
                                 stages=tuple(j for _, j in held)))
    return out


def packs(needs: Sequence[int], available: Sequence[int],
          pools: Sequence[str] | None = None) -> bool:
    """Whether tasklets needing `needs` bytes can go one per device onto devices with
    `available` bytes (0: unknown, taken to fit), where devices of one pool (`pools`, "" for
    its own memory) share the most any of them reported.

    Largest first, each onto the device (or pool) with the most room left. Without pools
    that is exact (the largest stages on the largest devices fit whenever any placement
    does); with pools it is the usual greedy for packing and can, rarely, miss a packing
    that exists, and `check_fit` still checks the placement actually made."""
    reported: dict[str, list[int]] = {}
    for d, avail in enumerate(available):
        key = pools[d] if pools is not None and pools[d] else f"device {d}"
        reported.setdefault(key, []).append(avail)
    bins = [[float(max(r)) if max(r) > 0 else math.inf, len(r)]  # [room left, free devices]
            for r in reported.values()]
    for need in sorted(needs, reverse=True):
        open_bins = [b for b in bins if b[1] > 0 and b[0] >= need]
        if not open_bins:
            return False
        best = max(open_bins, key=lambda b: b[0])
        best[0] -= need
        best[1] -= 1
    return True


class DoesNotFit(ValueError):
    """A plan whose stages cannot fit some device's memory; names the worst one."""

    def __init__(self, worst: Shortfall, count: int, names: Sequence[str] | None = None,
                 moments_dtype: str = "fp32") -> None:
        self.worst, self.count = worst, count
        more = f" ({count - 1} other device(s) too)" if count > 1 else ""
        super().__init__(f"{worst.describe(names)}{more}: {advice(moments_dtype)}")


def check_fit(grid: Sequence[Sequence[int]], needed: Sequence[int],
              available: Sequence[int], names: Sequence[str] | None = None,
              pools: Sequence[str] | None = None, moments_dtype: str = "fp32") -> None:
    """Raise `DoesNotFit` naming the device (or the shared memory pool) that misses the most
    bytes, if any does."""
    short = shortfalls(grid, needed, available, pools)
    if short:
        raise DoesNotFit(short[0], len(short), names, moments_dtype)
