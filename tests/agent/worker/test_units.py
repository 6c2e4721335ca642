"""In-process unit tests of the worker's pure parts: schedules, data, LR, checkpoints, plans."""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from agent.worker import checkpoint
from agent.worker.data import (
    Position,
    Sampler,
    decode,
    encode,
    load_bin,
    load_splits,
    replica_slice,
    val_batches,
)
from agent.worker.optim import lr_at
from dtfm.core.assignment import build_assignments
from dtfm.core.layout import Layout, pipeline_ops
from dtfm.core.presets import get_preset
from dtfm.core.spec import TrainConfig


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 5])
@pytest.mark.parametrize("micro", [1, 2, 4, 7])
def test_schedules_run_every_microbatch_once_in_order(kind: str, stages: int, micro: int) -> None:
    for stage in range(stages):
        ops = pipeline_ops(kind, stage, stages, micro)
        assert [i for op, i in ops if op == "F"] == list(range(micro))
        assert [i for op, i in ops if op == "B"] == list(range(micro))  # same grad order
        live, peak = set(), 0
        for op, i in ops:
            if op == "F":
                live.add(i)
            else:
                assert i in live  # backward only after its forward
                live.remove(i)
            peak = max(peak, len(live))
        expected = micro if kind == "gpipe" else min(stages - stage, micro)
        assert peak == expected  # 1F1B bounds stored activations by S - stage


def test_byte_tokenizer_round_trips() -> None:
    text = "def f(x):\n    return 'λ'\n"
    tokens = encode(text)
    assert max(tokens) < 256 and decode(tokens) == text


def test_default_corpus_is_the_stdlib_split_deterministically() -> None:
    train, val = load_splits("", 256)
    train2, val2 = load_splits("", 256)
    assert train.size > 1_000_000 and val.size > 10_000
    assert 0.04 < val.size / (train.size + val.size) < 0.06
    assert np.array_equal(train[:4096], train2[:4096]) and np.array_equal(val[-64:], val2[-64:])
    assert b"import" in train[:200_000].tobytes()


def test_bin_files_load_and_reject_out_of_vocab(tmp_path: Path) -> None:
    path = tmp_path / "toks.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    assert load_bin(path, 1000).size == 1000
    with pytest.raises(ValueError, match="token id 999"):
        load_bin(path, 256)
    (tmp_path / "d").mkdir()
    np.arange(500, dtype=np.uint16).tofile(tmp_path / "d" / "train.bin")
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "d" / "val.bin")
    train, val = load_splits(str(tmp_path / "d"), 1000)
    assert (train.size, val.size) == (500, 100)


def test_a_prepared_directory_is_read_in_its_dtype_and_checked(tmp_path: Path) -> None:
    from dtfm.core.tokenfiles import TokenMeta, write_meta

    ids = np.array([70_000, 5, 65_536, 0], dtype="<u4")
    ids.tofile(tmp_path / "train.bin")
    ids[:2].tofile(tmp_path / "val.bin")
    meta = TokenMeta(dtype="uint32", vocab_size=70_001, tokenizer_hash="ab" * 32, eot_id=0,
                     eot_token="</s>", max_token_id=70_000, documents={"train": 2, "val": 1},
                     tokens={"train": 4, "val": 2}, val_fraction=0.3)
    write_meta(tmp_path, meta)
    train, val = load_splits(str(tmp_path), 70_001)
    assert train.tolist() == ids.tolist() and val.tolist() == ids[:2].tolist()
    with pytest.raises(ValueError, match="another tokenizer"):
        load_splits(str(tmp_path), 70_001, tokenizer_hash="cd" * 32)
    with pytest.raises(ValueError, match="token id 70000 but the model's vocabulary is 65536"):
        load_splits(str(tmp_path), 65_536)
    ids[:3].tofile(tmp_path / "train.bin")
    with pytest.raises(ValueError, match=r"train.bin has 12 bytes but its meta.json says 4 "
                                         r"uint32 tokens \(16 bytes\)"):
        load_splits(str(tmp_path), 70_001)


def test_sampler_is_deterministic_sliced_and_resumable() -> None:
    tokens = np.arange(10_000, dtype=np.uint16) % 256
    a, b = Sampler(tokens, 16, seed=3), Sampler(tokens, 16, seed=3)
    first = a.next_global(8)
    assert first == b.next_global(8) and len(set(first)) == 8
    assert replica_slice(first, 0, 2) + replica_slice(first, 1, 2) == first
    x, y = a.windows(first[:2])
    assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])
    saved = a.position.to_dict()
    later = [a.next_global(8) for _ in range(200)]  # wraps epochs (624 windows)
    assert a.position.epoch >= 2
    c = Sampler(tokens, 16, seed=3)
    c.position = Position.from_dict(saved)
    assert [c.next_global(8) for _ in range(200)] == later
    assert Sampler(tokens, 16, seed=4).next_global(8) != first


def test_val_batches_are_fixed_and_in_range() -> None:
    tokens = np.zeros(2_000, dtype=np.uint16)
    batches = val_batches(tokens, 16, 4, 3)
    assert len(batches) == 3 and all(len(b) == 4 for b in batches)
    assert max(max(b) for b in batches) <= (2_000 - 1) // 16 - 1


def test_lr_warmup_then_cosine_to_ten_percent() -> None:
    assert lr_at(0, 1.0, 10, 100) == pytest.approx(0.1)
    assert lr_at(9, 1.0, 10, 100) == pytest.approx(1.0)
    assert lr_at(10, 1.0, 10, 100) == pytest.approx(1.0)
    assert lr_at(100, 1.0, 10, 100) == pytest.approx(0.1)
    mid = lr_at(55, 1.0, 10, 100)
    assert mid == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))


def test_checkpoint_is_atomic_and_keeps_the_newest(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        checkpoint.save_stage(tmp_path, 1, step, {"x": torch.tensor([step])})
    assert checkpoint.steps_available(tmp_path, 1) == [4, 6]
    assert checkpoint.load_stage(tmp_path, 1, 6)["x"].item() == 6
    # A write that fails halfway leaves the previous file intact and no temp file behind.
    with pytest.raises(Exception):  # noqa: B017 - any pickling error
        checkpoint.atomic_save({"bad": lambda: 0}, checkpoint.path_for(tmp_path, 1, 6))
    assert checkpoint.load_stage(tmp_path, 1, 6)["x"].item() == 6
    assert sorted(p.name for p in (tmp_path / "stage-1").iterdir()) == [
        "step-00000004.manifest.json", "step-00000004.pt",
        "step-00000006.manifest.json", "step-00000006.pt",
    ]
    with pytest.raises(FileNotFoundError, match="shared storage"):
        checkpoint.load_stage(tmp_path, 0, 6)


def test_assignments_for_the_papers_model_on_5x2() -> None:
    from protos.dtfm.v1 import common_pb2

    spec, layout = get_preset("gpt-1.3b"), Layout(5, 2)
    msgs = build_assignments(job_id="j", epoch=0, layout=layout, spec=spec,
                             train=TrainConfig(global_batch=8), master_addr="127.0.0.1",
                             master_port=1234, backend="nccl")
    assert [m.rank for m in msgs] == list(range(10))
    assert [(m.layer_begin, m.layer_end) for m in msgs[:5]] == [
        (0, 5), (5, 10), (10, 15), (15, 20), (20, 24)
    ]
    m = common_pb2.Assignment.FromString(msgs[7].SerializeToString())
    assert (m.stage, m.replica, m.prev_rank, m.next_rank) == (2, 1, 6, 8)
    assert list(m.dp_group_ranks) == [2, 7] and list(m.layer_splits) == [5, 5, 5, 5, 4]
    assert msgs[0].prev_rank == -1 and msgs[4].next_rank == -1
    assert m.model.n_layers == 24 and m.train.global_batch == 8


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--stages", "5"], "cannot split 4 layers into 5 stages"),
        (["--batch", "6"], "not divisible"),
        (["--layer-splits", "3,2"], "layer splits"),
        (["--model", "gpt-nope"], "unknown model preset"),
    ],
)
def test_launcher_rejects_bad_flags_before_spawning(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from agent.commands.local import main

    assert main(flags) == 2
    assert message in capsys.readouterr().err


class _Planted:
    """An object whose unpickling would run code: what a hostile checkpoint would hold."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.target}",))


def test_checkpoint_refuses_pickled_objects_and_is_private(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    checkpoint.save_stage(root, 0, 2, {"x": torch.tensor([1.0])})
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(root / "stage-0").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(checkpoint.path_for(root, 0, 2)).st_mode) == 0o600
    planted = tmp_path / "planted"
    # whoever can plant a file can write its manifest too: the checksum is no defence here
    checkpoint.save_stage(root, 0, 4, {"x": _Planted(planted)})
    with pytest.raises(ValueError, match="other than tensors and plain types"):
        checkpoint.load_stage(root, 0, 4)
    assert not planted.exists()


def test_checkpoint_of_a_real_optimizer_loads_weights_only(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
             "data_position": {"epoch": 1, "index": 7}, "layers": [0, 2]}
    checkpoint.save_stage(tmp_path, 0, 1, state)
    loaded = checkpoint.load_stage(tmp_path, 0, 1)
    opt.load_state_dict(loaded["optimizer"])
    assert loaded["data_position"] == {"epoch": 1, "index": 7} and loaded["layers"] == [0, 2]
