"""What this machine trains on, told to the coordinator when joining.

CUDA is detected without importing torch unless a GPU is present (torch takes seconds to
import); the FLOP/s figure is a quick matmul measurement, good enough to tell machines apart.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import numpy as np

from protos.dtfm.v1 import common_pb2


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def cpu_flops(seconds: float = 0.1, n: int = 256) -> float:
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ a
        done += 1
    return 2.0 * n**3 * done / (time.perf_counter() - start)


def detect(kind: str = "auto") -> common_pb2.DeviceInfo:
    if kind == "cuda" or (kind == "auto" and Path("/dev/nvidia0").exists()):
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return common_pb2.DeviceInfo(
                kind="cuda", name=props.name, memory_bytes=props.total_memory,
                cores=props.multi_processor_count,
            )
        if kind == "cuda":
            raise RuntimeError("--device cuda was given but torch sees no CUDA device")
    return common_pb2.DeviceInfo(
        kind="cpu", name=_cpu_name(), memory_bytes=_ram_bytes(), flops=cpu_flops(),
        cores=os.cpu_count() or 0,
    )
