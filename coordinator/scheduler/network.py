"""The validated link matrix a plan is computed on.

`Network` owns the checks at the boundary: every matrix that reaches the cost model (a paper
scenario, a measured matrix from agents, a JSON file) goes through it, so the cost model can
assume a square float matrix with positive bandwidth and non-negative delay off the diagonal.
Row = sending device, column = receiving device; the diagonal is ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, eq=False)
class Network:
    """Per ordered pair of devices: one-way delay in ms and bandwidth in Gbit/s."""

    delay_ms: np.ndarray
    bandwidth_gbps: np.ndarray

    @classmethod
    def measured(cls, delay_ms: np.ndarray, bandwidth_gbps: np.ndarray) -> Network:
        """A measured matrix with its diagonal (a device to itself: never measured, NaN in a
        LinkMatrix) set to 0 ms and 1 Gbit/s, so code that reads whole rows need not skip it."""
        delay = np.array(delay_ms, dtype=float)
        bandwidth = np.array(bandwidth_gbps, dtype=float)
        np.fill_diagonal(delay, 0.0)
        np.fill_diagonal(bandwidth, 1.0)
        return cls(delay_ms=delay, bandwidth_gbps=bandwidth)

    def __post_init__(self) -> None:
        delay = _as_matrix(self.delay_ms, "delay_ms")
        bw = _as_matrix(self.bandwidth_gbps, "bandwidth_gbps")
        if delay.shape != bw.shape:
            raise ValueError(
                f"delay_ms is {delay.shape[0]}x{delay.shape[1]} but bandwidth_gbps is "
                f"{bw.shape[0]}x{bw.shape[1]}: give both matrices for the same devices"
            )
        off = ~np.eye(delay.shape[0], dtype=bool)
        bad = off & ~(bw > 0)  # catches NaN, zero and negative
        if bad.any():
            i, j = np.argwhere(bad)[0]
            raise ValueError(
                f"bandwidth_gbps[{i}][{j}] = {bw[i, j]!r}: every off-diagonal bandwidth must "
                f"be a positive number of Gbit/s"
            )
        bad = off & ~(np.isfinite(delay) & (delay >= 0))
        if bad.any():
            i, j = np.argwhere(bad)[0]
            raise ValueError(
                f"delay_ms[{i}][{j}] = {delay[i, j]!r}: every off-diagonal delay must be a "
                f"finite number of milliseconds >= 0"
            )
        delay = delay.copy()
        bw = bw.copy()
        np.fill_diagonal(delay, 0.0)
        np.fill_diagonal(bw, np.inf)
        delay.setflags(write=False)
        bw.setflags(write=False)
        object.__setattr__(self, "delay_ms", delay)
        object.__setattr__(self, "bandwidth_gbps", bw)

    @property
    def size(self) -> int:
        return int(self.delay_ms.shape[0])

    def link_cost(self, gigabytes: float) -> np.ndarray:
        """Seconds to send `gigabytes` GB over each link: alpha/1000 + 8*S/beta (diagonal 0)."""
        cost = self.delay_ms / 1000.0 + 8.0 * gigabytes / self.bandwidth_gbps
        np.fill_diagonal(cost, 0.0)
        return cost

    def subset(self, devices: Sequence[int]) -> Network:
        idx = np.asarray(devices, dtype=np.int64)
        return Network(self.delay_ms[np.ix_(idx, idx)], self.bandwidth_gbps[np.ix_(idx, idx)])

    def to_json(self) -> dict[str, Any]:
        delay = np.array(self.delay_ms)
        bw = np.array(self.bandwidth_gbps)
        np.fill_diagonal(bw, 0.0)  # JSON has no infinity; the diagonal is ignored anyway
        return {"delay_ms": delay.tolist(), "bandwidth_gbps": bw.tolist()}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Network:
        """From `{"delay_ms": [[...]], "bandwidth_gbps": [[...]]}` (extra keys are ignored)."""
        if not isinstance(obj, Mapping):
            raise ValueError("a link file must hold a JSON object with delay_ms and bandwidth_gbps")
        missing = [k for k in ("delay_ms", "bandwidth_gbps") if k not in obj]
        if missing:
            raise ValueError(
                f"link file lacks {', '.join(missing)}: it needs "
                '{"delay_ms": [[...]], "bandwidth_gbps": [[...]]}'
            )
        return cls(np.asarray(_rows(obj["delay_ms"], "delay_ms")),
                   np.asarray(_rows(obj["bandwidth_gbps"], "bandwidth_gbps")))


def _rows(value: Any, name: str) -> list[list[float]]:
    if not isinstance(value, list) or not all(isinstance(r, list) for r in value):
        raise ValueError(f"{name} must be a list of rows (a list of lists of numbers)")
    n = len(value)
    for i, row in enumerate(value):
        if len(row) != n:
            raise ValueError(
                f"{name} is not square: it has {n} rows but row {i} has {len(row)} entries; "
                f"give an N x N matrix"
            )
    try:
        return [[float(x) for x in row] for row in value]
    except (TypeError, ValueError):
        raise ValueError(f"{name} holds a value that is not a number") from None


def _as_matrix(value: Any, name: str) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a numeric N x N matrix") from None
    if arr.ndim != 2 or arr.shape[0] != arr.shape[1]:
        raise ValueError(
            f"{name} must be a square N x N matrix, got shape {tuple(arr.shape)}; "
            f"row = from, column = to"
        )
    if arr.shape[0] < 1:
        raise ValueError(f"{name} is empty: give at least one device")
    return arr
