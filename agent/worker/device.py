"""Which device a worker computes on, and in which dtype.

Owns the choice apart from the training loop (`train.py`): CPU for gloo, for NCCL (or the
dtfm transport of a job whose every member has a GPU) the GPU of this local rank, and the
autocast dtype of `--dtype`. An assignment that asks for a GPU this machine lacks fails here,
at start-up, with what to check, instead of at the first tensor moved.
"""

from __future__ import annotations

import os

import torch


def pick_device(backend: str, rank: int, gpu: bool = False) -> torch.device:
    """CPU for gloo; for NCCL, or the dtfm transport of a GPU job (`gpu`: the data plane's
    `gpu`, every member has one), the GPU of this local rank (LOCAL_RANK, else rank modulo
    count)."""
    if backend != "nccl" and not gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        asked = "NCCL" if backend == "nccl" else f"a GPU (the {backend} data plane's gpu flag)"
        raise RuntimeError(f"the assignment asks for {asked} but this machine has no CUDA "
                           f"device: the agent reported one at registration; check "
                           f"nvidia-smi and CUDA_VISIBLE_DEVICES, then restart the agent")
    local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def autocast_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    if dtype == "fp32":
        return None
    if dtype == "bf16":
        return torch.bfloat16
    raise ValueError(f"dtype {dtype!r} is not supported by the worker; use fp32 or bf16")
