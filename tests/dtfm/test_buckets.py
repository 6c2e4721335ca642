"""Bucket and shard sizes of the data-parallel exchange: the worker cuts its gradients with
these and the step model replays the same cuts, so both are pinned here; the coordinator's
shares reach each worker through `build_assignments`."""

from __future__ import annotations

import pytest

from dtfm.core.assignment import build_assignments
from dtfm.core.buckets import (
    MAX_BUCKET_BYTES,
    MIN_BUCKET_BYTES,
    check_shares,
    dp_bucket_bytes,
    dp_bucket_count,
    shard_sizes,
)
from dtfm.core.layout import Layout
from dtfm.core.spec import ModelSpec, TrainConfig


def test_a_stage_is_cut_into_about_eight_buckets_within_bounds() -> None:
    assert dp_bucket_bytes(1.6e6) == 200_000 and dp_bucket_count(1.6e6) == 8
    assert dp_bucket_bytes(10) == MIN_BUCKET_BYTES and dp_bucket_count(10) == 1
    assert dp_bucket_bytes(1e9) == MAX_BUCKET_BYTES and dp_bucket_count(1e9) == 239


def test_shards_follow_the_shares_and_add_up() -> None:
    assert shard_sizes(12, [1, 1, 1]) == [4, 4, 4]
    assert shard_sizes(10, [1, 1, 1]) == [4, 3, 3]  # ties: the lower replica first
    assert shard_sizes(10, [0.2, 0.0, 0.8]) == [2, 0, 8]
    assert shard_sizes(7, [0.0, 1.0]) == [0, 7]
    for n in (0, 1, 5, 97, 1000):
        sizes = shard_sizes(n, [0.1, 0.25, 0.0, 0.65])
        assert sum(sizes) == n and sizes[2] == 0


def test_bad_shares_are_refused_with_what_is_wrong() -> None:
    assert check_shares([1, 0], 2) == [1.0, 0.0]
    with pytest.raises(ValueError, match="3 data-parallel shares for 2 replicas"):
        check_shares([0.2, 0.3, 0.5], 2)
    with pytest.raises(ValueError, match="positive sum"):
        check_shares([0.0, 0.0], 2)
    with pytest.raises(ValueError, match=">= 0"):
        check_shares([1.5, -0.5], 2)


def test_assignments_carry_their_stages_shares() -> None:
    spec = ModelSpec("t", vocab_size=256, n_layers=4, d_model=32, n_heads=4, seq_len=16)
    kw = dict(job_id="j", epoch=1, layout=Layout(stages=2, replicas=2), spec=spec,
              train=TrainConfig(global_batch=8, micro_batches=2), master_addr="127.0.0.1",
              master_port=1234)
    out = build_assignments(**kw, dp_shares=[[0.25, 0.75], [1.0, 0.0]])  # type: ignore[arg-type]
    assert [list(a.dp_shares) for a in out] == [[0.25, 0.75], [1.0, 0.0]] * 2  # rank order
    assert all(not a.dp_shares for a in build_assignments(**kw))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shares for 1 stage, the layout has 2"):
        build_assignments(**kw, dp_shares=[[0.5, 0.5]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="3 data-parallel shares for 2 replicas"):
        build_assignments(**kw, dp_shares=[[0.5, 0.5], [0.2, 0.3, 0.5]])  # type: ignore[arg-type]
