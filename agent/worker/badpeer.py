"""What a bad peer does to the numbers it sends: the attacks `DTFM_FAULT`'s bad-peer modes
rehearse, and the held-out tests inject from outside the product.

Owns the arithmetic of each attack on one outgoing data-parallel contribution (a shard copy
or a ring buffer) and on a replica's own weights, so the rehearsal seam (`fault.py`) and the
tests' own hook (tests/agent/worker/badpeer_hook.py) cannot disagree on what "scaled" or
"stale" means:

- `scale`: the contribution times 10; `flip`: times -4 (a sign flip that also grows it);
- `noise`: plus Gaussian noise of the contribution's own standard deviation (about 1 sigma);
- `zero`: all zeros; `stale`: a copy of the contribution this peer sent for the same
  destination at the step before the attack began (recorded as it trains honestly);
- `nan`: its first value NaN and its last infinite, the rest honest (a flipped exponent bit:
  what a bad ALU or memory cell makes of a float);
- `avg_scale`, `avg_flip`, `avg_noise`, `avg_zero`, `avg_stale`, `avg_nan`: the same
  arithmetic on the averaged shard an owner sends back in `sharded` mode (it steps with it
  too, so every replica applies the same wrong update and the weights digest agrees);
- `avg_one`: x10 on the averaged shards an owner sends its first receiver only, while it
  steps with, and accounts for, the honest mean (an owner that equivocates: that receiver's
  weights alone differ; `Equivocation`);
- `norm_lie`: x100 on the squared gradient norm it sends its pipeline in the per-step
  exchange, while it clips with its own (`NORM_LIE_SCALE`; its partners clip with another
  coefficient);
- `drift`: after the optimizer step, one weight of the stage moves by 1e-2 (silent data
  corruption in the optimizer step or in memory: no error, just different bits);
- `act_scale`, `act_noise`, `act_zero`: the same arithmetic on every activation message the
  peer sends down its pipeline; `actgrad_*` on the activation gradients it sends back;
  `act_lie`: x10 on its activations after it tallied them for the coordinator, whose figure
  of them it then misreports (`Activations`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

CONTRIBUTION_ATTACKS = ("scale", "flip", "noise", "zero", "stale", "nan")
# on the pipeline: what a rank sends forward (`act_`) or back (`actgrad_`); `act_lie` scales
# its activations x10 after tallying them, as a volunteer that reports what it should have
# sent would (the others alter what they send and report that: a faulty device's way)
ACTIVATION_ATTACKS = ("act_scale", "act_noise", "act_zero", "actgrad_scale", "actgrad_noise",
                      "actgrad_zero", "act_lie")
AVERAGE_ATTACKS = tuple(f"avg_{m}" for m in CONTRIBUTION_ATTACKS)
# `norm_forge` drifts as `drift` does, and writes 100x its pipeline's next stage's squared
# norm of that step in its own norm table, the row the digest compares (normtable.py): it
# blames the drift on its pipeline partner
FORGE_ATTACKS = ("norm_forge",)
WEIGHT_ATTACKS = ("drift", *FORGE_ATTACKS)
EQUIVOCATION_ATTACKS = ("avg_one",)
NORM_ATTACKS = ("norm_lie",)
SCALES = {"scale": 10.0, "flip": -4.0}
NORM_LIE_SCALE = 100.0  # what `norm_lie` multiplies the squared norm it sends by
DRIFT = 1e-2  # what `drift` adds to one weight


class Contributions:
    """One peer's attack on its outgoing contributions, from step `onset` on.

    `__call__` is the averager's `tamper` hook: it sees every outgoing contribution (`key`
    names the bucket and destination) and returns what goes on the wire; for an `avg_` mode
    it is the `tamper_average` hook, on the averages the peer sends back as an owner."""

    def __init__(self, mode: str, onset: int, seed: int = 0) -> None:
        mode = mode.removeprefix("avg_")
        if mode not in CONTRIBUTION_ATTACKS:
            raise ValueError(f"unknown contribution attack {mode!r}; one of "
                             f"{', '.join(CONTRIBUTION_ATTACKS)}")
        self.mode, self.onset, self.step = mode, onset, 0
        self._held: dict[Hashable, torch.Tensor] = {}  # stale: the last honest copies
        self._gen = torch.Generator().manual_seed(seed)

    def __call__(self, key: Hashable, t: torch.Tensor) -> torch.Tensor:
        if self.step < self.onset:
            if self.mode == "stale":
                self._held[key] = t.detach().clone()
            return t
        return attack(self.mode, t, self._held.get(key), self._gen)


def attack(mode: str, t: torch.Tensor, held: torch.Tensor | None = None,
           gen: torch.Generator | None = None) -> torch.Tensor:
    """`t` as the attack `mode` sends it (a new tensor; `held`: stale's older copy)."""
    if mode in SCALES:
        return t * SCALES[mode]
    if mode == "zero":
        return torch.zeros_like(t)
    if mode == "noise":
        sigma = float(t.float().std()) if t.numel() > 1 else 1.0
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t)
        return t + noise * sigma
    if mode == "stale":
        return held.clone() if held is not None and held.shape == t.shape else t
    if mode == "nan":
        out = t.clone()
        flat = out.view(-1)
        flat[-1] = math.inf
        flat[0] = math.nan  # where there is one value only: NaN
        return out
    raise ValueError(f"unknown contribution attack {mode!r}")


class Equivocation:
    """An owner that sends one receiver, the first it sends each averaged shard to, ten
    times that shard from step `onset` on, and the others the honest one: the averager's
    `tamper_sent(key, shard)` hook (`key`: the bucket and the receiver's index)."""

    def __init__(self, onset: int) -> None:
        self.onset, self.step = onset, 0
        self.target: Hashable | None = None  # the receiver it equivocates to

    def __call__(self, key: Hashable, t: torch.Tensor) -> torch.Tensor:
        receiver = key[1] if isinstance(key, tuple) else key
        if self.target is None:
            self.target = receiver
        if self.step < self.onset or receiver != self.target:
            return t
        return t * SCALES["scale"]


class Activations:
    """One peer's attack on the pipeline messages it sends, from step `onset` on: the
    pipeline's `attack(figure, tensor)` hook (agent/worker/pipeline.py)."""

    def __init__(self, mode: str, onset: int, seed: int = 0) -> None:
        if mode not in ACTIVATION_ATTACKS:
            raise ValueError(f"unknown activation attack {mode!r}; one of "
                             f"{', '.join(ACTIVATION_ATTACKS)}")
        self.lies = mode == "act_lie"
        self.figure = "grad_out" if mode.startswith("actgrad_") else "act_out"
        self.how = "scale" if self.lies else mode.rsplit("_", 1)[1]
        self.onset, self.step = onset, 0
        self._gen = torch.Generator().manual_seed(seed)

    def __call__(self, figure: str, t: torch.Tensor) -> torch.Tensor:
        if figure != self.figure or self.step < self.onset:
            return t
        return attack(self.how, t, None, self._gen)


def drift_(params: Sequence[torch.Tensor]) -> None:
    """Silent data corruption: move one weight of the first parameter by `DRIFT`."""
    with torch.no_grad():
        params[0].view(-1)[0] += DRIFT
