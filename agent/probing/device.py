"""What this machine trains on, told to the coordinator when joining.

CUDA is detected without importing torch unless a GPU is present (torch takes seconds to
import). Throughput is a sustained matmul measurement (about half a second per dtype) and
memory is what is free when the agent starts: the coordinator sizes layer splits with both.
An operator can pin either (`agent start --flops X --memory BYTES`), which also skips the
measurement.

Several agents on one machine each see the whole machine's free RAM (or, on one GPU, the whole
GPU's), so each also reports which memory that is (`memory_pool`): the coordinator holds the
stages of all agents of one pool against it once. Pinned memory is the agent's own share and
has no pool.
"""

from __future__ import annotations

import hashlib
import os
import platform
import time
from pathlib import Path
from typing import Any

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


MEASURE_S = 0.5  # sustained: long enough to leave turbo bursts and caches behind


BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
MACHINE_ID = Path("/etc/machine-id")


def memory_pool(gpu: str = "") -> str:
    """An id every agent drawing on the same memory reports, and no other: a hash of the
    running kernel's boot id (every container and network namespace on one machine sees the
    same one, two machines never do; /etc/machine-id where it is unreadable) and, for a GPU,
    its UUID. Hashed with a dtfm prefix, as systemd asks of anything derived from these ids,
    so the ids themselves never leave the machine. "" when neither id can be read: the
    coordinator then counts this agent's memory as its own."""
    for path in (BOOT_ID, MACHINE_ID):
        try:
            machine = path.read_text().strip()
        except OSError:
            continue
        if machine:
            return hashlib.sha256(f"dtfm-memory-pool:{machine}:{gpu}".encode()).hexdigest()[:32]
    return ""


def cpu_flops(seconds: float = MEASURE_S, n: int = 512) -> float:
    """Sustained fp32 matmul FLOP/s of this CPU (numpy, all its BLAS threads), after a warm-up."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    a @ a  # warm-up: thread pool, page faults
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ a
        done += 1
    return 2.0 * n**3 * done / (time.perf_counter() - start)


def available_ram() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), 0 if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def cuda_flops(torch: Any, dtype: Any, seconds: float = MEASURE_S, n: int = 4096) -> float:
    """Sustained matmul FLOP/s of GPU 0 in `dtype`, timed between synchronizations."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.empty_like(a)
    torch.matmul(a, a, out=b)
    torch.cuda.synchronize()
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(8):
            torch.matmul(a, a, out=b)
        torch.cuda.synchronize()
        done += 8
    return 2.0 * n**3 * done / (time.perf_counter() - start)


def _cuda(measure: bool) -> common_pb2.DeviceInfo | None:
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    free, _ = torch.cuda.mem_get_info(0)
    info = common_pb2.DeviceInfo(kind="cuda", name=props.name, memory_bytes=props.total_memory,
                                 free_memory_bytes=free, cores=props.multi_processor_count)
    uuid = str(getattr(props, "uuid", "") or "")
    info.memory_pool = memory_pool(gpu=uuid) if uuid else ""  # no UUID: not known to share
    if measure:
        info.flops = cuda_flops(torch, torch.float32)
        info.flops_bf16 = cuda_flops(torch, torch.bfloat16)
    return info


def detect(kind: str = "auto", flops: float = 0.0, memory: int = 0) -> common_pb2.DeviceInfo:
    """This machine's device, measured; `flops`/`memory` (> 0) override the measurement.

    On CUDA both fp32 and bf16 throughput are measured (tensor cores make bf16 several times
    faster); on a CPU only fp32 (bf16 there is no faster), and `flops_bf16` stays 0."""
    info = None
    if kind == "cuda" or (kind == "auto" and Path("/dev/nvidia0").exists()):
        info = _cuda(measure=flops <= 0)
        if info is None and kind == "cuda":
            raise RuntimeError("--device cuda was given but torch sees no CUDA device")
    if info is None:
        info = common_pb2.DeviceInfo(
            kind="cpu", name=_cpu_name(), memory_bytes=_ram_bytes(),
            free_memory_bytes=available_ram(), flops=cpu_flops() if flops <= 0 else 0.0,
            cores=os.cpu_count() or 0, memory_pool=memory_pool(),
        )
    if flops > 0:
        info.flops, info.flops_bf16 = flops, flops
    if memory > 0:  # the operator's share for this agent: its own, in no pool
        info.memory_bytes = info.free_memory_bytes = memory
        info.memory_pool = ""
    return info
