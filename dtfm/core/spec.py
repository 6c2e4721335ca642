"""The model spec and training config: what a job trains, shared by planner and worker.

The planner needs sizes (parameters per stage, activation bytes between stages) and the worker
needs a shape to build; both read the same `ModelSpec`, so a test can pin that the analytic
sizes here equal what the torch model really holds. The GPT these formulas describe:

- token embedding `V x d` and learned position embedding `T x d` (first stage),
- per layer: LayerNorm(d) -> causal self-attention (qkv Linear d->3d with bias, out Linear d->d
  with bias) -> residual; LayerNorm(d) -> MLP (Linear d->ff with bias, GELU, Linear ff->d with
  bias) -> residual,
- final LayerNorm(d) and an untied LM head Linear d->V without bias (last stage).

Pure Python: no torch, no grpc; `to_proto`/`from_proto` import the generated messages lazily.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # what the cost model can size
TRAIN_DTYPES = ("fp32", "bf16")  # what the worker trains in (its autocast_dtype)
UINT32 = 2**32 - 1
_COUNTS = ("global_batch", "micro_batches", "steps", "warmup_steps", "checkpoint_every",
           "eval_batches")
SCHEDULES = ("gpipe", "1f1b")
DP_MODES = ("allreduce", "sharded")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only GPT's shape."""

    name: str
    vocab_size: int
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    d_ff: int = 0  # 0 means 4 * d_model

    def __post_init__(self) -> None:
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        for name in ("vocab_size", "n_layers", "d_model", "n_heads", "seq_len", "d_ff"):
            if getattr(self, name) < 1:
                raise ValueError(f"model spec {self.name!r}: {name} must be >= 1")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model spec {self.name!r}: d_model={self.d_model} is not divisible by "
                f"n_heads={self.n_heads}"
            )

    # --- analytic sizes (must equal the torch model; tests pin it) ---
    def embedding_params(self) -> int:
        return self.vocab_size * self.d_model + self.seq_len * self.d_model

    def layer_params(self) -> int:
        d, ff = self.d_model, self.d_ff
        attn = d * 3 * d + 3 * d + d * d + d
        mlp = d * ff + ff + ff * d + d
        norms = 2 * 2 * d
        return attn + mlp + norms

    def head_params(self) -> int:
        return 2 * self.d_model + self.d_model * self.vocab_size

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
        return cls(**{f.name: getattr(msg, f.name) for f in fields(cls)})


@dataclass
class TrainConfig:
    """How to train. Mirrors `dtfm.v1.TrainConfig` field for field."""

    global_batch: int = 8
    micro_batches: int = 2
    steps: int = 100
    seed: int = 0
    schedule: str = "gpipe"
    dp_mode: str = "sharded"  # the paper's; two hops of latency where a ring takes 2(R-1)
    lr: float = 1e-3
    warmup_steps: int = 10
    grad_clip: float = 1.0
    weight_decay: float = 0.1
    data_path: str = ""
    checkpoint_dir: str = ""
    dtype: str = "fp32"
    checkpoint_every: int = 0
    eval_batches: int = 4
    extra: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def validate(self, replicas: int = 1) -> None:
        """Raise ValueError with an actionable message for an inconsistent config."""
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.dp_mode not in DP_MODES:
            raise ValueError(f"dp_mode must be one of {DP_MODES}, got {self.dp_mode!r}")
        if self.dtype not in TRAIN_DTYPES:
            raise ValueError(f"dtype must be one of {TRAIN_DTYPES} (the worker trains in "
                             f"nothing else), got {self.dtype!r}")
        self._check_ranges()
        if self.global_batch % replicas:
            raise ValueError(
                f"global batch {self.global_batch} is not divisible by {replicas} replicas"
            )
        per_replica = self.global_batch // replicas
        if per_replica % self.micro_batches:
            raise ValueError(
                f"each replica's batch of {per_replica} sequences is not divisible into "
                f"{self.micro_batches} micro-batches; pick a global batch that is a multiple "
                f"of replicas x micro-batches = {replicas * self.micro_batches}"
            )

    def _check_ranges(self) -> None:
        for name in _COUNTS:
            value = getattr(self, name)
            if not 0 <= value <= UINT32:
                raise ValueError(f"{name} must be in 0..{UINT32}, got {value}")
        if self.global_batch < 1 or self.micro_batches < 1:
            raise ValueError("global_batch and micro_batches must be >= 1")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in 0..2**64-1, got {self.seed}")
        for name in ("lr", "grad_clip", "weight_decay"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.lr <= 0 or self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError("lr must be > 0, grad_clip and weight_decay >= 0")

    def to_proto(self) -> Any:
        from protos.dtfm.v1 import common_pb2

        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return common_pb2.TrainConfig(**values)

    @classmethod
    def from_proto(cls, msg: Any) -> TrainConfig:
        return cls(**{f.name: getattr(msg, f.name) for f in fields(cls) if f.name != "extra"})
