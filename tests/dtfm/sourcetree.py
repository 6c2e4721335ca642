"""The project's own Python modules by dotted name, for the tests that read the code itself
(`test_layering.py`: who imports whom; `test_code_shape.py`: sizes and private names)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dtfm", "coordinator", "agent")


def module_name(path: Path) -> str:
    """`coordinator/job/machine.py` -> `coordinator.job.machine` (a package: its folder)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Every module of `packages`, by dotted name."""
    return {module_name(p): p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))}
