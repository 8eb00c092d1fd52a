# cython: language_level=3
"""Compiled hot path of rmqfast: frame scanner, counters, request timing, send limiter, relay pump.

This is the C twin of ``rmqfast/codec/_scan_py.py``; read that module's docstring for the
theory of operation.  Both implement the same algorithm step by step, and the test suite
runs them side by side on the same inputs.  The difference is that nothing here creates a
Python object per frame: the buffer is read through a raw pointer, counters are C arrays,
and topics are counted in an open-addressing table of fixed-size C strings.

One extension module, one concept per included file, in dependency order: the shared tables
(generated from ``rmqfast/codec/tables.py``), their lookups, constants and wire
helpers, the per-worker counters, the header walk, the limiter, the in-flight table, the
scanner that uses them all, and the relay pump that drives the scanner.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyObject_GetBuffer, PyBuffer_Release
from cpython.ref cimport Py_INCREF, Py_DECREF
from libc.stdint cimport int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcmp, memcpy
cimport cython
from libc.stdint cimport int8_t
from libc.errno cimport errno, EAGAIN, EINTR  # EWOULDBLOCK == EAGAIN on Linux
from libc.stdlib cimport malloc, realloc
from libc.string cimport memchr, memmove

include "tables.pxi"
include "constants.pxi"
include "wire.pxi"
include "stats.pxi"
include "header_walk.pxi"
include "limiter.pxi"
include "inflight.pxi"
include "records.pxi"
include "scanner.pxi"
include "pump.pxi"
include "reactor.pxi"
