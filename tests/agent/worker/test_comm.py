"""The worker's communication pieces on real gloo processes (loopback, no mocks).

- Bucketed, backward-overlapped data-parallel averaging gives exactly (bitwise) the mean
  sum-then-divide over one flat buffer gives, in both DP modes, with the loss riding along.
- The pipeline exchange gives every rank of a pipeline the same table, and the world minimum
  built from pipeline + data-parallel groups is the minimum over every rank.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from agent.worker.data_parallel import GradAverager, plan_buckets
from dtfm.core.layout import Layout
from dtfm.rpc import free_port


def _guard() -> None:
    """A spawned rank that hangs dumps its stack and exits, so mp.spawn fails instead."""
    import faulthandler

    faulthandler.dump_traceback_later(90, exit=True)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.Linear(5, 3))


def _grads_of(replica: int, micro: int = 3) -> tuple[nn.Module, list[torch.Tensor]]:
    """A model after `micro` backward passes on replica-specific data (nothing averaged)."""
    model = _model()
    gen = torch.Generator().manual_seed(100 + replica)
    xs = [torch.randn(4, 7, generator=gen) for _ in range(micro)]
    for x in xs:
        model(x).pow(2).mean().backward()
    return model, xs


def _dp_worker(rank: int, world: int, port: int, mode: str, out: str) -> None:
    _guard()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=30))
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=30),
                           use_local_synchronization=True)
    results = {}
    for overlap in (False, True):
        model = _model()
        avg = GradAverager(model, group, list(range(world)), mode, extras=1, bucket_bytes=200)
        assert len(avg.buckets) > 2  # tiny buckets: several collectives in flight
        gen = torch.Generator().manual_seed(100 + rank)
        xs = [torch.randn(4, 7, generator=gen) for _ in range(3)]
        for i, x in enumerate(xs):
            if overlap and i == len(xs) - 1:
                avg.arm([float(rank) + 0.25])  # hooks start buckets during this backward
            model(x).pow(2).mean().backward()
        if overlap:
            _, extras = avg.finish()
        else:
            _, extras = avg.average_([float(rank) + 0.25])
        results[overlap] = ([p.grad.clone() for p in model.parameters()], extras)
    # launched (the outer step one round late): averaged while this replica trains on
    model = _model()
    avg = GradAverager(model, group, list(range(world)), mode, bucket_bytes=200)
    gen = torch.Generator().manual_seed(100 + rank)
    for x in [torch.randn(4, 7, generator=gen) for _ in range(3)]:
        model(x).pow(2).mean().backward()
    mine = [p.grad for p in model.parameters()]
    avg.launch()
    for p in model.parameters():  # the next round's gradients, in the same parameters
        p.grad = None
    for _ in range(3):
        model(torch.randn(4, 7)).pow(2).mean().backward()
        avg.progress()
    for p, g in zip(model.parameters(), mine, strict=True):
        p.grad = g  # my copies handed back: the means land there
    avg.collect()
    results["launched"] = ([p.grad.clone() for p in model.parameters()], [])
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "world"), [("allreduce", 2), ("sharded", 2), ("sharded", 3)])
def test_bucketed_overlapped_averaging_is_the_exact_mean(
    tmp_path: Path, mode: str, world: int
) -> None:
    mp.spawn(_dp_worker, args=(world, free_port(), mode, str(tmp_path)), nprocs=world)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    replicas = [[p.grad for p in _grads_of(r)[0].parameters()] for r in range(world)]
    expected = [sum(gs[1:], gs[0]) / world for gs in zip(*replicas, strict=True)]
    for r in range(world):
        for overlap in (False, True):
            grads, extras = got[r][overlap]
            for g, e in zip(grads, expected, strict=True):
                if world == 2:  # a + b: the same bits whatever the bucketing
                    assert torch.equal(g, e)
                else:
                    torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)
            assert extras == pytest.approx([sum(q + 0.25 for q in range(world)) / world])
    for overlap in (False, True):  # every replica holds the same bits
        for r in range(1, world):
            for a, b in zip(got[r][overlap][0], got[0][overlap][0], strict=True):
                assert torch.equal(a, b)
    for a, b in zip(got[0][True][0], got[0][False][0], strict=True):
        assert torch.equal(a, b)  # overlap changes nothing
    for r in range(world):  # nor does launching it and training on meanwhile
        for a, b in zip(got[r]["launched"][0], got[r][False][0], strict=True):
            assert torch.equal(a, b)


SHARES = (None, [0.2, 0.3, 0.5], [0.5, 0.0, 0.5], [0.0, 0.0, 1.0])


def _shares_worker(rank: int, world: int, port: int, out: str) -> None:
    _guard()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=30))
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=30),
                           use_local_synchronization=True)
    results = []
    for shares in SHARES:
        model = _model()
        avg = GradAverager(model, group, list(range(world)), "sharded", extras=1,
                           bucket_bytes=200, shares=shares)
        gen = torch.Generator().manual_seed(100 + rank)
        for i, x in enumerate(torch.randn(4, 7, generator=gen) for _ in range(3)):
            if i == 2:
                avg.arm([float(rank) + 0.25])
            model(x).pow(2).mean().backward()
        _, extras = avg.finish()
        results.append(([p.grad.clone() for p in model.parameters()], extras, avg.sent_bytes))
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_uneven_shares_change_no_bit_and_an_empty_shard_sends_nothing(tmp_path: Path) -> None:
    # the same gradients averaged with equal shares, uneven ones and shares where replicas
    # own nothing: every replica holds the same bits in every case, since each element is
    # summed over the replicas in replica order wherever it is owned
    world = 3
    mp.spawn(_shares_worker, args=(world, free_port(), str(tmp_path)), nprocs=world)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    equal = got[0][0][0]
    for r in range(world):
        for grads, extras, _ in got[r]:
            for g, e in zip(grads, equal, strict=True):
                assert torch.equal(g, e)
            assert extras == pytest.approx([sum(q + 0.25 for q in range(world)) / world])
    # owning nothing, a replica only sends its copies (fewer bytes than with an equal
    # share); owning everything, replica 2 sends its average to both peers and no copies
    numel = sum(p.numel() for p in _model().parameters()) + 1
    assert got[0][3][2] == 4 * numel and got[1][3][2] == 4 * numel
    assert got[2][3][2] == 2 * 4 * numel
    assert got[1][2][2] == 4 * numel < got[1][0][2]


def test_buckets_are_reverse_order_runs_of_bounded_size() -> None:
    params = list(_model().parameters())
    plan = plan_buckets(params[::-1], 200)
    assert [p for b in plan for p in b] == params[::-1]
    for b in plan:
        assert len(b) == 1 or sum(p.numel() * 4 for p in b) <= 200


def _exchange_worker(rank: int, world: int, port: int, out: str) -> None:
    from types import SimpleNamespace

    from agent.worker.deadline import Deadline
    from agent.worker.world import join

    _guard()
    layout = Layout(2, 2)
    stage, replica = layout.coords(rank)
    a = SimpleNamespace(backend="gloo", bind_addr="127.0.0.1", master_addr="127.0.0.1",
                        master_port=port, rank=rank, world_size=world, replica=replica,
                        stage=stage)
    w = join(a, layout, Deadline.fixed(30.0), torch.device("cpu"))
    table = w.pipeline_exchange([float(rank), 0.1 * rank])
    low = w.world_min(10 - rank)
    total = w.dp_all_reduce(0.5 * rank, dist.ReduceOp.SUM)
    torch.save({"table": table, "min": low, "sum": total, "pipeline": w.pipeline},
               f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_pipeline_exchange_and_world_min_over_groups(tmp_path: Path) -> None:
    os.environ.pop("DTFM_BIND_INTERFACE", None)
    mp.spawn(_exchange_worker, args=(4, free_port(), str(tmp_path)), nprocs=4)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    layout = Layout(2, 2)
    for r, res in enumerate(got):
        stage, replica = layout.coords(r)
        pipe = layout.pipeline_ranks(replica)
        assert res["pipeline"] == pipe
        assert res["table"] == [[float(p), 0.1 * p] for p in pipe]
        assert res["min"] == 10 - 3
        assert res["sum"] == pytest.approx(sum(0.5 * q for q in layout.dp_ranks(stage)))


def _rank_steps(workdir: Path) -> dict[int, list[dict[str, float]]]:
    import json

    out = {}
    for f in sorted(workdir.glob("rank*.progress.jsonl")):
        events = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        steps = [e for e in events if e["event"] == "step"]
        out[steps[0]["rank"]] = steps
    return out


@pytest.mark.timeout(180)
def test_every_rank_reports_the_global_loss_and_norm_whatever_the_buckets(
    tmp_path: Path,
) -> None:
    from tests.agent.worker.testlib import run_local

    flags = ("--model", "gpt-tiny", "--stages", "2", "--replicas", "2", "--batch", "8",
             "--steps", "6", "--seed", "3", "--eval-batches", "1", "--timeout", "60")
    runs = {}
    for mb in ("4", "0.005"):  # one bucket per stage vs dozens
        wd = tmp_path / mb
        run = run_local(*flags, "--workdir", str(wd), env={"DTFM_DP_BUCKET_MB": mb})
        assert run.rc == 0, run.stderr
        runs[mb] = _rank_steps(wd)
    for steps in runs.values():
        assert sorted(steps) == [0, 1, 2, 3]
        for r in steps:  # every rank: the same global loss and clipping norm, bit for bit
            assert [s["loss"] for s in steps[r]] == [s["loss"] for s in steps[3]]
            assert [s["grad_norm"] for s in steps[r]] == [s["grad_norm"] for s in steps[3]]
    a, b = runs["4"][3], runs["0.005"][3]
    assert [s["loss"] for s in a] == [s["loss"] for s in b]  # R = 2: bucketing changes no bit
    assert [s["grad_norm"] for s in a] == [s["grad_norm"] for s in b]


def _links_worker(rank: int, world: int, port: int, out: str) -> None:
    from agent.worker.pipeline import TAG_ACT, TAG_GRAD, make_links
    from agent.worker.world import _member_group

    _guard()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=30))
    # The NCCL layout of groups (two per link), built on gloo to run here: 2 pipelines.
    layout = Layout(world // 2, 2)
    pipelines = [layout.pipeline_ranks(k) for k in range(2)]
    stage, replica = layout.coords(rank)
    pipe_group = _member_group(pipelines[replica], timedelta(seconds=30))
    _member_group(layout.dp_ranks(stage), timedelta(seconds=30))
    links = make_links(pipelines, rank, "nccl", pipe_group)
    got = {}
    if links.prev is not None:
        act = torch.zeros(2)
        dist.recv(act, links.prev, links.fwd_from_prev, TAG_ACT)
        got["act"] = act.tolist()
        dist.send(torch.full((2,), -float(rank)), links.prev, links.bwd_to_prev, TAG_GRAD)
    if links.next is not None:
        dist.send(torch.full((2,), float(rank)), links.next, links.fwd_to_next, TAG_ACT)
        grad = torch.zeros(2)
        dist.recv(grad, links.next, links.bwd_from_next, TAG_GRAD)
        got["grad"] = grad.tolist()
    torch.save(got, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_nccl_style_link_groups_connect_each_link_both_ways(tmp_path: Path) -> None:
    stages, world = 3, 6
    mp.spawn(_links_worker, args=(world, free_port(), str(tmp_path)), nprocs=world)
    layout = Layout(stages, 2)
    for r in range(world):
        got = torch.load(tmp_path / f"rank{r}.pt")
        stage, _ = layout.coords(r)
        if stage > 0:
            assert got["act"] == [float(r - 1)] * 2
        if stage < stages - 1:
            assert got["grad"] == [-float(r + 1)] * 2
