"""bench/adapters.py without the emulator: its flags, the comparison against full fine-tuning
that decides the issue's targets, the priced ratio at scale, and the /proc poll that finds the
job's workers' peak memory (a real process standing in for a worker)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import adapters


def test_wan_is_the_default_and_each_mode_writes_its_own_file() -> None:
    args = adapters.parse_args([])
    assert (args.mode, args.model, args.per_city, args.stages) == ("wan", "gpt-small", 2, 4)
    assert args.rank_list == [0, 8, 64]
    assert args.out.endswith("adapters_wan.json")
    loop = adapters.parse_args(["--mode", "loopback", "--ranks", "4"])
    assert loop.out.endswith("adapters.json") and loop.rank_list == [0, 4]


@pytest.mark.parametrize("bad", ["8,x", "0,8", "-8"])
def test_bad_ranks_are_refused_with_what_to_give(bad: str) -> None:
    with pytest.raises(SystemExit) as exc:
        adapters.parse_args(["--ranks", bad])
    assert "--ranks" in str(exc.value)


def _row(rank: int, dp: float, opt: int, tok: float, pred: float | None,
         meas: float | None) -> dict[str, object]:
    return {"variant": adapters.label(rank), "rank": rank, "dp_bytes_per_step": dp,
            "opt_grad_bytes_max_stage": opt, "tokens_per_s": tok, "predicted_step_s": pred,
            "measured_step_s": meas, "peak_rss_mib": 300.0, "val_loss": 4.0}


def test_compare_decides_rank_8s_targets_and_every_rows_prediction() -> None:
    rows = [_row(0, 2e7, 12_000_000, 1000.0, 5.5, 5.0), _row(8, 1e5, 600_000, 2500.0, 2.0, 2.1),
            _row(64, 8e5, 4_800_000, 1800.0, 3.0, 2.0)]
    met = adapters.compare(rows)
    assert rows[1]["dp_bytes_x"] == 200 and rows[1]["opt_grad_memory_x"] == 20
    assert rows[1]["tokens_per_s_x"] == 2.5
    assert rows[0]["prediction_err_pct"] == pytest.approx(10.0)
    assert rows[2]["prediction_err_pct"] == pytest.approx(50.0)  # r64: off by half
    assert met == {"dp_bytes_x": True, "opt_grad_memory_x": True, "tokens_per_s_x": True,
                   "prediction_err_pct": False}
    table = adapters.table(rows).splitlines()
    assert len(table) == 4 and table[2].split()[:3] == ["lora-r8", "100000", "200"]


def test_compare_without_rank_8_or_predictions_says_not_applicable() -> None:
    rows = [_row(0, 2e7, 12_000_000, 1000.0, None, None),
            _row(64, 8e5, 4_800_000, 1800.0, None, None)]
    met = adapters.compare(rows)
    assert set(met.values()) == {None}
    assert "-" in adapters.table(rows).splitlines()[1].split()


def test_priced_ratio_grows_with_the_model_width() -> None:
    small = adapters.priced_at_scale("gpt-small", 4, 8)
    big = adapters.priced_at_scale("gpt-1.3b", 4, 8)
    assert 20 < small < 30 and big > 100  # about 0.75 d / R, plus the embeddings


@pytest.mark.timeout(60)
def test_worker_peaks_finds_only_workers_under_the_clusters_directory(tmp_path: Path) -> None:
    ours = tmp_path / "cluster"
    ours.mkdir()
    keep = "import time; x = bytearray(64 << 20); time.sleep(30)"
    procs = [subprocess.Popen([sys.executable, "-c", keep, "agent.worker", str(where)])
             for where in (ours, tmp_path / "elsewhere")]
    try:
        peaks = adapters.WorkerPeaks(ours)
        for _ in range(100):
            peaks.poll()
            if peaks.peaks.get(procs[0].pid, 0) > 64 << 20:
                break
            subprocess.run(["sleep", "0.1"], check=True)
        assert peaks.peaks.get(procs[0].pid, 0) > 64 << 20
        assert procs[1].pid not in peaks.peaks
    finally:
        for p in procs:
            p.kill()
            p.wait()
