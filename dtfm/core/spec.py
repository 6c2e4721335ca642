"""The model spec and training config: what a job trains, shared by planner and worker.

The planner needs sizes (parameters per stage, activation bytes between stages) and the worker
needs a shape to build; both read the same `ModelSpec`, so a test can pin that the analytic
sizes here equal what the torch model really holds. The GPT these formulas describe:

- token embedding `V x d` and learned position embedding `P x d` (first stage; P =
  max_positions, seq_len by default),
- per layer: LayerNorm(d) -> causal self-attention (qkv Linear d->3d with bias, out Linear d->d
  with bias) -> residual; LayerNorm(d) -> MLP (Linear d->ff with bias, GELU, Linear ff->d with
  bias) -> residual,
- final LayerNorm(d) and an untied LM head Linear d->V without bias (last stage).

The Llama block (`arch="llama"`): token embedding `V x d` only (positions are rotary); per
layer RMSNorm(d) -> attention (q: d -> H*hd, k and v: d -> KV*hd, each with a bias only under
`qkv_bias`; o: H*hd -> d, no bias) -> residual; RMSNorm(d) -> SwiGLU MLP (gate and up d->ff,
down ff->d, no biases) -> residual; final RMSNorm(d) and the untied head d->V.

Pure Python: no torch, no grpc; `to_proto`/`from_proto` import the generated messages lazily.
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from dtfm.core.verify import Verify
from dtfm.core.verify import check as check_verify
from dtfm.core.words import counted

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # what the cost model can size
UINT32 = 2**32 - 1
# Checkpoints are on unless the operator says 0: a crashed or rescheduled job then loses at
# most this many steps, and a few-step test run writes only its final checkpoint.
DEFAULT_CHECKPOINT_EVERY = 50
# TrainConfig.sync_every of `--sync-every auto`: the coordinator picks H from the measured links
# (coordinator/scheduler/sync_auto.py) before any worker sees it; 0 on the wire is a peer that
# predates local steps, which `from_proto` reads as synchronous training
SYNC_AUTO = 0
# TrainConfig.outer_momentum of `--outer-momentum auto` (the default): 0.5 for rounds of up to
# LONGEST_MEASURED_ROUND local steps, DiLoCo's 0.9 for longer ones, its regime of hundreds. A
# short round's pseudo-gradient is nearly H steps in one direction, which 0.9's steady
# 1/(1 - 0.9) = 10x amplification overshoots, and over a run of few rounds 0.5 did as well or
# better at every H measured, 2 to 64 (gpt-tiny, 2 and 4 replicas: +4.3 to +6.1 % validation
# loss against synchronous at H = 2 and 4 with 0.9, -1.5 % with 0.5; gpt-mini, 4 replicas,
# 128 steps, H = 16: +4.7 % with 0.9, +2.6 % with 0.5; docs/benchmarks.md, "Outer momentum")
OUTER_MOMENTUM_AUTO = -1.0
LONGEST_MEASURED_ROUND = 64


class Schedule(enum.StrEnum):
    """The order in which a pipeline stage runs its micro-batches' forward and backward passes.

    Members are `str`s equal to their wire spelling, so `TrainConfig` travels in
    `dtfm.v1.TrainConfig` unchanged and code comparing with "gpipe" keeps working.
    """

    GPIPE = "gpipe"  # every forward, then every backward: all micro-batches' activations held
    ONE_F_ONE_B = "1f1b"  # warm up, then one forward per backward: at most S micro-batches held


class DpMode(enum.StrEnum):
    """How a stage's data-parallel replicas average their gradients (agent/worker/data_parallel)."""

    ALLREDUCE = "allreduce"  # one all_reduce per bucket: a ring's 2(R-1) hops of latency
    SHARDED = "sharded"  # the paper's scatter-reduce + all-gather as direct messages: two hops


class Dtype(enum.StrEnum):
    """What the worker trains in: the autocast dtype of forward passes and of activations sent.

    fp16 is absent on purpose: it needs loss scaling, which the worker does not do.
    """

    FP32 = "fp32"
    BF16 = "bf16"


class MomentsDtype(enum.StrEnum):
    """What AdamW stores its two moments (exp_avg, exp_avg_sq) in between steps.

    bf16 keeps 4 bytes per parameter instead of 8 (`agent/worker/optim.py` computes the update
    in fp32 and rounds only what it stores), which is what lets a model whose fp32 state does
    not fit its devices train at all; Megatron-core's `--exp-avg-dtype bf16` is the precedent.
    """

    FP32 = "fp32"
    BF16 = "bf16"


# The allowed spellings, for code that wants plain strings (argparse choices, messages).
SCHEDULES = tuple(m.value for m in Schedule)
DP_MODES = tuple(m.value for m in DpMode)
TRAIN_DTYPES = tuple(m.value for m in Dtype)


ARCHS = ("gpt", "llama")
GPT_ACTIVATIONS = ("gelu", "gelu_tanh")
ROPE_TYPES = ("", "llama3", "linear")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape: dtfm's GPT (`arch="gpt"`) or the Llama family
    (`arch="llama"`: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention; Llama,
    Mistral and, with `qkv_bias`, Qwen2).

    Every field added after the GPT-only first version has a default that leaves the GPT as it
    was (and an unset wire field means that default); zero-valued sizes mean "derived":
    `d_ff` 0 is 4 x d_model, `n_kv_heads` 0 is n_heads, `head_dim` 0 is d_model / n_heads,
    `max_positions` 0 is seq_len (the rows of the GPT's learned position embedding).
    Embeddings and LM head are always separate parameters (untied).
    """

    name: str
    vocab_size: int
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    d_ff: int = 0  # 0 means 4 * d_model
    arch: str = "gpt"
    n_kv_heads: int = 0  # 0: n_heads (llama only; the GPT has one K/V head per query head)
    head_dim: int = 0  # 0: d_model // n_heads
    norm_eps: float = 1e-5  # LayerNorm (gpt) or RMSNorm (llama) epsilon
    activation: str = "gelu"  # gpt: "gelu" (exact) or "gelu_tanh" (GPT-2's gelu_new)
    rope_theta: float = 10000.0
    rope_type: str = ""  # "": plain rotary; "llama3" or "linear" scaling
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max_positions: int = 0  # llama3 only: the context it was pretrained on
    qkv_bias: bool = False  # llama: biases on q/k/v projections (Qwen2)
    max_positions: int = 0  # 0: seq_len; gpt: rows of the learned position embedding

    def __post_init__(self) -> None:
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        for name in ("vocab_size", "n_layers", "d_model", "n_heads", "seq_len", "d_ff"):
            if getattr(self, name) < 1:
                raise ValueError(f"model spec {self.name!r}: {name} must be >= 1")
        for name, allowed in (("arch", ARCHS), ("activation", GPT_ACTIVATIONS),
                              ("rope_type", ROPE_TYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"model spec {self.name!r}: {name} must be one of "
                                 f"{', '.join(map(repr, allowed))}, got {getattr(self, name)!r}")
        for name in ("n_kv_heads", "head_dim", "max_positions", "rope_original_max_positions"):
            if getattr(self, name) < 0:
                raise ValueError(f"model spec {self.name!r}: {name} must be >= 0")
        for name in ("norm_eps", "rope_theta", "rope_factor", "rope_low_freq_factor",
                     "rope_high_freq_factor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"model spec {self.name!r}: {name} must be > 0, got {value}")
        self._check_heads()

    def _check_heads(self) -> None:
        what = f"model spec {self.name!r}"
        if self.head_dim == 0 and self.d_model % self.n_heads:
            raise ValueError(f"{what}: d_model={self.d_model} is not divisible by "
                             f"n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"{what}: n_heads={self.n_heads} is not a multiple of "
                             f"n_kv_heads={self.kv_heads}")
        if self.arch == "gpt":
            if self.kv_heads != self.n_heads or self.head_size * self.n_heads != self.d_model:
                raise ValueError(f"{what}: the gpt block has n_kv_heads = n_heads and "
                                 f"head_dim = d_model / n_heads; use arch 'llama' otherwise")
            if self.qkv_bias or self.rope_type:
                raise ValueError(f"{what}: qkv_bias and rope_type are for arch 'llama' (the gpt "
                                 f"block always has biases and learned positions)")
            if self.max_positions and self.max_positions < self.seq_len:
                raise ValueError(f"{what}: max_positions={self.max_positions} is shorter than "
                                 f"seq_len={self.seq_len}: the position embedding has a row "
                                 f"per position")
        elif self.head_size % 2:
            raise ValueError(f"{what}: rotary embeddings need an even head_dim, got "
                             f"{self.head_size}")

    # --- derived shape ---
    @property
    def kv_heads(self) -> int:
        """Key/value heads (n_kv_heads, or n_heads where 0)."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        """Dimensions per attention head (head_dim, or d_model // n_heads where 0)."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def positions(self) -> int:
        """Positions the model knows (max_positions, or seq_len where 0)."""
        return self.max_positions or self.seq_len

    def attention_matmul_params(self) -> int:
        """Weights of one layer's q, k, v and output projections."""
        q = self.n_heads * self.head_size
        return 2 * self.d_model * q + 2 * self.d_model * self.kv_heads * self.head_size

    def mlp_matmul_params(self) -> int:
        """Weights of one layer's MLP: d->ff->d (gpt) or gate, up and down (llama's SwiGLU)."""
        return (3 if self.arch == "llama" else 2) * self.d_model * self.d_ff

    def layer_matmul_params(self) -> int:
        return self.attention_matmul_params() + self.mlp_matmul_params()

    # --- analytic sizes (must equal the torch model; tests pin it) ---
    def embedding_params(self) -> int:
        if self.arch == "llama":
            return self.vocab_size * self.d_model
        return self.vocab_size * self.d_model + self.positions * self.d_model

    def layer_params(self) -> int:
        d, ff = self.d_model, self.d_ff
        if self.arch == "llama":
            bias = (self.n_heads + 2 * self.kv_heads) * self.head_size if self.qkv_bias else 0
            return self.layer_matmul_params() + bias + 2 * d  # two RMSNorm weights
        attn = d * 3 * d + 3 * d + d * d + d
        mlp = d * ff + ff + ff * d + d
        norms = 2 * 2 * d
        return attn + mlp + norms

    def head_params(self) -> int:
        norm = self.d_model if self.arch == "llama" else 2 * self.d_model
        return norm + self.d_model * self.vocab_size

    def param_count(self) -> int:
        return self.embedding_params() + self.n_layers * self.layer_params() + self.head_params()

    def stage_params(self, layer_begin: int, layer_end: int) -> int:
        """Parameters of the stage holding layers [layer_begin, layer_end)."""
        if not 0 <= layer_begin < layer_end <= self.n_layers:
            raise ValueError(
                f"layer range [{layer_begin}, {layer_end}) is outside 0..{self.n_layers}"
            )
        n = (layer_end - layer_begin) * self.layer_params()
        if layer_begin == 0:
            n += self.embedding_params()
        if layer_end == self.n_layers:
            n += self.head_params()
        return n

    def activation_elements(self, sequences: int) -> int:
        """Elements of the hidden state one stage sends the next for `sequences` sequences."""
        return sequences * self.seq_len * self.d_model

    def activation_bytes(self, sequences: int, dtype: str = "fp32") -> int:
        return self.activation_elements(sequences) * DTYPE_BYTES[dtype]

    def to_proto(self) -> Any:
        from protos.dtfm.v1 import common_pb2

        return common_pb2.ModelSpec(**asdict(self))

    @classmethod
    def from_proto(cls, msg: Any) -> ModelSpec:
        """The spec a `dtfm.v1.ModelSpec` describes; a field left unset (zero or empty, as a
        peer that predates it sends) takes its default, none of which is a zero."""
        values = {f.name: getattr(msg, f.name) for f in fields(cls)}
        for f in fields(cls):
            if f.name in _SPEC_ADDED_LATER and not values[f.name]:
                values[f.name] = f.default
        return cls(**values)


# ModelSpec fields the wire gained after its first version whose default is not zero.
_SPEC_ADDED_LATER = ("arch", "norm_eps", "activation", "rope_theta", "rope_factor",
                     "rope_low_freq_factor", "rope_high_freq_factor")


def _option(default: Any, doc: str, flag: str = "") -> Any:
    """A `TrainConfig` field with its documentation and, where it differs from the field's
    name, its flag: `dtfm.flags` builds the operator's flags (help text included) from these,
    and `validate` names the flag to fix, so the two never drift."""
    return field(default=default, metadata={"doc": doc, "flag": flag})


@dataclass
class TrainConfig:
    """How to train. Mirrors `dtfm.v1.TrainConfig` field for field.

    Every field is something an operator sets: `coordinator start` and `agent local` expose
    each as the flag `flag_of(name)` (also `DTFM_<FLAG>` and a TOML key), documented by the
    field's `doc` metadata, with the default here. The enum fields accept their plain string
    spelling (from the wire, a flag or a test) and hold the enum member afterwards; a value
    that is no member is kept as given, so that `validate` reports it like every other mistake
    instead of the constructor raising.
    """

    global_batch: int = _option(
        8, "global batch: sequences per optimizer step, over all replicas", flag="--batch")
    micro_batches: int = _option(
        2, "micro-batches each replica's share of the batch is cut into (pipeline depth)")
    steps: int = _option(100, "optimizer steps to train")
    seed: int = _option(
        0, "seeds model initialization and data order (coordinator start: its placement "
        "search too)")
    schedule: Schedule = _option(
        Schedule.GPIPE, "pipeline schedule: gpipe runs every forward, then every backward; "
        "1f1b interleaves them and holds fewer micro-batches' activations")
    dp_mode: DpMode = _option(
        DpMode.SHARDED, "how replicas average gradients: sharded is the paper's (two hops of "
        "latency where allreduce's ring takes 2(R-1))")
    lr: float = _option(1e-3, "peak learning rate (AdamW)")
    warmup_steps: int = _option(
        10, "steps of linear learning-rate warmup, then cosine decay to 10% of --lr")
    grad_clip: float = _option(1.0, "clip the global gradient norm to this (0: off)")
    weight_decay: float = _option(
        0.1, "AdamW weight decay of matrices (biases and norms get none)")
    data_path: str = _option(
        "", "a directory `agent prepare` wrote (train.bin, val.bin and meta.json: uint16 or "
        "uint32 ids), nanoGPT's uint16 train.bin and val.bin, or one uint16 .bin file, on "
        "every worker's machine (empty: the bundled corpus)", flag="--data")
    checkpoint_dir: str = _option(
        "", "where each stage checkpoints, under a folder per job id, and resumes from "
        "(empty: each agent's own state directory; agent local: none). Shared storage lets "
        "a job rescheduled onto other agents resume")
    dtype: Dtype = _option(Dtype.FP32, "what the worker trains and sends activations in")
    checkpoint_every: int = _option(
        DEFAULT_CHECKPOINT_EVERY, "steps between checkpoints; each stage also checkpoints "
        "after the last step, and keeps its newest 2 (0: no checkpoints at all)")
    eval_batches: int = _option(
        4, "validation batches (of --batch sequences) evaluated after the last step (0: none)")
    eval_every: int = _option(
        0, "steps between validation evaluations while training, each reported live like "
        "the loss (0: only after the last step); evaluating changes neither the weights nor "
        "the data order")
    pp_compress: str = _option(
        "none", "compress pipeline activations and their gradients: none, int8, int4 (per "
        "block of 128 values), int4h (int4's bytes after a Hadamard rotation of each block, "
        "gradients rounded stochastically), or auto (the coordinator picks per link, where "
        "the saving beats the time to compress; agent local: none)")
    dp_compress: str = _option(
        "none", "compress data-parallel gradients, with error feedback: none, int8, int4, "
        "int3 (3 bits, 9.1x; data-parallel only), topk:RATIO (the largest RATIO of each "
        "block) or auto (per data-parallel group); needs --dp-mode sharded")
    moments_dtype: MomentsDtype = _option(
        MomentsDtype.FP32, "what AdamW stores its two moments in: fp32, or bf16 (the update is "
        "still computed in fp32; 12 instead of 16 bytes of state per parameter, for a model "
        "whose fp32 state does not fit)")
    init_from: str = _option(
        "", "a Hugging Face model directory (config.json and model.safetensors, or shards and "
        "their index) to start from, on every worker's machine: the model comes from its "
        "config.json (no --model needed); GPT2LMHeadModel, LlamaForCausalLM, "
        "Qwen2ForCausalLM, MistralForCausalLM")
    seq_len: int = _option(
        0, "with --init-from: the sequence length to train on (0: the config's maximum "
        "positions, at most 2048)")
    sync_every: int = _option(
        1, "replicas take this many optimizer steps on their own before they average what "
        "they learned (the pseudo-gradient) and take an outer Nesterov step: data-parallel "
        "traffic falls by this factor, at a small loss per token (DiLoCo); 1: every step is "
        "exact synchronous training; auto (coordinator start): the smallest H whose "
        "exchange costs at most --sync-overhead of the step, by the step model on the "
        "measured links")
    outer_lr: float = _option(
        0.7, "learning rate of the outer Nesterov step on the averaged pseudo-gradient "
        "(with --sync-every > 1)")
    outer_momentum: float = _option(
        OUTER_MOMENTUM_AUTO, "momentum of the outer Nesterov step (with --sync-every > 1); "
        f"auto: 0.5 for rounds of up to {LONGEST_MEASURED_ROUND} steps, where DiLoCo's 0.9 "
        "overshoots, 0.9 for longer ones")
    outer_delay: int = _option(
        0, "with --sync-every > 1: 1 lets each sync point's exchange run while the next "
        "round trains, and applies its outer step one round late, each replica keeping its "
        "own newest round meanwhile (eager one-round-delayed DiLoCo: nobody waits at a sync "
        "point, at a loss per token that grows with the replicas: raise H first); 0: the "
        "replicas wait for the exchange at every sync point")
    pipeline_delay: int = _option(
        0, "1: the pipeline does not flush between steps (PipeDream-2BW): a step's first "
        "forwards run while the step before drains, each step training on the weights from "
        "two steps before moved as AdamW predicts the update in flight (its gradient "
        "applied one step late; the global-norm clip stays exact); faster on slow links, at "
        "a loss per token (+3-7 per cent on gpt-mini at 48-128 steps: docs/benchmarks.md); "
        "it flushes in the learning rate's warm-up, at sync points, evaluations, checkpoints "
        "and the last step; needs --schedule 1f1b and, with replicas, --sync-every H >= 2; "
        "0: every step flushes (exact synchronous training)")
    lora_rank: int = _option(
        0, "train LoRA adapters of this rank beside a frozen base instead of every weight "
        "(0: off, full fine-tuning); only the adapters are optimized, exchanged between "
        "replicas and checkpointed (the base comes from --init-from on every machine)")
    lora_alpha: float = _option(
        8.0, "LoRA scaling numerator, as peft's lora_alpha: adapters add alpha/rank x B A x")
    lora_dropout: float = _option(
        0.0, "dropout on the adapters' input, as peft's lora_dropout (0 keeps training exact)")
    lora_targets: str = _option(
        "", "comma-separated module names to adapt, as peft's target_modules (a module "
        "matches when its name ends with one); empty: every attention and MLP projection "
        "(llama: q_proj..down_proj; gpt: c_attn, c_proj, c_fc)")
    lora_init: str = _option(
        "", "a peft adapter directory whose adapters training starts from (on every "
        "worker's machine; its base is --init-from); set for you when --init-from names an "
        "adapter directory (adapter_config.json), with its rank, alpha and targets")
    verify: Verify = _option(
        Verify.AUTO, "replica checks against a faulty or hostile peer (docs/architecture.md, "
        "Integrity: replica checks): off, digest (the replicas' weights are compared every "
        "few steps), full (digest, and each gradient copy is scored at its shard's owner; "
        "needs --dp-mode sharded), robust (full, averaged with CenteredClip) or auto (full "
        "under sharded, else digest)")

    def outer_mu(self) -> float:
        """The outer momentum the worker applies: the flag's, or auto's by the round length."""
        if self.outer_momentum != OUTER_MOMENTUM_AUTO:
            return self.outer_momentum
        return 0.9 if self.sync_every > LONGEST_MEASURED_ROUND else 0.5

    def __post_init__(self) -> None:
        for name, kind in _ENUMS.items():
            value = getattr(self, name)
            if not isinstance(value, kind) and value in _values(kind):
                setattr(self, name, kind(value))

    @staticmethod
    def flag_of(name: str) -> str:
        """The flag that sets field `name`: `--batch` for `global_batch`, else `--<name>`."""
        meta = _FIELDS[name].metadata
        return str(meta["flag"]) or "--" + name.replace("_", "-")

    def validate(self, replicas: int = 1) -> None:
        """Raise ValueError naming the flag to fix, for a config the worker cannot train."""
        for name, kind in _ENUMS.items():
            value = getattr(self, name)
            if value not in _values(kind):
                why = " (fp16 needs loss scaling, which the worker does not do: use bf16)" \
                    if kind is Dtype else ""
                raise ValueError(f"{self.flag_of(name)} must be one of "
                                 f"{', '.join(_values(kind))}, got {value!r}{why}")
        self._check_ranges()
        check_batch(self.global_batch, self.micro_batches, replicas)
        self._check_compression()
        check_verify(self.verify, self.dp_mode)
        self._check_pipeline_delay(replicas)

    def _check_compression(self) -> None:
        from dtfm.core.codecs import check_setting

        check_setting(self.pp_compress, topk=False, what="--pp-compress")
        check_setting(self.dp_compress, topk=True, what="--dp-compress")
        if self.dp_mode != DpMode.SHARDED and self.dp_compress not in ("none", "auto"):
            raise ValueError(f"--dp-compress {self.dp_compress} needs --dp-mode sharded: a "
                             f"ring all-reduce sums in flight, which messages quantized with "
                             f"their own scales cannot do")

    def _check_ranges(self) -> None:
        flag = self.flag_of
        for name in _COUNTS:
            value = getattr(self, name)
            if not 0 <= value <= UINT32:
                raise ValueError(f"{flag(name)} must be in 0..{UINT32}, got {value}")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"--seed must be in 0..2**64-1, got {self.seed}")
        for name in ("lr", "grad_clip", "weight_decay"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"{flag(name)} must be a finite number, got {value}")
        if self.seq_len and not self.init_from:
            raise ValueError("--seq-len applies with --init-from; for a preset give "
                             "--model NAME:seq=N")
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.eval_every and not self.eval_batches:
            raise ValueError(f"--eval-every {self.eval_every} evaluates nothing with "
                             "--eval-batches 0: give --eval-batches N (validation batches "
                             "per evaluation) or leave --eval-every out")
        for name in ("grad_clip", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{flag(name)} must be >= 0, got {getattr(self, name)}")
        self._check_outer()
        self._check_lora()

    def _check_lora(self) -> None:
        """Ranges only (the rank is a count: `_COUNTS`); whether the targets name modules of
        the model: `dtfm.core.lora.check`."""
        if not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ValueError(f"--lora-alpha must be a finite number > 0, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_init and not self.lora_rank:
            raise ValueError("--lora-init continues LoRA adapters: give it with --lora-rank "
                             "(or give the adapter directory as --init-from, which sets both)")

    def _check_outer(self) -> None:
        if self.sync_every < 0:  # 0 is SYNC_AUTO: the coordinator resolves it before training
            raise ValueError(f"--sync-every must be >= 1 (1: synchronous) or auto, got "
                             f"{self.sync_every}")
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0):
            raise ValueError(f"--outer-lr must be a finite number > 0, got {self.outer_lr}")
        if self.outer_momentum != OUTER_MOMENTUM_AUTO and not 0 <= self.outer_momentum < 1:
            raise ValueError(f"--outer-momentum must be in [0, 1) or auto, got "
                             f"{self.outer_momentum}")
        if self.outer_delay not in (0, 1):
            raise ValueError(f"--outer-delay must be 0 (wait at each sync point) or 1 (apply "
                             f"the outer step one round late), got {self.outer_delay}")
        if self.outer_delay and self.sync_every == 1:
            raise ValueError("--outer-delay 1 delays the outer step of local steps: give "
                             "--sync-every H (H >= 2, or auto) with it, or leave it out")

    def _check_pipeline_delay(self, replicas: int) -> None:
        if self.pipeline_delay not in (0, 1):
            raise ValueError(f"--pipeline-delay must be 0 (flush every step) or 1 (apply "
                             f"each step's update one step late), got {self.pipeline_delay}")
        if not self.pipeline_delay:
            return
        if self.schedule != Schedule.ONE_F_ONE_B:
            raise ValueError(f"--pipeline-delay 1 keeps 1F1B running across steps: give "
                             f"--schedule 1f1b with it (got {self.schedule})")
        if self.sync_every == 1 and replicas > 1:
            raise ValueError("--pipeline-delay 1 with replicas needs local steps, which "
                             "average between replicas only at sync points, where the "
                             "pipeline flushes: give --sync-every H (H >= 2, or auto) with it")

    def to_proto(self) -> Any:
        from protos.dtfm.v1 import common_pb2

        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in _ENUMS:
            values[name] = str(values[name])  # the plain spelling, member or not
        return common_pb2.TrainConfig(**values)

    @classmethod
    def from_proto(cls, msg: Any) -> TrainConfig:
        values = {f.name: getattr(msg, f.name) for f in fields(cls)}
        for name in _ADDED_LATER:  # a peer that predates the field leaves it unset ("")
            if values[name] == "":
                values[name] = _FIELDS[name].default
        if values["lora_alpha"] == 0:  # a peer that predates adapters
            values["lora_alpha"] = _FIELDS["lora_alpha"].default
        if values["sync_every"] == 0:  # a peer that predates local steps: synchronous
            for name in _OUTER:
                values[name] = _FIELDS[name].default
        return cls(**values)


_FIELDS = {f.name: f for f in fields(TrainConfig)}
_ENUMS: dict[str, type[enum.StrEnum]] = {"schedule": Schedule, "dp_mode": DpMode, "dtype": Dtype,
                                          "moments_dtype": MomentsDtype, "verify": Verify}
# Enum fields the wire gained after its first version: unset on the wire means the default.
_ADDED_LATER = ("moments_dtype", "verify")
# unset on the wire: all their defaults
_OUTER = ("sync_every", "outer_lr", "outer_momentum", "outer_delay")
_COUNTS = ("global_batch", "micro_batches", "steps", "warmup_steps", "checkpoint_every",
           "eval_batches", "eval_every", "seq_len", "sync_every", "lora_rank", "outer_delay",
           "pipeline_delay")


def _values(kind: type[enum.StrEnum]) -> tuple[str, ...]:
    return tuple(m.value for m in kind)


def check_batch(global_batch: int, micro_batches: int, replicas: int) -> None:
    """Raise ValueError unless `global_batch` splits evenly into replicas x micro-batches.

    The one home of this rule: the worker cuts its replica's share into equal micro-batches,
    and the planner (`coordinator plan`) sizes activations from the same split.
    """
    for flag, value in (("--batch", global_batch), ("--micro-batches", micro_batches),
                        ("replicas", replicas)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    unit = replicas * micro_batches
    if global_batch % unit:
        raise ValueError(
            f"--batch {global_batch} does not split evenly into {counted(replicas, 'replica')} x "
            f"{micro_batches} micro-batches: it is not divisible by {unit}; use a multiple of "
            f"replicas x micro-batches = {unit}, such as {(global_batch // unit + 1) * unit}"
        )
