"""The user-facing edges of LoRA fine-tuning, export and generation (issue 41 items 8, 10-13):
each careless or hostile input is refused by the real command before anything trains or
loads, in one message naming the flag and the file, never a traceback or a lost base model.

- an export directory that is the base model, holds it, or lies inside it (symlinks
  resolved): `agent local`, `coordinator start`, `coordinator export` (item 8);
- an adapter directory whose adapter_config.json disagrees with its tensors (`r` 16,
  rank-4 tensors), in `agent generate` and `agent local` (item 10);
- a --lora-rank above the adapted projections' sizes (item 11);
- --export-merged into a place that cannot be written, before training (item 12);
- --lora-alpha without --lora-rank, --lora-init /missing, a safetensors header claiming
  1 TiB, a shape-mismatched adapter, unreadable adapter_config.json, and the flag the user
  typed in "is not a directory" (item 13).

Tiny random models from `tests.hflib`; nothing downloads, no worker starts."""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from agent import cli
from agent.commands import local as local_cmd
from dtfm.core import lora
from dtfm.core.hfdir import spec_from_dir
from dtfm.core.hfexport import ExportError
from dtfm.core.spec import TrainConfig
from tests.daemons import Daemons
from tests.hflib import saved

pytestmark = pytest.mark.timeout(180)

START = ("coordinator", "start", "--listen", "127.0.0.1:0")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama (width 32, kv 16: adapters of rank <= 16)."""
    return saved(tmp_path_factory.mktemp("base"), "llama")[0]


def adapter_dir(into: Path, base: Path, *, rank: int, config_r: int | None = None,
                targets: str = "", bad_shape: bool = False) -> Path:
    """A peft adapter directory for `base` whose tensors have rank `rank` and whose
    adapter_config.json says r = `config_r` (default: `rank`)."""
    spec = spec_from_dir(base)
    cfg = TrainConfig(lora_rank=rank, lora_targets=targets)
    tensors = {}
    for layer in range(spec.n_layers):
        for p in lora.targeted(spec, targets):
            cols = p.in_features + (1 if bad_shape else 0)
            tensors[lora.peft_name(spec, layer, p, "A")] = torch.randn(rank, cols)
            tensors[lora.peft_name(spec, layer, p, "B")] = torch.zeros(p.out_features, rank)
    into.mkdir(parents=True)
    save_file(tensors, str(into / lora.ADAPTER_WEIGHTS))
    config = lora.adapter_config(spec, TrainConfig(lora_rank=config_r or rank,
                                                   lora_targets=targets), str(base))
    (into / lora.ADAPTER_CONFIG).write_text(json.dumps(config))
    assert cfg.lora_rank == rank
    return into


def _local(tmp_path: Path, capsys: pytest.CaptureFixture, *flags: str) -> tuple[int, str]:
    work = tmp_path / "work"
    rc = local_cmd.main(["--workdir", str(work), "--steps", "1", "--stages", "1",
                         "--replicas", "1", *flags])
    assert not work.exists() or not list(work.glob("*.assignment.pb")), "a worker started"
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return rc, err


def _generate(capsys: pytest.CaptureFixture, model_dir: Path) -> tuple[int, str]:
    rc = cli.main(["generate", "--model-dir", str(model_dir), "--prompt-ids", "1,2",
                   "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return rc, err


def _refused(out: object, *mentions: str) -> None:
    stderr = out.stderr.strip()  # type: ignore[attr-defined]
    assert out.returncode == 2, (out.returncode, stderr)  # type: ignore[attr-defined]
    assert "Traceback" not in stderr, stderr
    for mention in mentions:
        assert mention in stderr, stderr


def _digest(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# item 8 -------------------------------------------------------------------------------------

def test_agent_local_refuses_to_export_over_its_base(tmp_path: Path, base: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    before = _digest(base)
    link = tmp_path / "link"
    link.symlink_to(base)
    for out, where in ((base, "is the base model"), (link, "is the base model"),
                       (base.parent, "holds the base model"),
                       (base / "adapter", "is inside the base model")):
        rc, err = _local(tmp_path, capsys, "--init-from", str(base), "--lora-rank", "4",
                         "--export-dir", str(out), "--force")
        assert rc == 2, err
        assert f"--export-dir {out} {where} --init-from {base}" in err, err
    assert _digest(base) == before and not (base / "adapter").exists()


def test_coordinator_start_refuses_to_export_over_its_base(daemons: Daemons,
                                                           base: Path) -> None:
    for out, where in ((base.parent, "holds"), (base / "adapter", "is inside")):
        _refused(daemons.cli(*START, "--init-from", str(base), "--lora-rank", "4",
                             "--export-dir", str(out), timeout=60),
                 f"--export-dir {out} {where} the base model --init-from {base}")
    assert not (base / "adapter").exists()


def test_coordinator_export_refuses_a_lora_jobs_base(tmp_path: Path, base: Path) -> None:
    from coordinator.job.export import export_from_status
    from dtfm.core.loraexport import lora_source
    from dtfm.rpc import Security
    from protos.dtfm.v1 import coordinator_pb2

    spec = spec_from_dir(base)
    status = coordinator_pb2.ClusterStatus(job=coordinator_pb2.JobStatus(
        job_id="j", model_spec=spec.to_proto()))
    status.job.export_source.lora.CopyFrom(
        lora_source(TrainConfig(lora_rank=4, init_from=str(base))))
    with pytest.raises(ExportError, match=f"--out {base} is the base model"):
        asyncio.run(export_from_status(status, Security(token=""), base, force=True))


# item 10 and 13: adapters that disagree with their config, or are damaged ---------------

def test_an_adapter_whose_config_disagrees_with_its_tensors_is_refused_by_both_commands(
        tmp_path: Path, base: Path, capsys: pytest.CaptureFixture) -> None:
    ad = adapter_dir(tmp_path / "ad", base, rank=4, config_r=16)
    weights = ad / lora.ADAPTER_WEIGHTS
    rc, err = _generate(capsys, ad)  # (the header lists down_proj's A first)
    assert rc == 2, err
    assert "--model-dir: tensor base_model.model.model.layers.0." in err, err
    assert f"in {weights} has shape [4, 64] (rank 4), but adapter_config.json's r is 16: " \
        f"fix r in {ad / lora.ADAPTER_CONFIG}" in err, err
    rc, err = _local(tmp_path, capsys, "--init-from", str(ad))
    assert rc == 2, err
    assert "--init-from: tensor " in err and "(rank 4), but adapter_config.json's r is 16" in err
    # --lora-init with a rank flag of its own
    rc, err = _local(tmp_path, capsys, "--init-from", str(base), "--lora-rank", "8",
                     "--lora-init", str(ad))
    assert rc == 2 and "--lora-init: tensor" in err, err
    assert "(rank 4), but --lora-rank is 8: give --lora-rank 4" in err, err


def test_adapters_of_other_targets_or_shapes_are_refused(tmp_path: Path, base: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    wrong = adapter_dir(tmp_path / "shape", base, rank=4, bad_shape=True)
    rc, err = _generate(capsys, wrong)
    assert rc == 2 and "has shape [4, 65] but the base model's projection needs [4, 64]" in err
    fewer = adapter_dir(tmp_path / "fewer", base, rank=4, targets="q_proj")
    config = json.loads((fewer / lora.ADAPTER_CONFIG).read_text())
    (fewer / lora.ADAPTER_CONFIG).write_text(json.dumps({**config, "target_modules":
                                                         ["q_proj", "v_proj"]}))
    rc, err = _generate(capsys, fewer)
    assert rc == 2 and "lacks adapter" in err and "v_proj" in err, err


def test_a_header_claiming_a_terabyte_is_one_line(tmp_path: Path, base: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    ad = adapter_dir(tmp_path / "huge", base, rank=4)
    (ad / lora.ADAPTER_WEIGHTS).write_bytes(struct.pack("<Q", 2**40) + b"{}")
    rc, err = _generate(capsys, ad)
    assert rc == 2 and "its header claims 1099511627776 bytes" in err, err
    rc, err = _local(tmp_path, capsys, "--init-from", str(ad))
    assert rc == 2 and "its header claims 1099511627776 bytes" in err, err


def test_unreadable_adapter_config_names_the_file(tmp_path: Path, base: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    ad = adapter_dir(tmp_path / "json", base, rank=4)
    (ad / lora.ADAPTER_CONFIG).write_text("{not json")
    rc, err = _generate(capsys, ad)
    assert rc == 2 and "adapter_config.json is not readable JSON" in err and str(ad) in err
    (ad / lora.ADAPTER_CONFIG).write_text(json.dumps(
        {**lora.adapter_config(spec_from_dir(base), TrainConfig(lora_rank=4), str(base)),
         "lora_alpha": "big"}))
    rc, err = _generate(capsys, ad)
    assert rc == 2 and "lora_alpha must be a number > 0, got 'big'" in err, err


# item 11 ------------------------------------------------------------------------------------

def test_a_rank_above_the_projections_is_refused(tmp_path: Path, daemons: Daemons,
                                                 capsys: pytest.CaptureFixture) -> None:
    rc, err = _local(tmp_path, capsys, "--lora-rank", "100000")
    assert rc == 2 and "--lora-rank 100000 exceeds 64" in err and "attn.c_attn" in err, err
    _refused(daemons.cli(*START, "--model", "gpt-tiny", "--agents", "1", "--lora-rank",
                         "65", timeout=60), "--lora-rank 65 exceeds 64")


# item 12 ------------------------------------------------------------------------------------

def test_export_merged_into_an_unwritable_place_is_refused_before_training(
        tmp_path: Path, daemons: Daemons, capsys: pytest.CaptureFixture) -> None:
    out = "/proc/dtfm-no/out"
    rc, err = _local(tmp_path, capsys, "--lora-rank", "2", "--export-dir", out,
                     "--export-merged")
    assert rc == 2 and f"--export-dir {out}: cannot write a directory in" in err, err
    _refused(daemons.cli(*START, "--model", "gpt-tiny", "--agents", "1", "--lora-rank", "2",
                         "--export-dir", out, "--export-merged", timeout=60),
             f"--export-dir {out}: cannot write a directory in")


def test_the_merged_writer_fails_as_an_export_error(base: Path) -> None:
    from agent.worker.loramerge import write_merged_export

    spec = spec_from_dir(base)
    with pytest.raises(ExportError, match="cannot write a directory in /proc"):
        write_merged_export("/proc/dtfm-no/out", spec, TrainConfig(lora_rank=2), [])


# item 13 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", [["--lora-alpha", "16"], ["--lora-dropout", "0.1"]])
def test_a_lora_flag_without_a_rank_is_refused(tmp_path: Path, flag: list[str],
                                               capsys: pytest.CaptureFixture) -> None:
    rc, err = _local(tmp_path, capsys, *flag)
    assert rc == 2 and f"{flag[0]} applies with --lora-rank" in err, err


def test_coordinator_refuses_lora_alpha_without_a_rank(daemons: Daemons) -> None:
    _refused(daemons.cli(*START, "--model", "gpt-tiny", "--agents", "1", "--lora-alpha", "16",
                         timeout=60), "--lora-alpha applies with --lora-rank")


def test_a_missing_lora_init_is_refused_at_the_edge(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "missing"
    rc, err = _local(tmp_path, capsys, "--lora-rank", "2", "--lora-init", str(missing))
    assert rc == 2 and f"--lora-init {missing}: no such directory" in err, err


def test_not_a_directory_names_the_flag_typed(tmp_path: Path, daemons: Daemons,
                                              capsys: pytest.CaptureFixture) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    rc, err = _local(tmp_path, capsys, "--export-dir", str(afile))
    assert rc == 2 and f"--export-dir {afile} exists and is not a directory" in err, err
    assert "--out" not in err
    out = daemons.cli(*START, "--export-dir", str(afile), timeout=60)
    _refused(out, f"--export-dir {afile} exists and is not a directory")
    assert "--out" not in out.stderr
