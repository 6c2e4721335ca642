"""int4h is priced with its rotation, and `coordinator plan` says why each link got its codec.

int4h sends int4's bytes after a block Hadamard rotation (agent/worker/rotate.py). Its extra
compute (`ROTATE_COST` x the quantizers') is counted in the step model and, were it on
`auto`'s ladder (it is not yet: `dtfm.core.codecs.PP_LOSSINESS`; the tests put it in int4's
place), in the choice. `coordinator plan` prints the bandwidth below which each rung pays.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator.scheduler import compression
from coordinator.scheduler.compression import MIN_GAIN, ROTATE_COST, Compression
from coordinator.scheduler.network import Network
from coordinator.scheduler.steptime import StepShape, simulate_step
from dtfm.core.codecs import Codec

ROOT = Path(__file__).resolve().parents[3]


def _pair(gbps: float) -> Network:
    return Network(np.array([[0.0, 1.0], [1.0, 0.0]]), np.full((2, 2), gbps))


@pytest.fixture
def int4h_ladder(monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto`'s pipeline ladder with int4h in int4's place."""
    monkeypatch.setattr(compression, "PP_LOSSINESS", ("none", "int8", "int4h"))


def test_auto_does_not_take_int4h_yet() -> None:
    assert [c.name for c in Compression("auto", "auto").pp_options] == ["none", "int8", "int4"]


@pytest.mark.usefixtures("int4h_ladder")
@pytest.mark.parametrize(("device_s", "raw"), [(3.0, 4), (3.0, 2), (0.02, 2), (0.5, 4)])
def test_thresholds_are_where_the_choice_changes(device_s: float, raw: int) -> None:
    comp = Compression("auto", "none", codec_s_per_gb=device_s, act_raw_bytes=raw)
    (c8, g8), (c4, g4) = comp.pp_thresholds_gbps()
    assert (c8, c4) == ("int8", "int4h") and 0 < g4 <= g8 < float("inf")
    rungs = ["none", "int8", "int4h"]
    for gbps in np.geomspace(g4 / 3, g8 * 3, 60):
        got = rungs.index(comp.choose(_pair(gbps), [[0], [1]]).pp[0][0])
        assert (got >= 1) == (gbps < g8), (gbps, got)  # compressed below int8's threshold
        if gbps < g4:
            assert got == 2, (gbps, got)  # 4 bits all the way down from int4h's


@pytest.mark.usefixtures("int4h_ladder")
def test_the_rotation_is_priced() -> None:
    """A dearer codec lowers the bandwidth below which 4 bits pay; free codecs: always."""
    comp = Compression("auto", "none", codec_s_per_gb=3.0)
    g4h = comp.pp_thresholds_gbps()[1][1]
    keep = 1 - MIN_GAIN
    # fp32 over a CPU's codec: int8 is taken first, and int4h must then beat it by a quarter:
    # 8 r4 / b + 2 k <= keep (8 r8 / b + k), k the quantizers' 3 s per GB
    wire = 8 * (keep * Codec("int8").ratio_to(4) - Codec("int4").ratio_to(4))
    assert g4h == pytest.approx(wire / (3.0 * (ROTATE_COST - keep)), rel=1e-6)
    plain = wire / (3.0 * (1 - keep))  # plain int4's threshold, at the quantizers' cost
    assert g4h < plain  # where plain int4 would just have paid, the link stays int8
    assert dict(Compression("auto", "none", codec_s_per_gb=0.0).pp_thresholds_gbps()) == {
        "int8": float("inf"), "int4h": float("inf")}


def test_step_model_counts_int4hs_codec_time() -> None:
    # a fast link: the step is compute-free, so its pipeline time is wire + codec time
    net = _pair(1000.0)
    steps = {}
    for name in ("int4", "int4h"):
        shape = StepShape(micro_batches=2, act_bytes=4e6, grad_bytes=[0.0, 0.0],
                          compression=Compression(name, "none", codec_s_per_gb=3.0))
        steps[name] = simulate_step(net, [[0], [1]], shape).pipeline_s
    wire = simulate_step(net, [[0], [1]], StepShape(
        micro_batches=2, act_bytes=4e6, grad_bytes=[0.0, 0.0],
        compression=Compression("int4", "none", codec_s_per_gb=0.0))).pipeline_s
    assert steps["int4h"] - wire == pytest.approx(ROTATE_COST * (steps["int4"] - wire))


def test_plan_says_why(tmp_path: Path) -> None:
    links = tmp_path / "links.json"
    links.write_text(json.dumps(_pair(0.05).to_json()))
    common = ("--links", str(links), "--stages", "2", "--replicas", "1", "--budget", "5",
              "--random", "1", "--pp-gb", "0.1", "--dp-gb", "0.1", "--codec-device", "cpu",
              "--pp-compress", "auto")
    p = subprocess.run([sys.executable, "-m", "coordinator.commands.plan", *common],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    why = next(line for line in p.stdout.splitlines() if line.startswith("why:"))
    assert "int8 below" in why and "int4 below" in why and "a quarter" in why
    j = subprocess.run([sys.executable, "-m", "coordinator.commands.plan", *common, "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    got = json.loads(j.stdout)["compression"]
    assert got["pp_links"] == [["int4"]]
    assert list(got["pp_thresholds_gbps"]) == ["int8", "int4"]
    fixed = subprocess.run([sys.executable, "-m", "coordinator.commands.plan", *common[:-1],
                            "int4h", "--json"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert json.loads(fixed.stdout)["compression"]["pp_links"] == [["int4h"]]
