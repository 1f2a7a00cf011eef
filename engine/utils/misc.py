"""Small helpers shared by the engine."""

from __future__ import annotations


def align_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"
