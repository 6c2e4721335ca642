"""Where a step's time goes: one split, measured by the workers and predicted by the step model.

Owns the arithmetic that turns a worker's step timers (`dtfm.core.events.StepEvent`) into
disjoint parts that add up to the measured step, and the names of those parts, so the
worker, the coordinator's status, `coordinator report` and `bench/sync.py` all read the
same split (issue 44: find where a slow link's lost time goes before attacking it).

The parts (seconds of one step, of one rank; a job's figure is the mean over its ranks):

- `compute`: forward and backward passes (without the data-parallel codec work that runs in
  backward's gradient hooks, which counts as `codec`);
- `pipeline_wait`: waiting for a pipeline neighbour's activations or gradients, and for this
  rank's own sends to drain. The worker cannot tell bytes still in flight (transfer) from a
  message not sent yet (latency, the pipeline filling and draining): the step model splits
  it (`Breakdown.transfer` and `latency_bubble` of a predicted split);
- `norm_wait`: the gradient-norm exchange that ends every step inside a pipeline: a rank
  waits there for the pipeline's last stage to finish (the drain: bubble and latency);
- `sync_wait`: waiting at the data-parallel average that backward did not hide, or, with
  local steps, the whole sync point (the outer step, its average and its wait for the
  slowest replica);
- `codec`: compressing and decompressing pipeline and data-parallel messages;
- `other`: the rest (the optimizer step, the data, clipping, Python), what the step model
  does not price.

A predicted split (`coordinator.scheduler.steptime.step_breakdown`) has `transfer` and
`latency_bubble` instead of `pipeline_wait` and `norm_wait`, and no `other`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields

from protos.dtfm.v1 import common_pb2

MEASURED = ("compute", "pipeline_wait", "norm_wait", "sync_wait", "codec", "other")
PREDICTED = ("compute", "transfer", "latency_bubble", "sync_wait", "codec", "other")


@dataclass(frozen=True)
class Breakdown:
    """A step (`step_s`) split into parts that add up to it (seconds)."""

    step_s: float = 0.0
    compute: float = 0.0
    pipeline_wait: float = 0.0  # measured: transfer + latency + bubble, not told apart
    norm_wait: float = 0.0  # measured: the norm exchange's wait for the pipeline's drain
    transfer: float = 0.0  # predicted: pipeline bytes on the wire
    latency_bubble: float = 0.0  # predicted: one-way delays, fill and drain, norm exchange
    sync_wait: float = 0.0
    codec: float = 0.0
    other: float = 0.0

    def parts(self) -> dict[str, float]:
        """Every part but the step itself."""
        return {k: v for k, v in asdict(self).items() if k != "step_s"}

    def total(self) -> float:
        return sum(self.parts().values())

    def minus(self, base: Breakdown) -> Breakdown:
        """This step's parts less `base`'s (the same job with the network removed): the time
        the network costs, part by part; their sum is the step's difference."""
        return Breakdown(**{f.name: getattr(self, f.name) - getattr(base, f.name)
                            for f in fields(self)})

    def to_json(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in asdict(self).items()}

    def to_proto(self) -> common_pb2.StepBreakdown:
        return common_pb2.StepBreakdown(**asdict(self))

    @classmethod
    def from_proto(cls, msg: common_pb2.StepBreakdown) -> Breakdown:
        return cls(**{f.name: getattr(msg, f.name) for f in fields(cls)})


FIELDS = tuple(f.name for f in fields(Breakdown))  # the step and every part, by name


def _num(value: object) -> float:
    """A timer's value; a missing or NaN one (an older worker's event) counts as 0."""
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else 0.0


def measured(ev: Mapping[str, object]) -> Breakdown:
    """The split of one step event (a `StepEvent`'s fields by name, as its JSON line has them).

    The worker's timers nest: `compute_s` holds the data-parallel codec work done in
    backward's hooks (`codec_hidden_s`); `dp_s` (synchronous) or `outer_s` (the sync point of
    local steps, which holds its own `dp_s`) holds the rest of the data-parallel codec work;
    `codec_s` is all codec work, of which `pp_codec_s` is the pipeline's. Each part here
    counts a second once, and `other` is what no timer holds, so the parts add up to
    `step_s` exactly."""
    step = _num(ev.get("step_s"))
    codec, pp_codec = _num(ev.get("codec_s")), _num(ev.get("pp_codec_s"))
    hidden = min(_num(ev.get("codec_hidden_s")), max(codec - pp_codec, 0.0))
    exposed_dp_codec = max(codec - pp_codec - hidden, 0.0)
    outer = _num(ev.get("outer_s"))
    sync = max((outer if outer > 0 else _num(ev.get("dp_s"))) - exposed_dp_codec, 0.0)
    compute = max(_num(ev.get("compute_s")) - hidden, 0.0)
    pipeline = _num(ev.get("recv_wait_s")) + _num(ev.get("send_wait_s"))
    if pipeline == 0.0:  # an event without the two (older readers): their sum
        pipeline = _num(ev.get("pp_wait_s"))
    norm = _num(ev.get("sync_s"))
    known = compute + pipeline + norm + sync + codec
    return Breakdown(step_s=step, compute=compute, pipeline_wait=pipeline, norm_wait=norm,
                     sync_wait=sync, codec=codec, other=step - known)


def mean(splits: Iterable[Breakdown]) -> Breakdown:
    """The part-by-part mean (a job's: over its ranks and steps); all zero for none."""
    items = list(splits)
    if not items:
        return Breakdown()
    return Breakdown(**{f.name: math.fsum(getattr(b, f.name) for b in items) / len(items)
                        for f in fields(Breakdown)})


def line(b: Breakdown, predicted: bool = False) -> str:
    """`0.98 s = compute 0.40 + pipeline wait 0.31 + ...`: the nonzero parts, for people."""
    names = PREDICTED if predicted else MEASURED
    words = {"pipeline_wait": "pipeline wait", "norm_wait": "norm exchange",
             "latency_bubble": "latency+bubble", "sync_wait": "sync wait"}
    parts = [f"{words.get(n, n)} {getattr(b, n):.2f}" for n in names
             if abs(getattr(b, n)) >= 0.005 or n == "compute"]
    return f"{b.step_s:.2f} s = " + " + ".join(parts)
