"""Which device a worker trains on: the backend, and for the dtfm transport the data plane's
`gpu` flag (a GPU job whose members cannot all accept connections still trains on GPUs)."""

from __future__ import annotations

import pytest
import torch

from agent.worker.device import pick_device


def test_cpu_unless_nccl_or_a_gpu_data_plane() -> None:
    assert pick_device("gloo", 3) == torch.device("cpu")
    assert pick_device("dtfm", 3) == torch.device("cpu")
    assert pick_device("dtfm", 3, gpu=False) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
@pytest.mark.parametrize(("backend", "gpu", "asked"), [
    ("nccl", False, "NCCL"), ("dtfm", True, "the dtfm data plane's gpu flag")])
def test_a_gpu_assignment_on_a_machine_without_one_says_what_to_check(
        backend: str, gpu: bool, asked: str) -> None:
    with pytest.raises(RuntimeError, match=asked) as err:
        pick_device(backend, 0, gpu=gpu)
    assert "nvidia-smi" in str(err.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_data_plane_trains_on_this_ranks_gpu() -> None:
    assert pick_device("dtfm", 0, gpu=True).type == "cuda"
