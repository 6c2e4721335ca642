"""Counts in words: "1 replica", "2 replicas". Messages printed "1 replicas" wherever a job
ran one pipeline; every count of stages or replicas shown to people goes through here.
"""

from __future__ import annotations


def counted(n: int, noun: str, plural: str = "") -> str:
    """`n` and `noun`, plural unless `n` is 1 (`plural`: when it is not `noun` + "s")."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def stages_x_replicas(stages: int, replicas: int) -> str:
    """A layout for people: "2 stages x 1 replica"."""
    return f"{counted(stages, 'stage')} x {counted(replicas, 'replica')}"
