"""The `--verify` levels: which replica checks a worker runs, and which dp mode each needs.

Owned here, apart from `spec.py`, because the worker, the flag table, the scheduler's step
model and the job validation all read the same rule: a gradient copy can be scored only where
one replica (the shard's owner) holds every replica's copy, which `--dp-mode sharded` does and
a ring all-reduce (which sums in flight) does not. Pure Python.

- `off`: no checks.
- `digest`: every `DIGEST_EVERY` synchronous steps (and at every sync point with
  `--sync-every`, and after the last step) the replicas of a stage exchange a hash of their
  weights, which must be bit-identical; the odd one out is named (R >= 3). And every worker
  reports what crossed its pipeline links (`LINK_WINDOW`), which the coordinator checks from
  both ends (coordinator/integrity/linkwitness.py): a sum of squares per message.
- `full`: `digest`, and each shard owner scores every replica's copy of its shard (norm
  against the median norm, cosine against the coordinate-wise median, an exact repeat of the
  previous step's copy). Needs `--dp-mode sharded`.
- `robust`: `full`, and the owner averages with CenteredClip instead of the plain mean, so
  one bad copy moves the average by a bounded amount even before it is caught (the average
  then differs from the exact mean on honest steps too: an option, not the default).
- `auto` (the default): `full` under `--dp-mode sharded`, `digest` under `allreduce`.
"""

from __future__ import annotations

import enum

DIGEST_EVERY = 10  # synchronous steps between two weight digests (cost: bench/integrity.py)
# R = 2: steps whose pair scores one verdict takes the median of (agent/worker/pairscore.py);
# an attack from step s is seen from step s + PAIR_WINDOW // 2. 9, not 5: an honest pair of a
# fine-tuned import at 4 sequences per replica had one copy 6-19x the other's norm at 4 steps
# in a row (docs/architecture.md, "R = 2"), which a window of 5 took for an attack
PAIR_WINDOW = 9
# R >= 3: steps whose best cosines and quiet-energy ratios a copy is judged on the median of
# (agent/worker/scorewindow.py); a `grad_noise` record of step s may be the window's verdict,
# which an attack from s - COPY_WINDOW + 1 on can have crossed
COPY_WINDOW = 5
# pipeline links (coordinator/integrity/linkwitness.py): each worker reports, for the windows
# of steps that end at multiples of LINK_WINDOW, the median over the window of what it sent
# and received; an attack from step s fills a window's majority by s + LINK_WINDOW + 2
LINK_WINDOW = 5
# the records a window of pipeline-link figures makes (coordinator/integrity/linkwitness.py)
LINK_KINDS = frozenset({"act_scaled", "act_zero", "actgrad_scaled", "actgrad_zero",
                        "act_disagree", "link_disagree"})
# a receiver whose weights the digest found odd and the owner of the average it got another
# of (agent/worker/replicacheck.py): a record of this kind is a dispute between its reporter
# and its suspect rank, one of whom made it up (coordinator/integrity/dispute.py), and its
# step is the exchange's, the first the receiver's weights can differ at
AVG_DISAGREE = "avg_disagree"
# the rank whose squared norm made its pipeline's weights differ from its replicas'
# (agent/worker/normtable.py): confirmed once its own stage's records explain nothing
# (coordinator/integrity/explained.py)
NORM_DIFFERS = "norm_differs"
# a rank's norm that differs, seen by one stage only (coordinator/integrity/explained.py):
# the odd replica that shows it and the rank it names are a dispute the coordinator opens, one
# of whom made it up (a drifted replica that writes another norm in its own table, or a rank
# that sent its pipeline another norm), settled by parting them into different pipelines
NORM_DISAGREE = "norm_disagree"
# kinds whose record names the pair of its reporter and its suspect, not a suspect
REPORTER_PAIRS = frozenset({AVG_DISAGREE})


class Verify(enum.StrEnum):
    AUTO = "auto"
    OFF = "off"
    DIGEST = "digest"
    FULL = "full"
    ROBUST = "robust"


def scores(level: Verify) -> bool:
    """Whether `level` scores gradient copies at their owner."""
    return level in (Verify.FULL, Verify.ROBUST)


def resolve(verify: str, dp_mode: str) -> Verify:
    """The level a worker runs: `auto` made concrete for `dp_mode`."""
    level = Verify(verify or Verify.AUTO)
    if level == Verify.AUTO:
        return Verify.FULL if dp_mode == "sharded" else Verify.DIGEST
    return level


def check(verify: str, dp_mode: str) -> None:
    """Raise ValueError, naming the flags, for a level the dp mode cannot give."""
    if verify in (Verify.FULL, Verify.ROBUST) and dp_mode != "sharded":
        raise ValueError(
            f"--verify {verify} scores each replica's gradient copy where its shard's owner "
            f"receives every copy, and --dp-mode {dp_mode} has no owner (a ring all-reduce "
            f"sums in flight): use --dp-mode sharded (the default), or --verify digest to "
            f"check only the replicas' weights")


def onset(kind: str, step: int, sync_every: int = 1) -> int:
    """The earliest step at which what a `kind` record of `step` saw can have begun: the
    bound a rollback must resume before (coordinator/integrity/).

    A one-step check names the step it saw. A weights digest is compared only every
    `DIGEST_EVERY` synchronous steps (every sync point with local steps), so weights that
    differ at `step` may have drifted any time after the previous comparison, and the
    honest replicas' later steps averaged the drifted replica's gradients (so too a norm
    that one stage's odd replica shows: its step is the odd replica's word). An R = 2 pair
    verdict is a median over the last `PAIR_WINDOW` steps: it can cross at the window's
    middle bad step, never before the window's first; so is a pipeline link's window
    (`LINK_WINDOW`), and an R >= 3 copy's direction and quiet energy (`COPY_WINDOW`)."""
    if kind in ("weights", "weights_disagree", NORM_DISAGREE):  # a digest's odd replica
        back = sync_every if sync_every > 1 else DIGEST_EVERY
    elif kind == "grad_disagree":
        back = PAIR_WINDOW
    elif kind in ("grad_noise", "grad_cosine"):
        back = COPY_WINDOW
    elif kind in LINK_KINDS:
        back = LINK_WINDOW
    else:
        back = 1
    return max(step - back + 1, 1)
