"""The step's global gradient norm and loss from the pipeline's exchanged values, checked.

Every pipeline rank sends its stage's squared gradient norm (and the last stage its loss) to
every other (`world.World.pipeline_exchange`); each sums the squares in stage order. Those
numbers come from peers, and a peer can be wrong: a bug, a faulty device, a tampered worker.
Before, a peer that sent its values times -4 made an honest rank take the square root of a
negative sum: `ValueError: math domain error`, which the worker classed as `config`, and the
coordinator failed the job as "the job's configuration is invalid".

So the values are checked for what they must be before anything is computed from them:

- this rank's own first: its squared norm (and, on the last stage, its loss) not finite is
  `errors.NonFiniteLoss` as before (kind `config`: diverged, or NaN starting weights; every
  rank of a diverged pipeline computes non-finite values itself, so each says so);
- then each peer's: a squared norm must be finite and >= 0, the last stage's loss finite.
  One that is not is a `BadPeerValue` (a `PeerError` of kind `bad_value`: the coordinator
  recovers the job, and names it over the sender's own `peer` error) that names the sending
  rank, stage and replica.
"""

from __future__ import annotations

import math

from agent.worker import errors


class BadPeerValue(errors.PeerError):
    """A peer sent a value that it cannot honestly have computed; names the sender."""

    kind = errors.BAD_VALUE

    def __init__(self, me: int, sender: int, where: str, what: str, value: float,
                 step: int) -> None:
        self.sender, self.value = sender, value
        super().__init__(
            f"rank {me}: rank {sender} ({where}) sent {what} {value!r} at step {step}: "
            f"a value no honest worker computes, so rank {sender}'s worker or agent sends "
            f"wrong numbers (a faulty device, a bug, or a tampered worker), not this job's "
            f"configuration. The job recovers; if rank {sender}'s agent is named again, "
            f"stop that agent")


def checked(table: list[list[float]], pipeline: list[int], me: int, replica: int, step: int
            ) -> tuple[float, float]:
    """(global gradient norm, loss) from `table`: each pipeline rank's [squared norm, loss]
    in stage order (`pipeline` lists their ranks alike, all of `replica`; the loss is the
    last stage's).
    Raises `errors.NonFiniteLoss` for this rank's own non-finite values, `BadPeerValue` for
    a peer's impossible one."""
    sq = [row[0] for row in table]
    loss = table[-1][1]
    mine = pipeline.index(me)
    if not math.isfinite(sq[mine]) or (mine == len(table) - 1 and not math.isfinite(loss)):
        total = sum(sq)
        raise errors.NonFiniteLoss(step, loss, math.sqrt(total) if total >= 0 else math.nan)
    for stage, (rank, value) in enumerate(zip(pipeline, sq, strict=True)):
        if rank != me and not (math.isfinite(value) and value >= 0):
            raise BadPeerValue(me, rank, f"stage {stage}, replica {replica}",
                               "a squared gradient norm of", value, step)
    if not math.isfinite(loss):
        raise BadPeerValue(me, pipeline[-1], f"stage {len(pipeline) - 1}, replica {replica}",
                           "a loss of", loss, step)
    norm = math.sqrt(sum(sq))  # in stage order: the same bits on every rank
    if not math.isfinite(norm):  # finite squares whose sum overflows: diverged
        raise errors.NonFiniteLoss(step, loss, norm)
    return norm, loss
