"""A bad peer made from outside the product, for the replica checks' held-out tests.

`DTFM_TEST_BAD_PEER="RANK:STEP=ATTACK,STEP=ATTACK,..."` makes worker RANK alter, at each
listed step, every data-parallel shard it sends (`torch.distributed.isend` on the sharded
scatter's tags; attacks as `agent.worker.badpeer.attack`: scale, flip, noise, zero, stale,
where stale replays the message it sent for the same destination one step earlier, as sent), or, for
`lie`, x10 every pipeline message it sends after its worker tallied it (`LIE`; `lie_one`:
on one link), or, for
`drift`, move one of its weights after that step's optimizer step, or, for `avg_` + an
attack, alter the averaged shard it sends back as an owner (the gather's tags), in place
before its first send, so that it steps with the altered average too, as every peer does
(`avg_one`: x10 to its first receiver only, a copy, so that it steps with the honest one),
or, for `norm_lie`, x100 the squared norm it sends its pipeline in the per-step exchange,
or, for `norm_forge`, drift as `drift` does and write x100 its pipeline's next stage's squared
norm of the step in its own norm table (`agent.worker.normtable.NormTable.add`, patched).
It patches torch, not the worker: the product's own rehearsal seam (`DTFM_FAULT`) stays
out of it, so the tests check the mechanism, not the rehearsal mode. `install` runs from
badpeer_site/sitecustomize.py and waits for torch.distributed to be imported by the worker
before patching anything.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

ENV = "DTFM_TEST_BAD_PEER"
TAG_SCATTER, MAX_BUCKETS = 100, 10_000  # agent/worker/data_parallel.py's scatter tags
# `lie`: every pipeline message it sends (activations forward, their gradients back) x10
# on the wire, after its worker took the figures it reports of them: a volunteer that reports
# what it should have sent
LIE, LIE_SCALE = "lie", 10.0
# `lie_one`: the same on one link only, the one it sends activations on (the last stage: its
# gradients back), so that it disagrees with one neighbour at a time
LIE_ONE = "lie_one"
# `avg_one`: x10 on the averaged shards it sends back as an owner to one receiver (the first
# it sends each to), while it steps with the honest mean and accounts for it: an owner that
# equivocates, whose one receiver's weights then differ from everyone else's
AVG_ONE = "avg_one"
# `norm_lie`: x100 on the squared gradient norm it sends its pipeline in the per-step
# exchange, while it clips with its own: its pipeline partners clip with another coefficient
NORM_LIE, NORM_LIE_SCALE = "norm_lie", 100.0
# `norm_forge`: its weights drift, and its own norm table (the row its stage's digest
# compares) says its pipeline's next stage sent x100 the squared norm it did: it blames its
# partner for its weights
NORM_FORGE = "norm_forge"


def parse(raw: str) -> tuple[int, dict[int, str]]:
    """RANK (or `*`: whatever rank this worker gets, for a daemon whose ranks the coordinator
    assigns; -1) and the attack by step."""
    rank, _, plan = raw.partition(":")
    steps = dict(item.split("=") for item in plan.split(",") if item)
    return (-1 if rank == "*" else int(rank)), {int(s): a for s, a in steps.items()}


class _Patch:
    def __init__(self, rank: int, plan: dict[int, str]) -> None:
        self.rank, self.plan, self.done = rank, plan, 0  # optimizer steps finished
        self.sent: dict[tuple[int, int], Any] = {}  # this step's messages, for stale
        self.before: dict[tuple[int, int], Any] = {}
        self.keep: list[Any] = []  # tampered tensors stay alive until their step ends
        self.altered: set[int] = set()  # this step's averages, altered once each
        self.forwards = False  # whether it has sent activations (it has a next stage)

    def apply(self) -> None:
        import torch
        import torch.distributed as dist
        from torch.optim.optimizer import register_optimizer_step_post_hook

        from agent.worker.badpeer import attack, drift_
        from agent.worker.pipeline import TAG_ACT, TAG_GRAD
        from agent.worker.world import TAG_EXCHANGE

        original = dist.isend
        gen = torch.Generator().manual_seed(max(self.rank, 0))

        def isend(tensor: Any, dst: Any = None, group: Any = None, tag: int = 0,
                  **kw: Any) -> Any:
            ours = TAG_SCATTER <= tag < TAG_SCATTER + 2 * MAX_BUCKETS
            mode = self.plan.get(self.done + 1, "")
            if ours and tag % 2 and self.rank in (-1, dist.get_rank()):
                if mode == AVG_ONE and tag not in self.altered:  # its first receiver only
                    tensor = tensor * LIE_SCALE
                    self.keep.append(tensor)
                elif mode.startswith("avg_") and mode != AVG_ONE and tag not in self.altered:
                    tensor.copy_(attack(mode[4:], tensor, self.before.get((tag, -1)), gen))
                self.altered.add(tag)
                self.sent[(tag, -1)] = tensor.detach().clone()
            scatter = ours and tag % 2 == 0
            if scatter and self.rank in (-1, dist.get_rank()):
                key = (tag, int(dst))
                if mode and mode not in ("drift", LIE, LIE_ONE, NORM_LIE, NORM_FORGE) and \
                        not mode.startswith(("avg_", "act_", "actgrad_", "pp_")):
                    tensor = attack(mode, tensor, self.before.get(key), gen)
                    self.keep.append(tensor)
                self.sent[key] = tensor.detach().clone()  # what it sent, tampered or not
            if (tag == TAG_EXCHANGE and mode == NORM_LIE
                    and self.rank in (-1, dist.get_rank())):
                tensor = tensor.clone()
                tensor[0] *= NORM_LIE_SCALE  # [squared norm, loss]
                self.keep.append(tensor)
            self.forwards |= tag == TAG_ACT  # it has a next stage
            if (tag in (TAG_ACT, TAG_GRAD) and mode in (LIE, LIE_ONE)
                    and self.rank in (-1, dist.get_rank())
                    and (mode == LIE or tag == (TAG_ACT if self.forwards else TAG_GRAD))):
                tensor = tensor * LIE_SCALE  # after the worker took its figures of it
                self.keep.append(tensor)
            return original(tensor, dst, group, tag, **kw)

        def after_step(opt: Any, args: Any, kwargs: Any) -> None:
            self.done += 1
            self.before, self.sent, self.keep, self.altered = self.sent, {}, [], set()
            if self.plan.get(self.done) in ("drift", NORM_FORGE) and \
                    self.rank in (-1, dist.get_rank()):
                drift_(opt.param_groups[0]["params"])

        dist.isend = isend
        register_optimizer_step_post_hook(after_step)
        self._forge_norms(dist)
        self._pipeline_faults(torch, dist, attack, gen)

    def _forge_norms(self, dist: Any) -> None:
        """`norm_forge`: the norms it keeps for the digest (called before the optimizer step,
        so the step is `done + 1`) say its next stage sent x100 (rank = replica * stages +
        stage)."""
        from agent.worker import normtable

        original = normtable.NormTable.add

        def add(table: Any, step: int, squares: Any) -> None:
            if (self.plan.get(self.done + 1) == NORM_FORGE
                    and self.rank in (-1, dist.get_rank())):
                squares = list(squares)
                squares[(dist.get_rank() % table.stages + 1) % table.stages] *= NORM_LIE_SCALE
            original(table, step, squares)

        normtable.NormTable.add = add  # type: ignore[assignment,method-assign]

    def _pipeline_faults(self, torch: Any, dist: Any, attack: Any, gen: Any) -> None:
        """`act_` + an attack: a faulty device's stage output (every pipeline message it
        sends forward, and what its own backward then sees); `actgrad_` + an attack: the
        gradient of its stage's input (what it sends back). Hooks on every module of class
        `Stage`, outside the worker's code."""
        from torch.nn.modules import module as nn_module

        def mode(prefix: str) -> str:
            m = self.plan.get(self.done + 1, "")
            mine = self.rank in (-1, dist.get_rank()) if dist.is_initialized() else False
            return m.removeprefix(prefix) if mine and m.startswith(prefix) else ""

        def forward(module: Any, args: Any, output: Any) -> Any:
            if type(module).__name__ != "Stage" or module.head is not None:
                return None  # the last stage sends no activations
            how = mode("act_") or mode("pp_")
            if not how:
                return None
            wrong = attack(how, output.detach(), None, gen)
            return output + (wrong - output.detach())  # its values, and still a graph

        def backward(module: Any, grad_input: Any, grad_output: Any) -> Any:
            if type(module).__name__ != "Stage" or module.embed is not None:
                return None  # the first stage sends no gradients back
            how = mode("actgrad_") or mode("pp_")
            if not how or not grad_input or grad_input[0] is None:
                return None
            return (attack(how, grad_input[0], None, gen), *grad_input[1:])

        nn_module.register_module_forward_hook(forward)
        nn_module.register_module_full_backward_hook(backward)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches torch once the worker's averaging module is imported (it imports torch)."""

    def __init__(self, patch: _Patch) -> None:
        self.patch = patch

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "agent.worker.data_parallel":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        assert spec is not None and spec.loader is not None
        loader, patch = spec.loader, self.patch

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                patch.apply()

        spec.loader = _Loader()
        return spec


def install() -> None:
    rank, plan = parse(os.environ[ENV])
    sys.meta_path.insert(0, _Finder(_Patch(rank, plan)))
