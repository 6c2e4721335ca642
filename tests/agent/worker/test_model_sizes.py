"""The planner's analytic sizes (dtfm.core.spec) equal what the torch model really holds."""

from __future__ import annotations

import pytest
import torch

from agent.worker.model import EMBEDDING_INDEX, HEAD_INDEX, build_part, param_count
from agent.worker.stage import Stage
from dtfm.core import hfconfig
from dtfm.core.hfconfig import part_tensors
from dtfm.core.layout import layer_ranges
from dtfm.core.presets import PRESETS, get_preset
from dtfm.core.spec import ModelSpec


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-mini", "gpt-small", "llama-tiny"])
def test_param_counts_match_spec(name: str) -> None:
    spec = get_preset(name)
    whole = Stage(spec, 0, spec.n_layers, seed=0)
    assert param_count(whole) == spec.param_count()
    for begin, end in layer_ranges(spec.n_layers, 3 if spec.n_layers >= 3 else 1):
        assert param_count(Stage(spec, begin, end, seed=0)) == spec.stage_params(begin, end)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_large_presets_per_layer_sizes(name: str) -> None:
    """Every preset, up to gpt-13b, built on the meta device (no memory) matches the spec."""
    spec = get_preset(name)
    with torch.device("meta"):
        from agent.worker.model import PART_CLASSES

        embedding, block, head = PART_CLASSES[spec.arch]
        assert param_count(block(spec)) == spec.layer_params()
        assert param_count(embedding(spec)) == spec.embedding_params()
        assert param_count(head(spec)) == spec.head_params()


SHAPES = [
    ModelSpec("gpt2-like", 300, 3, 48, 4, 16, activation="gelu_tanh", max_positions=40,
              norm_eps=1e-6),
    ModelSpec("gqa-bias-headdim", 300, 3, 48, 4, 16, d_ff=80, arch="llama", n_kv_heads=2,
              head_dim=10, qkv_bias=True),
    ModelSpec("mha-llama3", 300, 3, 48, 6, 16, d_ff=64, arch="llama", rope_type="llama3",
              rope_factor=8.0, rope_original_max_positions=32),
]


@pytest.mark.parametrize("spec", SHAPES, ids=lambda s: s.name)
def test_every_block_option_is_counted_and_named(spec: ModelSpec) -> None:
    """Sizes with every option of both blocks, and `hfconfig.part_tensors` names exactly the
    parameters `build_part` makes (the contract the checkpoint loader relies on)."""
    assert param_count(Stage(spec, 0, spec.n_layers, seed=0)) == spec.param_count()
    assert param_count(Stage(spec, 1, 2, seed=0)) == spec.stage_params(1, 2)
    for index in (EMBEDDING_INDEX, 0, spec.n_layers - 1, HEAD_INDEX):
        part = build_part(spec, index, seed=0)
        assert set(dict(part.named_parameters())) == set(part_tensors(spec, index))
    assert (hfconfig.EMBEDDING_INDEX, hfconfig.HEAD_INDEX) == (EMBEDDING_INDEX, HEAD_INDEX)


def test_gpt_1_3b_is_the_papers_shape_and_splits_on_5_stages() -> None:
    spec = get_preset("gpt-1.3b")
    assert (spec.n_layers, spec.d_model, spec.n_heads, spec.seq_len) == (24, 2048, 16, 2048)
    ranges = layer_ranges(spec.n_layers, 5)
    assert [e - b for b, e in ranges] == [5, 5, 5, 5, 4]
    assert 1.2e9 < spec.param_count() < 1.5e9


def test_activation_size_matches_the_tensor_a_stage_sends() -> None:
    spec = get_preset("gpt-tiny")
    first = Stage(spec, 0, 2, seed=0)
    tokens = torch.randint(0, spec.vocab_size, (3, spec.seq_len))
    hidden = first(tokens)
    assert hidden.numel() == spec.activation_elements(3)
    assert hidden.numel() * hidden.element_size() == spec.activation_bytes(3, "fp32")
    last = Stage(spec, 2, spec.n_layers, seed=0)
    assert last(hidden).shape == (3, spec.seq_len, spec.vocab_size)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_every_layout_builds_identical_weights(name: str) -> None:
    spec = get_preset(name)
    whole = Stage(spec, 0, spec.n_layers, seed=3).state_dict()
    parts: dict[str, torch.Tensor] = {}
    for begin, end in [(0, 1), (1, 4)]:
        parts.update(Stage(spec, begin, end, seed=3).state_dict())
    assert parts.keys() == whole.keys()
    for k, v in whole.items():
        assert torch.equal(v, parts[k]), k
    other = Stage(spec, 0, spec.n_layers, seed=4).state_dict()
    weight = "layers.0.attn.qkv.weight" if spec.arch == "gpt" else "layers.0.attn.q_proj.weight"
    assert not torch.equal(other[weight], whole[weight])
    # Layers differ from one another (per-layer generators are distinct).
    assert not torch.equal(whole[weight], whole[weight.replace("0", "1", 1)])
