"""NaN weights stop training with a clear error, and `agent generate` says so in one line.

Before, a model whose weights held NaN trained to "done" (exit 0) with `loss nan`, and
`agent generate` on it died in a traceback from `torch.multinomial` (greedy printed token 0
over and over). Now the worker raises `errors.NonFiniteLoss` before the optimizer step, an
error of kind `config`, which the coordinator fails the job on at once instead of retrying
(`tests/coordinator/test_job.py::test_a_config_error_fails_the_job_at_once`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from agent import cli  # noqa: E402
from agent.worker import errors  # noqa: E402
from tests.agent.worker.testlib import run_local  # noqa: E402
from tests.daemons import Daemons, wait_for  # noqa: E402
from tests.hflib import saved  # noqa: E402

BAD = "transformer.h.0.mlp.c_fc.weight"


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = saved(tmp_path_factory.mktemp("nan"), "gpt2")
    tensors = load_file(path / "model.safetensors")
    tensors[BAD][0, 0] = float("nan")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_a_non_finite_loss_is_a_config_error() -> None:
    e = errors.NonFiniteLoss(3, float("nan"), 1.0)
    assert errors.classify(e, errors.TRAIN) == errors.CONFIG
    assert "the loss of step 3 is nan" in str(e) and "--lr" in str(e)
    inf_norm = errors.NonFiniteLoss(2, 5.0, float("inf"))
    assert "the gradient norm of step 2 is inf" in str(inf_norm)


@pytest.mark.timeout(180)
def test_nan_weights_stop_the_local_job_with_a_config_error(nan_model: Path,
                                                             tmp_path: Path) -> None:
    work = tmp_path / "work"
    run = run_local("--init-from", str(nan_model), "--stages", "2", "--replicas", "1",
                    "--batch", "2", "--micro-batches", "1", "--steps", "3",
                    "--eval-batches", "1", "--timeout", "30", "--workdir", str(work))
    assert run.rc == 1, run.stderr
    assert run.steps == [] and run.done is None
    assert "NonFiniteLoss: the loss of step 1 is nan, not a finite number" in run.stderr
    events = [json.loads(line) for p in sorted(work.glob("*.progress.jsonl"))
              for line in p.read_text().splitlines()]
    failed = [e for e in events if e["event"] == "error"]
    assert len(failed) == 2, events  # both ranks stop alike: no peer error hides the cause
    assert all(e["kind"] == "config" and e["phase"] == "train" for e in failed), failed


@pytest.mark.parametrize("how", [["--greedy"], ["--temperature", "0.8"]])
def test_generate_on_nan_weights_fails_in_one_line(nan_model: Path, how: list[str],
                                                   capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["generate", "--model-dir", str(nan_model), "--prompt-ids", "1,2",
                     *how]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "are not finite numbers" in err and f"weights hold NaN or inf values: {BAD}" in err


@pytest.mark.timeout(240)
def test_a_cluster_job_on_nan_weights_fails_at_once_without_retrying(
        nan_model: Path, daemons: Daemons) -> None:
    """The real coordinator and agents: the workers' `config` error fails the job in its
    first epoch, with the worker's reason, instead of a recovery that diverges again."""
    _, address = daemons.coordinator(
        "--init-from", str(nan_model), "--agents", "2", "--stages", "2", "--replicas", "1",
        "--steps", "5", "--batch", "2", "--micro-batches", "1", "--eval-batches", "1",
        "--no-measure", "--search-seconds", "1", "--max-restarts", "3")
    for i in range(2):
        daemons.agent(address, f"agent-{i}", "--no-prewarm")
    job = wait_for(lambda: (s := daemons.status(address)["job"])["state"] in ("done", "failed")
                   and s, 200, f"the job to end (logs in {daemons.tmp})", 1.0)
    assert job["state"] == "failed", job
    assert "NonFiniteLoss" in job["message"] and "invalid" in job["message"], job
    assert job["epoch"] == 1, job  # never rescheduled onto a second epoch
