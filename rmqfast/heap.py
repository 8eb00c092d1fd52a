"""Giving the C heap back after a peak of connections (the gRPC front and the Remoting workers).

Each open connection of the nghttp2 server holds about 40 KiB of C heap (its nghttp2 session, frame
and event buffers, the transport); all of it is freed when the connection closes, but glibc keeps
freed memory in its heap for reuse rather than returning it, so the process's RSS stayed at its
peak (measured with ``bench/grpc_conn_memory.py``; numbers in docs/grpc.md).  :class:`Trimmer`
calls glibc's ``malloc_trim(0)``, which returns the free pages to the system, once the number of
open connections has fallen well below its last peak; on a C library without it, nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from typing import Any

log = logging.getLogger("rmqfast.heap")

TRIM_MIN_DROP = 64  # connections that must have closed since the peak before a trim is worth it


def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None (another C library, or none found)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


class Trimmer:
    """:meth:`maybe_trim` trims once the open connections fell by a quarter of their peak (and at
    least ``TRIM_MIN_DROP``); the peak is the caller's (:attr:`rmqfast.grpcfront.gate.Gate.peak`,
    :attr:`rmqfast.server.accept.ConnectionCaps.peak`)."""

    def __init__(self) -> None:
        self.trims = 0
        self.last_ms = 0.0  # how long the last malloc_trim took (it walks the heap)
        self._fn: Any = _malloc_trim()

    def maybe_trim(self, n: int, gate: Any) -> bool:
        """``n`` connections are open now: give the free heap back if many closed since the peak
        (which then starts again from ``n``)."""
        if self._fn is None or gate.peak - n < max(TRIM_MIN_DROP, gate.peak // 4):
            return False
        closed, gate.peak = gate.peak - n, n
        self.trims += 1
        t0 = time.perf_counter()
        self._fn(0)
        self.last_ms = (time.perf_counter() - t0) * 1000
        log.debug("malloc_trim after %d connections closed took %.1f ms", closed, self.last_ms)
        return True
