"""The committed stubs match the .proto files; the layout's rank arithmetic holds."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dtfm.core.assignment import build_assignments
from dtfm.core.layout import Layout, layer_ranges, layer_splits
from dtfm.core.spec import ModelSpec, TrainConfig


def test_generated_stubs_are_up_to_date() -> None:
    out = subprocess.run([sys.executable, "-m", "protos.generate", "--check"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_layout_round_trips_and_groups() -> None:
    layout = Layout(stages=3, replicas=2)
    assert layout.world_size == 6
    for rank in range(6):
        assert layout.rank(*layout.coords(rank)) == rank
    assert layout.rank(stage=1, replica=1) == 4  # rank = replica * stages + stage
    assert layout.dp_ranks(2) == [2, 5]
    assert layout.pipeline_ranks(1) == [3, 4, 5]
    assert layout.prev_rank(3) is None and layout.next_rank(5) is None
    assert layout.next_rank(3) == 4 and layout.prev_rank(4) == 3
    grid = [["a", "b"], ["c", "d"], ["e", "f"]]
    assert layout.devices_by_rank(grid) == ["a", "c", "e", "b", "d", "f"]
    with pytest.raises(ValueError):
        layout.devices_by_rank([["a", "b"]])
    with pytest.raises(ValueError):
        Layout(0, 1)


def test_layer_splits() -> None:
    assert layer_splits(24, 5) == [5, 5, 5, 5, 4]
    assert layer_ranges(4, 2) == [(0, 2), (2, 4)]
    assert layer_splits(6, 2, [1, 5]) == [1, 5]
    with pytest.raises(ValueError, match="at most 4 stages"):
        layer_splits(4, 5)
    with pytest.raises(ValueError, match="summing to 6"):
        layer_splits(6, 2, [1, 4])


def test_assignments_cover_the_layout() -> None:
    spec = ModelSpec("t", vocab_size=256, n_layers=5, d_model=32, n_heads=4, seq_len=16)
    layout = Layout(stages=2, replicas=2)
    out = build_assignments(job_id="j", epoch=1, layout=layout, spec=spec,
                            train=TrainConfig(global_batch=8, micro_batches=2),
                            master_addr="127.0.0.1", master_port=1234)
    assert [a.rank for a in out] == [0, 1, 2, 3]
    assert [(a.layer_begin, a.layer_end) for a in out] == [(0, 3), (3, 5)] * 2
    assert list(out[1].dp_group_ranks) == [1, 3]
    assert (out[2].prev_rank, out[2].next_rank) == (-1, 3)
    assert ModelSpec.from_proto(out[0].model) == spec
    assert TrainConfig.from_proto(out[0].train) == TrainConfig(global_batch=8, micro_batches=2)
    with pytest.raises(ValueError, match="multiple of replicas x micro-batches"):
        build_assignments(job_id="j", epoch=1, layout=layout, spec=spec,
                          train=TrainConfig(global_batch=6, micro_batches=2),
                          master_addr="127.0.0.1", master_port=1)
