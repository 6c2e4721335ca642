"""FLOPs of one stage's forward and backward pass: what the compute and step models divide by
each device's FLOP/s.

One place for the count, because two models read it: `compute` (each tasklet's seconds, the
layer split) and `steptime` (how a tasklet's compute splits into its forward and backward
passes on the pipeline's timeline), and `steptime` cannot import `compute`, which imports it.

Per token, a dense matmul costs 2 FLOPs per weight forward and 4 backward (2 for the gradient
of its input, 2 for the gradient of its weight), so 6 per weight in all; attention's scores and
their use cost 4 x seq x heads x head_dim per layer forward and twice that backward (it has no
weights, but both of its inputs need gradients). Under LoRA (`lora_rank` > 0) the base is
frozen: no weight gradient, so each base weight (the head's too: it stays frozen) costs 2
forward and 2 backward, 4 in all, while each adapter number (R x (in + out) per targeted
projection, `dtfm.core.lora`) costs the full 6. Backward is then about one forward, not two:
a LoRA stage computes about 2/3 of full fine-tuning's FLOPs, and forward is about half of them
instead of a third. Pinned against torch's own FLOP counter by
tests/coordinator/scheduler/test_flops.py.

Left out (small beside the matmuls): elementwise work, norms, the embedding lookup (no matmul),
and, on the first stage under LoRA, the input gradient the first projection of layer 0 need not
compute (the frozen embedding's output wants none).

Pure Python: no torch, numpy or protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtfm.core.lora import stage_adapter_params
from dtfm.core.spec import ModelSpec

FORWARD_PER_WEIGHT = 2.0  # FLOPs per weight and token, forward
INPUT_GRAD_PER_WEIGHT = 2.0  # backward: the gradient of the matmul's input
WEIGHT_GRAD_PER_WEIGHT = 2.0  # backward: the gradient of the weight (none when frozen)
FLOPS_PER_PARAM_TOKEN = FORWARD_PER_WEIGHT + INPUT_GRAD_PER_WEIGHT + WEIGHT_GRAD_PER_WEIGHT
ATTENTION_FORWARD = 4.0  # x seq x heads x head_dim per layer and token; backward twice that
FULL_FORWARD_SHARE = 1.0 / 3.0  # full fine-tuning: backward costs twice the forward pass


@dataclass(frozen=True)
class StageFlops:
    """One stage's FLOPs for some number of tokens, by pass."""

    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward

    @property
    def forward_share(self) -> float:
        """Forward's part of the stage's compute (1/3 for full fine-tuning)."""
        return self.forward / self.total if self.total > 0 else FULL_FORWARD_SHARE


def stage_flops_by_pass(spec: ModelSpec, begin: int, end: int, tokens: float,
                        lora_rank: int = 0, lora_targets: str = "") -> StageFlops:
    """Forward and backward FLOPs of layers [begin, end) (and the head, if last) for `tokens`,
    with the base frozen and adapters trained under `lora_rank` > 0."""
    weights = (end - begin) * spec.layer_matmul_params()
    if end == spec.n_layers:
        weights += spec.d_model * spec.vocab_size
    attention = (end - begin) * ATTENTION_FORWARD * spec.seq_len * spec.n_heads * spec.head_size
    adapters = stage_adapter_params(spec, begin, end, lora_rank, lora_targets)
    weight_grad = 0.0 if lora_rank else WEIGHT_GRAD_PER_WEIGHT
    forward = FORWARD_PER_WEIGHT * (weights + adapters) + attention
    backward = ((INPUT_GRAD_PER_WEIGHT + weight_grad) * weights
                + (INPUT_GRAD_PER_WEIGHT + WEIGHT_GRAD_PER_WEIGHT) * adapters + 2 * attention)
    return StageFlops(tokens * forward, tokens * backward)


def stage_flops(spec: ModelSpec, begin: int, end: int, tokens: float, lora_rank: int = 0,
                lora_targets: str = "") -> float:
    """Forward + backward FLOPs of layers [begin, end) (and the head, if last) for `tokens`:
    6 per weight and token plus attention for full fine-tuning (`stage_flops_by_pass`)."""
    return stage_flops_by_pass(spec, begin, end, tokens, lora_rank, lora_targets).total
