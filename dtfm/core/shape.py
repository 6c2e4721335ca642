"""Which stages x replicas shape a job takes when the operator does not say.

Owns the one rule (as square as possible, stages >= replicas, no more stages than layers) that
both the job and `coordinator plan` apply, and the rule an elastic job shrinks by when agents
are lost (`elastic_layout`: fewer replicas first, then fewer stages).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dtfm.core.layout import Layout


def pick_shape(n: int, max_stages: int | None = None) -> tuple[int, int]:
    """A factorization n = stages x replicas: stages >= replicas, as square as possible."""
    best = (n, 1)
    for s in range(1, n + 1):
        if n % s:
            continue
        r = n // s
        if s < r or (max_stages is not None and s > max_stages):
            continue
        if abs(math.log(s / r)) < abs(math.log(best[0] / best[1])) or best[0] > (
            max_stages or n
        ):
            best = (s, r)
    if max_stages is not None and best[0] > max_stages:
        for s in range(min(n, max_stages), 0, -1):
            if n % s == 0:
                return s, n // s
    return best


def choose_layout(agents: int, n_layers: int, stages: int = 0, replicas: int = 0) -> Layout:
    """stages x replicas for `agents` devices: as given, else as `coordinator plan` picks."""
    if stages and replicas:
        return Layout(stages, replicas)
    if stages:
        return Layout(stages, agents // stages)
    if replicas:
        return Layout(agents // replicas, replicas)
    return Layout(*pick_shape(agents, max_stages=n_layers))


# Whether a layout's stages fit the devices at hand, given its micro-batches per replica: the
# coordinator's memory model answers it (`dtfm.core` cannot import the scheduler).
FitsFn = Callable[[Layout, int], bool]


def elastic_layout(alive: int, stages: int, replicas: int, global_batch: int,
                   micro_batches: int, *, fits: FitsFn | None = None) -> tuple[Layout, int] | None:
    """The layout to continue on with `alive` agents when the job wants stages x replicas,
    and the micro-batches per replica that keep the global batch (so the loss curve and the
    learning-rate schedule do not jump): None when no layout fits, so the job waits.

    Fewer replicas first, on the same stages: survivors keep the stage whose checkpoints they
    hold and nothing is re-cut. Only when too few agents remain for one replica of every stage
    fewer stages, most first, the layers cut anew; workers then read their layers from the
    old stages' checkpoints (the assignment's `checkpoint_splits`). Replicas never exceed the
    wanted count. `fits(layout, micro)` says whether a layout's stages fit the devices'
    memory (fewer stages hold more layers each); a layout that does not is skipped. Each
    micro-batch keeps its size (its sequences) where the numbers divide; a replica then runs
    more micro-batches, which also fills the pipeline better."""
    if stages < 1 or replicas < 1 or alive < 1:
        return None
    micro_size = global_batch // (replicas * micro_batches)
    for s in range(min(stages, alive), 0, -1):
        for r in range(min(replicas, alive // s), 0, -1):
            if global_batch % r:
                continue
            per_replica = global_batch // r
            micro = per_replica // micro_size if micro_size and per_replica % micro_size == 0 \
                else micro_batches
            while micro > 1 and per_replica % micro:
                micro -= 1
            layout, micro = Layout(s, r), max(micro, 1)
            if fits is None or fits(layout, micro):
                return layout, micro
    return None
