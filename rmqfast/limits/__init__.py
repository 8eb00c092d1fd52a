"""Send limits: rules (``[limits]``), the limiter (compiled, with a pure-Python twin) and the
memory its buckets share across worker processes."""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

from rmqfast import codec
from rmqfast.limits import _limiter_py
from rmqfast.limits.rules import LimitRule, LimitsSection, parse_limits

LimiterPy = _limiter_py.Limiter
LimiterC = codec._speedups.Limiter if codec._speedups is not None else None
SHM_BYTES = _limiter_py.SLOT_BYTES * (_limiter_py.MAX_RULES + 1)
SHM_NAME = "limits.shm"

__all__ = ["SHM_BYTES", "SHM_NAME", "LimitRule", "LimiterC", "LimiterPy", "LimitsSection", "create_shared",
           "open_limiter", "parse_limits", "reset_slots"]


def create_shared(runtime: Path) -> Path:
    """The supervisor's shared bucket file, zeroed (every bucket full)."""
    path = runtime / SHM_NAME
    with open(path, "wb") as f:
        f.truncate(SHM_BYTES)
    return path


def reset_slots(path: Path, slots: list[int]) -> None:
    """Zero the buckets of rules that changed (a new rate starts from a full bucket)."""
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), SHM_BYTES) as m:
        for s in slots:
            off = s * _limiter_py.SLOT_BYTES
            m[off : off + _limiter_py.SLOT_BYTES] = bytes(_limiter_py.SLOT_BYTES)


def open_limiter(path: Path, compiled: bool) -> Any:
    """A worker's limiter over the shared file (compiled when the scanner is compiled)."""
    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, SHM_BYTES)
    if compiled and LimiterC is not None:
        os.close(fd)
        return LimiterC(m)
    return LimiterPy(m, lock_fd=fd)  # the twin keeps the fd for its flock
