"""Gradient averaging within a stage's data-parallel group, overlapped with the backward pass.

Owns turning R replicas' gradients of one stage into their mean, identically on every
replica. Parameters are cut into buckets (`dtfm.core.buckets.dp_bucket_bytes`: about an
eighth of the stage, 64 KB to 4 MB; `DTFM_DP_BUCKET_MB` overrides it) in reverse
registration order, which is roughly the order backward produces their gradients
(head first, embedding last). When the pipeline runs the step's last backward pass it arms
the averager; from then on each parameter's post-accumulate-grad hook copies the finished
gradient into its bucket, and a full bucket starts its collective at once (`async_op`), so
communication overlaps the rest of the backward pass. Buckets start strictly in index order,
so every replica issues the same collectives in the same order. Two ways, as in the paper:

- `allreduce`: one `all_reduce(SUM)` per bucket, then divide by R.
- `sharded` (the paper's scatter-reduce + all-gather, as direct messages): each bucket is
  cut into R shards, equal (padded) or by the assignment's `dp_shares`
  (`dtfm.core.buckets.shard_sizes`; a replica far from everyone may own none); the hook
  sends shard k straight to replica k; k sums the R copies in replica order, divides by R
  and sends the averaged shard straight to every peer. An empty shard sends nothing.
  Each replica sends and receives 2(R-1)/R of the bucket, like a ring, but in two hops of
  latency instead of a ring's 2(R-1) (over a 70 ms link, at R = 4, 0.14 s instead of 0.42
  s); on a WAN that is most of the difference. Every receive of both hops is posted when the
  step starts (`prepost`), so gloo's ready notices do not add a one-way delay to each hop.

Each element is summed over the replicas and then divided by R, exactly as with one flat
buffer, so bucketing changes no bits for R = 2 (a + b is commutative); for R > 2 the order of
a ring's partial sums depends on an element's position in its buffer, but every replica still
gets the same bits. A few extra scalars (the last stage's loss) can ride in the last bucket,
so reporting the global loss costs no round trip of its own.

Compression (`sharded` only; `codec`, from `Assignment.dp_compress`): each shard travels as
an int8 / int4 / top-k message (`compress.py`) with error feedback: a replica keeps, per
bucket and destination, what its last messages could not carry and adds it to the next
(per owner, the same for the averaged shard it sends back). The owner sums the decoded copies
in replica order and replaces its own averaged shard by what its peers will decode from its
message, so every replica still steps with identical gradients. The extra scalars then
travel in a bucket of their own, uncompressed, so the reported loss stays exact. The
residuals live in memory only: a resumed run starts them at zero.

An exchange may also run while the caller trains (`launch`, `progress`, `collect`: the
outer step one round late, `outer.py`): the gradients are copied into the buckets and their
sends started at once; `progress`, a poll between steps, sends back each bucket's average as
soon as its copies are in; `collect` waits for the rest and writes the means back. The
collectives, their order and their bits are those of `average_`.

Seams for the replica checks (`replicacheck.py`, `--verify`): `inspect`, called at a
shard's owner with every replica's copy of the shard (replica order, decoded), may score them
and return the average to use instead of the mean (robust aggregation); `check`, called at
every replica once a bucket's averaged shards have all arrived and before the means are
written back to the gradients, with each owner's averaged shard and this replica's own copy
of it (`avgcheck.py`: the receivers' check of the owners); `tamper` and `tamper_average`,
called on each outgoing contribution before it is encoded and on the average an owner sends
back, are how a rehearsed bad peer (`fault.py`) alters what it sends. All are None unless
set.

NaN and infinities (`sharded` only, always on: `nonfinite.py`): the owner averages a
replica's non-finite copy as zeros, every replica screens the averages it receives and its
own copies, and once the step's exchange is over a peer's non-finite value is raised as a
`bad_value` naming it; this replica's own non-finite gradient is left in place, so the step's
norm check fails as `config`, as before.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from agent.worker import nonfinite
from agent.worker.compress import ErrorFeedback, TensorCodec
from agent.worker.deadline import DEFAULT_CEILING_S, Deadline
from agent.worker.errors import wait_all
from dtfm.core.buckets import check_shares, dp_bucket_bytes, shard_sizes

log = logging.getLogger(__name__)

ENV_BUCKET_MB = "DTFM_DP_BUCKET_MB"
TAG_SCATTER = 100  # sharded mode: bucket i's shards travel with tag 100 + 2i, averages + 1
# inspect(bucket index, every replica's copy of my shard) -> the average to use, or None
Inspect = Callable[[int, list[torch.Tensor]], "torch.Tensor | None"]
Tamper = Callable[[Hashable, torch.Tensor], torch.Tensor]  # (bucket, destination), tensor
# check(bucket index, owner's index, its averaged shard, my own copy of it: my gradient, which
# for my own shard is no longer among the copies `inspect` saw, its buffer holds the average)
Check = Callable[[int, int, torch.Tensor, torch.Tensor], None]


@dataclass(eq=False)  # buckets are compared by identity (list.index)
class _Bucket:
    params: list[nn.Parameter]
    offsets: list[int]
    flat: torch.Tensor  # gradients, then extras (last bucket), then padding (equal shards)
    numel: int  # gradient elements
    sizes: list[int]  # sharded: elements of each replica's shard (0: it owns none)
    ready: int = 0
    works: list[dist.Work] = field(default_factory=list)
    parts: list[torch.Tensor] = field(default_factory=list)  # sharded: my shard, from each
    codec: TensorCodec | None = None  # sharded messages compressed with this (None: exact)
    feedback: dict[int, ErrorFeedback] = field(default_factory=dict)  # per destination shard
    gather_feedback: ErrorFeedback | None = None  # for the averaged shard I own
    gathered: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # compressed recvs
    gather_works: list[dist.Work] = field(default_factory=list)  # averaged shards' receives


def plan_buckets(params: Sequence[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Consecutive runs of one dtype of about `bucket_bytes` each (at least one parameter)."""
    out: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not out or size + nbytes > bucket_bytes or out[-1][0].dtype != p.dtype:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out


def bucket_bytes_for(params: Sequence[nn.Parameter]) -> int:
    """`DTFM_DP_BUCKET_MB` when set, else the size `dp_bucket_bytes` gives these gradients."""
    raw = os.environ.get(ENV_BUCKET_MB, "").strip()
    if raw:
        return max(1, int(float(raw) * (1 << 20)))
    return dp_bucket_bytes(sum(p.numel() * p.element_size() for p in params))


class GradAverager:
    """Averages a stage's gradients (and `extras` scalars) over its data-parallel group."""

    def __init__(
        self,
        model: nn.Module,
        group: dist.ProcessGroup | None,
        ranks: list[int],
        mode: str,
        *,
        extras: int = 0,
        bucket_bytes: int | None = None,
        deadline: Deadline | None = None,
        codec: TensorCodec | None = None,
        shares: Sequence[float] | None = None,
    ) -> None:
        if mode not in ("allreduce", "sharded"):
            raise ValueError(f"unknown dp mode {mode!r}; use 'allreduce' or 'sharded'")
        if codec is not None and mode != "sharded":
            raise ValueError(f"data-parallel compression ({codec.name}) needs --dp-mode "
                             f"sharded: a ring all-reduce sums in flight, which quantized "
                             f"messages with their own scales cannot do")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.group, self.ranks, self.mode = group, ranks, mode
        self.size, self.n_extras = len(ranks), extras
        # how long one wait for the group may block (deadline.py: adapts to the step time)
        self.deadline = deadline or Deadline.fixed(DEFAULT_CEILING_S)
        self.codec = codec
        # sharded: each replica's part of every bucket (None: equal shards, padded)
        self.shares = None if shares is None else check_shares(shares, len(ranks))
        self._armed, self._next, self._posted = False, 0, False
        self._gathered = 0  # sharded: the buckets whose averages went back (in index order)
        self._extras = [0.0] * extras
        self.sent_bytes = 0  # this step's bytes to the other replicas
        self.codec_s = 0.0  # this step's compressing and decompressing
        self.inspect: Inspect | None = None  # the owner's look at its shard's copies
        self.tamper: Tamper | None = None  # a rehearsed bad peer's hand on what it sends
        self.tamper_average: Tamper | None = None  # ... on the averages it sends back
        self.tamper_sent: Tamper | None = None  # ... on one receiver's copy of them
        self.check: Check | None = None  # a receiver's look at the owners' averages
        self.screen = nonfinite.Screen()  # sharded: a peer's NaN or infinity, told from my own
        self.step = 0  # the training step averaged, which a peer's bad value is blamed at
        self._own_finite = True  # this step's own copies: False leaves the gradients mine
        self.finish_codec_s = 0.0  # the part of codec_s spent in `finish` (not in backward)
        self.buckets: list[_Bucket] = []
        self._slot: dict[int, tuple[_Bucket, int]] = {}
        if self.size > 1:
            nbytes = bucket_bytes if bucket_bytes is not None else bucket_bytes_for(self.params)
            plan = plan_buckets(self.params[::-1], nbytes)
            if codec is not None and extras:
                plan.append([])  # the extras travel exact, in a bucket of their own
            self._build(plan)

    def _build(self, plan: list[list[nn.Parameter]]) -> None:
        like = self.params[0]
        for k, params in enumerate(plan):
            offsets = [0]
            for p in params:
                offsets.append(offsets[-1] + p.numel())
            n = offsets[-1] + (self.n_extras if k == len(plan) - 1 else 0)
            sizes = [n]
            if self.mode == "sharded" and self.shares is None:
                n = -(-n // self.size) * self.size
                sizes = [n // self.size] * self.size
            elif self.mode == "sharded":
                sizes = shard_sizes(n, self.shares)
            dtype = params[0].dtype if params else like.dtype
            flat = torch.zeros(n, dtype=dtype, device=like.device)
            b = _Bucket(params, offsets[:-1], flat, offsets[-1], sizes,
                        codec=self.codec if params else None)
            self.buckets.append(b)
            for p, off in zip(params, b.offsets, strict=True):
                self._slot[id(p)] = (b, off)
                p.register_post_accumulate_grad_hook(self._on_grad)

    # ---- the step ----
    def prepost(self) -> None:
        """Post every receive of this step's averaging now, at the start of the step.

        gloo sends a message only once the receiver has said it is ready, and that notice
        takes a one-way delay to arrive: receives posted when the shards go out cost each of
        the two hops a second one-way delay (0.1-0.3 s a step on intercontinental groups).
        Posted a pipeline's length ahead, the notices are there before the data. The averaged
        shards land in the bucket's own chunks: a peer sends its average only after it has
        my copy of that chunk whole, so my send has read it by then. `arm` does this itself
        when the caller did not."""
        if self.size == 1 or self.mode != "sharded" or self._posted:
            return
        me = self.ranks.index(dist.get_rank())
        for i, b in enumerate(self.buckets):
            chunks = b.flat.split(b.sizes)
            peers = [k for k in range(self.size) if k != me]
            b.parts = [chunks[me] if k == me else self._recv_buffer(b, chunks[me])
                       for k in range(self.size)] if b.sizes[me] else []
            tag = TAG_SCATTER + 2 * i
            b.works = [self._async(dist.irecv(b.parts[k], self.ranks[k], self.group, tag))
                       for k in peers if b.parts]
            owners = [k for k in peers if b.sizes[k]]  # their averages come back to me
            if b.codec is None:
                into = [(k, chunks[k]) for k in owners]
            else:
                b.gathered = [(k, self._recv_buffer(b, chunks[k])) for k in owners]
                into = b.gathered
            b.gather_works = [self._async(dist.irecv(buf, self.ranks[k], self.group, tag + 1))
                              for k, buf in into]
        self._posted = True

    def arm(self, extras: Sequence[float] = ()) -> None:
        """From now on, finished gradients start their bucket's collective (last backward)."""
        if len(extras) != self.n_extras:
            raise ValueError(f"expected {self.n_extras} extra values, got {len(extras)}")
        self._extras = [float(v) for v in extras]
        if self.size == 1:
            return
        last = self.buckets[-1]
        last.flat[last.numel : last.numel + self.n_extras] = torch.tensor(
            self._extras, dtype=last.flat.dtype
        )
        self.prepost()
        for b in self.buckets:
            b.ready = 0
            if self.mode == "allreduce":
                b.works = []
        self._armed, self._next, self._gathered = True, 0, 0
        self.sent_bytes, self.codec_s = 0, 0.0

    def finish(self) -> tuple[float, list[float]]:
        """Start what backward did not, wait, and write back the means.

        Returns the seconds this took (the data-parallel time not hidden behind backward) and
        the mean of each extra value over the group.
        """
        if self.size == 1:
            return 0.0, list(self._extras)
        t0, codec_before = time.perf_counter(), self.codec_s
        self._start_rest()
        self._complete()
        self.finish_codec_s = self.codec_s - codec_before
        last = self.buckets[-1]
        extras = last.flat[last.numel : last.numel + self.n_extras].tolist() \
            if self._own_finite else self._extras  # my own, as my own gradients are
        return time.perf_counter() - t0, [float(v) for v in extras]

    def average_(self, extras: Sequence[float] = ()) -> tuple[float, list[float]]:
        """Average without overlap (after backward): `arm` then `finish`."""
        self.arm(extras)
        return self.finish()

    # ---- an exchange that runs while the caller trains (outer.py's --outer-delay 1) ----
    def launch(self) -> None:
        """Start averaging the gradients as they are now, and return without waiting.

        Until `collect`, the caller may train on (the gradients were copied into the
        buckets), but must hand `collect` the parameters' gradients holding this replica's
        copies again (the receivers' check reads them, and the means are written there), and
        must not use this averager for anything else meanwhile."""
        self.arm()
        if self.size > 1:
            self._start_rest()

    def progress(self) -> None:
        """Send back the averages of every bucket (in order) whose copies have all arrived:
        what `collect` would otherwise do a whole round later (`sharded`; a poll between
        steps, which waits for nothing)."""
        if self.size == 1 or self.mode != "sharded":
            return
        me = self.ranks.index(dist.get_rank())
        while self._gathered < len(self.buckets):
            b = self.buckets[self._gathered]
            if not all(w.is_completed() for w in b.works):
                return
            self._gather_bucket(self._gathered, b, me)

    def collect(self) -> float:
        """Finish what `launch` started: wait, and write the means into the gradients.
        Returns the seconds it waited and worked."""
        if self.size == 1:
            return 0.0
        t0 = time.perf_counter()
        self._complete()
        return time.perf_counter() - t0

    def _start_rest(self) -> None:
        """Disarm the hooks, copy in every gradient they did not, and start its bucket."""
        self._armed = False
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for b in self.buckets[self._next :]:
            self._copy_in(b)
        self._launch_ready()

    # ---- hooks and collectives ----
    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        b, off = self._slot[id(p)]
        assert p.grad is not None
        b.flat[off : off + p.numel()].copy_(p.grad.reshape(-1))
        b.ready += 1
        if b.ready == len(b.params):
            self._launch_ready()

    def _copy_in(self, b: _Bucket) -> None:
        for p, off in zip(b.params, b.offsets, strict=True):
            assert p.grad is not None
            b.flat[off : off + p.numel()].copy_(p.grad.reshape(-1))
        b.ready = len(b.params)

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if b.ready < len(b.params):
                return
            self._launch(b)
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        if self.mode == "allreduce":
            if self.tamper is not None:
                b.flat.copy_(self.tamper((self.buckets.index(b), -1), b.flat))
            b.works = [self._async(dist.all_reduce(b.flat, dist.ReduceOp.SUM, self.group, True))]
            # gloo's ring: each replica sends 2(R-1)/R of the buffer
            self.sent_bytes += 2 * (self.size - 1) * b.flat.numel() * b.flat.element_size() \
                // self.size
            return
        me, chunks = self.ranks.index(dist.get_rank()), b.flat.split(b.sizes)
        tag = TAG_SCATTER + 2 * self.buckets.index(b)
        b.works += [self._async(dist.isend(self._message(b, k, chunks[k]), self.ranks[k],
                                           self.group, tag))
                    for k in range(self.size) if k != me and b.sizes[k]]

    def _recv_buffer(self, b: _Bucket, shard: torch.Tensor) -> torch.Tensor:
        """Where a peer's copy of `shard` arrives: a tensor like it, or its message's bytes."""
        if b.codec is None:
            return torch.empty_like(shard)
        return torch.empty(b.codec.wire_bytes(shard.numel()), dtype=torch.uint8,
                           device=shard.device)

    def _message(self, b: _Bucket, k: int, shard: torch.Tensor) -> torch.Tensor:
        """What replica k receives for `shard`: the shard, or its error-compensated message."""
        self.screen.sent(shard)
        if self.tamper is not None:
            shard = self.tamper((self.buckets.index(b), k), shard)
        if b.codec is None:
            msg = shard.contiguous()
        else:
            t0 = time.perf_counter()
            feedback = b.feedback.setdefault(k, ErrorFeedback(b.codec))
            msg, _ = feedback.encode(shard)
            self.codec_s += time.perf_counter() - t0
        self.sent_bytes += msg.numel() * msg.element_size()
        return msg

    @staticmethod
    def _async(work: dist.Work | None) -> dist.Work:
        assert work is not None
        return work

    def _wait(self, works: list[dist.Work]) -> None:
        wait_all(works, self.deadline, f"data-parallel averaging over ranks {self.ranks}")

    def _complete(self) -> None:
        self._posted = False  # this step's receives are used up
        sharded, self._own_finite = self.mode == "sharded", True
        if sharded:
            self._gather_shards()
            # my own gradient not finite: it stays, so the step's norm check says so
            self._own_finite = self.screen.own_finite()
        for i, b in enumerate(self.buckets):
            self._wait(b.works)
            if b.gathered:
                self._decode_gathered(b)
            if sharded:
                self._screen_averages(b)
            if self.check is not None and sharded:
                self._check(i, b, self.check)
            if self.mode == "allreduce":
                b.flat.div_(self.size)
            if self._own_finite:
                self._write_back(b)
        if sharded and (found := self.screen.close()) is not None:  # nothing is in flight
            raise nonfinite.failure(dist.get_rank(), self.ranks, found, self.step)

    @staticmethod
    def _write_back(b: _Bucket) -> None:
        for p, off in zip(b.params, b.offsets, strict=True):
            assert p.grad is not None
            p.grad.copy_(b.flat[off : off + p.numel()].view_as(p.grad))

    def _screen_averages(self, b: _Bucket) -> None:
        """Screen every owner's averaged shard of `b`, mine among them (`nonfinite.py`)."""
        chunks = b.flat.split(b.sizes)
        self.screen.averages([(k, chunks[k]) for k in range(self.size) if b.sizes[k]],
                             self.ranks.index(dist.get_rank()))

    def _gather_shards(self) -> None:
        """Sum my shard's copies in replica order (the same bits wherever it is summed),
        average, and exchange averaged shards directly with every peer."""
        me = self.ranks.index(dist.get_rank())
        while self._gathered < len(self.buckets):  # `progress` may have done the first ones
            self._gather_bucket(self._gathered, self.buckets[self._gathered], me)

    def _gather_bucket(self, i: int, b: _Bucket, me: int) -> None:
        """`_gather_shards` for bucket i, the next one due."""
        self._wait(b.works)
        self._gathered = i + 1
        if not b.sizes[me]:  # I own none of this bucket: only the averages to receive
            b.works = b.gather_works
            return
        if b.codec is not None:
            self._gather_compressed(b, i, me)
            return
        mine = self._average(i, b.parts, me)
        chunks = b.flat.split(b.sizes)
        chunks[me].copy_(mine)
        tag = TAG_SCATTER + 2 * i + 1
        b.works = b.gather_works + [
            self._async(dist.isend(self._sent(i, k, chunks[me]), self.ranks[k], self.group,
                                   tag))
            for k in range(self.size) if k != me]
        self.sent_bytes += (self.size - 1) * chunks[me].numel() * chunks[me].element_size()

    def _sent(self, i: int, k: int, shard: torch.Tensor) -> torch.Tensor:
        """My averaged shard of bucket i as receiver k gets it: a rehearsed owner that
        equivocates (`tamper_sent`, fault.py's `avg_one`) sends one receiver another one."""
        return shard if self.tamper_sent is None else self.tamper_sent((i, k), shard)

    def _average(self, i: int, copies: list[torch.Tensor], me: int) -> torch.Tensor:
        """Bucket i's copies of my shard averaged: what `inspect` returns, else their sum in
        replica order divided by R; a non-finite copy counts as zeros (`Screen.copies`)."""
        copies = self.screen.copies(copies, me)
        mine = self.inspect(i, copies) if self.inspect is not None else None
        if mine is None:
            mine = copies[0].clone()
            for part in copies[1:]:
                mine.add_(part)
            mine.div_(self.size)
        if self.tamper_average is not None:
            mine = self.tamper_average((i, "average"), mine)
        return mine

    def _check(self, i: int, b: _Bucket, check: Check) -> None:
        """Hand `check` each owner's averaged shard of `b` with my copy of it, still in the
        parameters' gradients (the padding and the extra scalars are left out); mine too."""
        if not b.numel:
            return
        mine = torch.cat([p.grad.reshape(-1) for p in b.params])  # type: ignore[union-attr]
        start = 0
        for k, chunk in enumerate(b.flat.split(b.sizes)):
            end = min(start + chunk.numel(), b.numel)
            if end > start:
                check(i, k, chunk[: end - start], mine[start:end])
            start += chunk.numel()

    def _gather_compressed(self, b: _Bucket, i: int, me: int) -> None:
        """`_gather_shards` for a compressed bucket: decode the copies, sum them in replica
        order, and send the average as one error-compensated message to every peer; my own
        shard becomes what they decode, so all replicas hold the same bits."""
        assert b.codec is not None
        t0 = time.perf_counter()
        chunks = b.flat.split(b.sizes)
        n = chunks[me].numel()
        copies = [part if k == me else b.codec.decode(part, n) for k, part in enumerate(b.parts)]
        mine = self._average(i, copies, me)
        if b.gather_feedback is None:
            b.gather_feedback = ErrorFeedback(b.codec)
        msg, sent = b.gather_feedback.encode(mine)
        chunks[me].copy_(sent)
        self.codec_s += time.perf_counter() - t0
        tag = TAG_SCATTER + 2 * i + 1
        b.works = b.gather_works + [self._async(dist.isend(msg, self.ranks[k], self.group, tag))
                    for k in range(self.size) if k != me]
        self.sent_bytes += (self.size - 1) * msg.numel()

    def _decode_gathered(self, b: _Bucket) -> None:
        assert b.codec is not None
        t0 = time.perf_counter()
        chunks = b.flat.split(b.sizes)
        for k, buf in b.gathered:
            chunks[k].copy_(b.codec.decode(buf, chunks[k].numel()))
        b.gathered = []
        self.codec_s += time.perf_counter() - t0
