"""`--eval-every N`: a real `agent local` run evaluates the validation split every N steps and
after the last, reports each loss live, and trains exactly as the same run without it."""

from __future__ import annotations

import pytest

from tests.agent.worker.testlib import run_local

FLAGS = ("--model", "gpt-tiny", "--stages", "2", "--replicas", "2", "--batch", "4",
         "--steps", "7", "--eval-batches", "2", "--seed", "3", "--warmup-steps", "2")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("extra", [
    (),
    # local steps (an evaluation in the middle of a round) with error-feedback compression
    ("--sync-every", "2", "--dp-compress", "int8"),
], ids=["synchronous", "local-steps-int8"])
def test_validation_every_n_steps_leaves_training_bit_identical(extra: tuple[str, ...]
                                                                 ) -> None:
    plain = run_local(*FLAGS, *extra)
    assert plain.rc == 0, plain.stderr
    evaluated = run_local(*FLAGS, *extra, "--eval-every", "3")
    assert evaluated.rc == 0, evaluated.stderr
    # steps 3 and 6 while training, then 7 after the last step: the final one is the done's
    assert [s for s, _ in evaluated.evals] == [3, 6, 7]
    assert [s for s, _ in plain.evals] == [7]  # the default: only after the last step
    assert all(v > 0 for _, v in evaluated.evals)
    assert evaluated.done is not None and plain.done is not None
    assert evaluated.evals[-1][1] == evaluated.done["val_loss"]
    # evaluating draws no random number and touches no weight: every step's loss and the
    # final validation loss are the same floats
    assert evaluated.losses == plain.losses and len(plain.losses) == 7
    assert evaluated.done["val_loss"] == plain.done["val_loss"]
    assert plain.evals[0][1] == plain.done["val_loss"]
