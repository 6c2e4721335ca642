"""The planner's analytic sizes (dtfm.core.spec) equal what the torch model really holds."""

from __future__ import annotations

import pytest
import torch

from agent.worker.model import param_count
from agent.worker.stage import Stage
from dtfm.core.layout import layer_ranges
from dtfm.core.presets import PRESETS, get_preset


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-mini", "gpt-small"])
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
        from agent.worker.model import Block, Embedding, Head

        assert param_count(Block(spec)) == spec.layer_params()
        assert param_count(Embedding(spec)) == spec.embedding_params()
        assert param_count(Head(spec)) == spec.head_params()


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


def test_every_layout_builds_identical_weights() -> None:
    spec = get_preset("gpt-tiny")
    whole = Stage(spec, 0, spec.n_layers, seed=3).state_dict()
    parts: dict[str, torch.Tensor] = {}
    for begin, end in [(0, 1), (1, 4)]:
        parts.update(Stage(spec, begin, end, seed=3).state_dict())
    assert parts.keys() == whole.keys()
    for k, v in whole.items():
        assert torch.equal(v, parts[k]), k
    other = Stage(spec, 0, spec.n_layers, seed=4).state_dict()
    assert not torch.equal(other["layers.0.attn.qkv.weight"], whole["layers.0.attn.qkv.weight"])
    # Layers differ from one another (per-layer generators are distinct).
    assert not torch.equal(whole["layers.0.mlp.fc.weight"], whole["layers.1.mlp.fc.weight"])
