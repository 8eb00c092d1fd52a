"""The worker's buffer budget: the bytes every pump of every session may hold beyond its base
buffer (frames that policy reads whole), and the malloc setting that keeps those bytes from
staying resident.

One budget per process (``BUDGET``): the compiled ``_speedups.BufferBudget`` when the compiled
pump runs, else its pure-Python twin :class:`PyBufferBudget`.  Readers take it as
``budget.BUDGET`` at use, so that a test may replace it.
"""

from __future__ import annotations

import ctypes
from typing import Any

from rmqfast.codec import Pump

if Pump is not None:
    from rmqfast._speedups import BufferBudget  # type: ignore[attr-defined]

#: Default of ``proxy.buffer_budget``: bytes per worker for frames held whole beyond the base buffers.
DEFAULT_BUFFER_BUDGET = 64 * 1024 * 1024


class PyBufferBudget:
    """The pure-Python twin of ``_speedups.BufferBudget`` (same two attributes)."""

    def __init__(self, limit: int = DEFAULT_BUFFER_BUDGET) -> None:
        self.limit = limit
        self.used = 0


#: One budget per process (a worker): every pump of every session reserves from it.
BUDGET: Any = BufferBudget(DEFAULT_BUFFER_BUDGET) if Pump is not None else PyBufferBudget()

_malloc_pinned = False


def pin_mmap_threshold() -> None:
    """Keep glibc's mmap threshold at 128 KiB (once per process).

    glibc raises the threshold to the size of the largest mapped block freed (up to 32 MiB);
    from then on big buffers (the Python pump's, policy frames copied for filters) come from
    the heap and stay resident after hostile traffic (bench/relay_memory.py, Python pump: 73 MiB
    instead of 27-35 MiB after 200 connections sent 1 MiB of a big policy frame each).  Setting
    it fixes it at the default.
    """
    global _malloc_pinned
    if _malloc_pinned:
        return
    _malloc_pinned = True
    try:
        ctypes.CDLL(None).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD (glibc; a no-op elsewhere)
    except (OSError, AttributeError):
        pass
