"""The layout an elastic job continues on (`dtfm.core.shape.elastic_layout`) and where a stage
resumes from after its layers were cut anew (`dtfm.core.checkpoints.sources`, the
assignment's `checkpoint_splits`). Pure functions: no torch, no processes."""

from __future__ import annotations

import pytest

from dtfm.core.assignment import build_assignments
from dtfm.core.checkpoints import Source, sources
from dtfm.core.layout import Layout
from dtfm.core.presets import get_preset
from dtfm.core.shape import elastic_layout
from dtfm.core.spec import TrainConfig


def test_fewer_replicas_come_before_fewer_stages() -> None:
    # 2x3 wanted, 12 sequences in micro-batches of 2: 4 agents keep both stages
    assert elastic_layout(4, 2, 3, 12, 2) == (Layout(2, 2), 3)
    assert elastic_layout(2, 2, 3, 12, 2) == (Layout(2, 1), 6)


def test_too_few_agents_for_every_stage_gives_fewer_stages() -> None:
    assert elastic_layout(1, 2, 1, 4, 2) == (Layout(1, 1), 2)
    assert elastic_layout(2, 3, 1, 6, 3) == (Layout(2, 1), 3)
    # 3 agents of a 4x2 job: 3 stages, never more replicas than the job wants
    assert elastic_layout(3, 4, 2, 8, 2) == (Layout(3, 1), 4)
    assert elastic_layout(0, 2, 1, 4, 2) is None


def test_the_global_batch_is_kept_and_micro_batches_keep_their_size() -> None:
    for alive in range(1, 7):
        found = elastic_layout(alive, 2, 3, 12, 2)
        assert found is not None
        layout, micro = found
        assert layout.stages * layout.replicas <= alive
        per_replica = 12 // layout.replicas
        assert per_replica * layout.replicas == 12 and per_replica // micro == 2


def test_a_layout_that_does_not_fit_memory_is_skipped() -> None:
    seen: list[tuple[Layout, int]] = []

    def fits(layout: Layout, micro: int) -> bool:
        seen.append((layout, micro))
        return layout.stages >= 2  # one device cannot hold the whole model

    assert elastic_layout(2, 3, 1, 6, 3, fits=fits) == (Layout(2, 1), 3)
    assert elastic_layout(1, 3, 1, 6, 3, fits=fits) is None  # wait for agents instead
    assert seen[-1] == (Layout(1, 1), 3)


def test_a_stage_resumes_from_every_old_stage_that_held_its_layers() -> None:
    # same split: its own folder
    assert sources(4, 1, (2, 4)) == [Source(1, (2, 4))]
    # 2 stages -> 1: both old stages
    assert sources(4, 0, (0, 4), [2, 2]) == [Source(0, (0, 2)), Source(1, (2, 4))]
    # 1 stage -> 2: each reads the one old stage
    assert sources(4, 1, (2, 4), [4]) == [Source(0, (0, 4))]
    # uneven 3 -> 2: layers [0, 2) came from old stage 0, [2, 4) from stages 1 and 2
    assert sources(4, 0, (0, 2), [2, 1, 1]) == [Source(0, (0, 2))]
    assert sources(4, 1, (2, 4), [2, 1, 1]) == [Source(1, (2, 3)), Source(2, (3, 4))]
    assert sources(4, 0, (0, 3), [1, 3]) == [Source(0, (0, 1)), Source(1, (1, 4))]
    with pytest.raises(ValueError, match="summing to 4"):
        sources(4, 0, (0, 4), [2, 3])


def test_assignments_name_the_old_split_only_when_it_differs() -> None:
    spec = get_preset("gpt-tiny")
    train = TrainConfig(global_batch=4, micro_batches=2, steps=4, checkpoint_every=2)

    def build(layout: Layout, old: list[int] | None) -> list[list[int]]:
        return [list(a.checkpoint_splits) for a in build_assignments(
            job_id="j", epoch=2, layout=layout, spec=spec, train=train,
            master_addr="127.0.0.1", master_port=29500, checkpoint_splits=old)]

    assert build(Layout(1, 1), [2, 2]) == [[2, 2]]
    assert build(Layout(2, 1), [4]) == [[4], [4]]
    assert build(Layout(2, 1), [2, 2]) == [[], []]  # the same cut: nothing to re-split
    assert build(Layout(2, 1), None) == [[], []]
    with pytest.raises(ValueError, match="summing to 4"):
        build(Layout(1, 1), [3, 3])
