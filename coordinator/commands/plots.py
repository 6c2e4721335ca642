"""Pictures for people: `coordinator plan --plot` and `coordinator report --plot`.

Owns every matplotlib call in the project. It is imported only when a plot is asked for, so the
daemon and the other commands never need matplotlib (`pip install 'dtfm[plot]'`). Figures are
drawn with the Agg canvas directly (no pyplot, no display, no global state).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

DPI = 110


def _save(fig: Figure, path: str) -> None:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=DPI, format="png")


def _grid_order(grid: Sequence[Sequence[int]]) -> tuple[list[int], list[str]]:
    """Devices stage by stage (a stage's replicas side by side) and their s/p labels."""
    order, labels = [], []
    for s, row in enumerate(grid):
        for p, device in enumerate(row):
            order.append(int(device))
            labels.append(f"s{s}/p{p}")
    return order, labels


def _masked(matrix: np.ndarray, order: list[int]) -> np.ma.MaskedArray:
    m = np.asarray(matrix, dtype=float)[np.ix_(order, order)]
    bad = ~np.isfinite(m) | np.eye(len(order), dtype=bool)
    return np.ma.masked_array(m, mask=bad)


def _norm(values: np.ma.MaskedArray, log: bool) -> Normalize:
    data = values.compressed()
    data = data[data > 0] if log else data
    if data.size == 0:
        return Normalize()
    low, high = float(data.min()), float(data.max())
    if log and high / low > 10:
        return LogNorm(low, high)
    return Normalize(low, high if high > low else low + 1)


def _heatmap(fig: Figure, ax: Axes, values: np.ma.MaskedArray, title: str, unit: str,
             ticks: list[str], grid: Sequence[Sequence[int]], log: bool) -> None:
    image = ax.imshow(values, cmap="viridis", norm=_norm(values, log), interpolation="nearest")
    fig.colorbar(image, ax=ax, shrink=0.8, label=unit)
    n, replicas = len(ticks), len(grid[0]) if grid else 1
    size = max(4.0, min(9.0, 260.0 / max(n, 1)))
    ax.set_xticks(range(n), ticks, rotation=90, fontsize=size)
    ax.set_yticks(range(n), ticks, fontsize=size)
    ax.set_title(title)
    ax.set_xlabel("to")
    ax.set_ylabel("from")
    for s in range(len(grid)):  # each stage's data-parallel group: one all-reduce block
        corner = s * replicas - 0.5
        ax.add_patch(Rectangle((corner, corner), replicas, replicas, fill=False,
                               edgecolor="white", linewidth=1.5))
    rows, cols = [], []
    for s in range(len(grid) - 1):  # pipeline hops: stage s of pipeline p -> stage s+1
        for p in range(replicas):
            rows.append(s * replicas + p)
            cols.append((s + 1) * replicas + p)
    ax.scatter(cols, rows, marker="o", s=12, facecolors="none", edgecolors="red",
               linewidths=1.0, label="pipeline hop")
    if rows:
        ax.legend(loc="upper right", fontsize=7, framealpha=0.7)


def plot_plan(delay_ms: np.ndarray, bandwidth_gbps: np.ndarray,
              grid: Sequence[Sequence[int]], path: str, title: str = "") -> None:
    """Both link matrices as heat maps, devices ordered and labelled by the plan's grid.

    White squares are the stages' data-parallel groups; red circles mark the pipeline hops
    (stage s to s+1 of the same pipeline) whose links carry activations.
    """
    order, ticks = _grid_order(grid)
    n = len(order)
    side = max(5.0, min(12.0, 3.0 + n * 0.14))
    fig = Figure(figsize=(2 * side + 2, side + 0.8), layout="constrained")
    fig.suptitle(title or f"plan: {len(grid)} stages x {len(grid[0])} pipelines")
    left, right = fig.subplots(1, 2)
    _heatmap(fig, left, _masked(delay_ms, order), "one-way delay", "ms", ticks, grid, False)
    _heatmap(fig, right, _masked(bandwidth_gbps, order), "bandwidth", "Gbit/s", ticks, grid,
             True)
    _save(fig, path)


def _by_epoch(points: list[dict[str, Any]], key: str) -> dict[int, tuple[list, list]]:
    out: dict[int, tuple[list, list]] = {}
    for p in points:
        value = p.get(key)  # val_loss: absent from reports older than --eval-every
        if value and math.isfinite(value):
            xs, ys = out.setdefault(p["epoch"], ([], []))
            xs.append(p["step"])
            ys.append(value)
    return out


def plot_history(data: dict[str, Any], path: str) -> None:
    """Loss, training and validation (top), and throughput with step time (bottom) by step,
    one line per epoch.

    `data` is `coordinator report --json`'s object. A dashed line marks the predicted step time.
    """
    fig = Figure(figsize=(10, 7), layout="constrained")
    fig.suptitle(f"job {data['job_id']} ({data['model']}): {data['state']}, "
                 f"{data['restarts']} restarts")
    top, bottom = fig.subplots(2, 1, sharex=True)
    for epoch, (xs, ys) in _by_epoch(data["points"], "loss").items():
        top.plot(xs, ys, marker=".", label=f"epoch {epoch}")
    for epoch, (xs, ys) in _by_epoch(data["points"], "val_loss").items():
        top.plot(xs, ys, marker="o", linestyle="--", label=f"validation, epoch {epoch}")
    top.set_ylabel("loss")
    top.grid(alpha=0.3)
    for epoch, (xs, ys) in _by_epoch(data["points"], "tokens_per_s").items():
        bottom.plot(xs, ys, marker=".", label=f"tokens/s, epoch {epoch}")
    bottom.set_ylabel("tokens/s")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    twin = bottom.twinx()
    for epoch, (xs, ys) in _by_epoch(data["points"], "step_s").items():
        twin.plot(xs, ys, color="gray", alpha=0.6, linewidth=1, label=f"s/step, epoch {epoch}")
    if data.get("predicted_step_s"):
        twin.axhline(data["predicted_step_s"], color="red", linestyle="--",
                     label="predicted s/step")
    twin.set_ylabel("seconds per step")
    for ax in (top, bottom, twin):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right" if ax is not twin else "lower right", fontsize=8)
    _save(fig, path)
