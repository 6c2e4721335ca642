"""`NAME:seq=N`: a preset on shorter (or longer) sequences, the same layers otherwise.

The headline model's parameters fit this machine once AdamW's moments are bf16, but its
2048-token activations do not; `gpt-1.3b:seq=512` is how a run says so, in every program that
takes a model name, since each of them asks `get_preset`.
"""

from __future__ import annotations

import pytest

from coordinator.daemon.config import JobConfig
from dtfm.core.presets import get_preset
from dtfm.core.spec import ModelSpec, TrainConfig


def test_the_suffix_changes_only_the_sequence_and_names_itself() -> None:
    full, short = get_preset("gpt-1.3b"), get_preset("gpt-1.3b:seq=512")
    assert short.seq_len == 512 and short.name == "gpt-1.3b:seq=512"
    assert (short.n_layers, short.d_model, short.vocab_size) == (
        full.n_layers, full.d_model, full.vocab_size)
    assert full.param_count() - short.param_count() == (2048 - 512) * full.d_model  # positions
    assert ModelSpec.from_proto(short.to_proto()) == short  # what a worker builds from


@pytest.mark.parametrize("name", ["gpt-1.3b:seq=0", "gpt-1.3b:seq=", "gpt-1.3b:seq=x",
                                  "gpt-1.3b:seq=99999999"])
def test_a_bad_length_is_refused_with_an_example(name: str) -> None:
    with pytest.raises(ValueError, match=r"integer from 1 to 65536, e\.g\. gpt-1\.3b:seq=512"):
        get_preset(name)


def test_an_unknown_base_lists_the_presets_and_the_suffix() -> None:
    with pytest.raises(ValueError, match=r"unknown model preset 'gpt-9b'.*append :seq=N"):
        get_preset("gpt-9b:seq=512")


def test_the_coordinator_accepts_it() -> None:
    JobConfig(model="gpt-1.3b:seq=512", agents=8, stages=8,
              train=TrainConfig(global_batch=1, micro_batches=1)).validate()
