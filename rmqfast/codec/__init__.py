"""Remoting protocol codec.

The hot-path frame scanner exists twice: compiled (``rmqfast._speedups``, built from
``ext/_speedups.pyx``) and as a pure-Python reference (``rmqfast.codec._scan_py``).  The best
available one is bound to the public names below; ``RMQFAST_NO_EXTENSIONS=1`` forces the pure
one.  Both are always importable as ``FrameScannerPy``/``FrameScannerC`` (``None`` when the
extension is not built) so that tests can run them side by side.
"""

from __future__ import annotations

import os

from rmqfast.codec import _scan_py

NO_EXTENSIONS = os.environ.get("RMQFAST_NO_EXTENSIONS", "") not in ("", "0")

try:
    from rmqfast import _speedups  # type: ignore[attr-defined]
except ImportError:  # not built (pure install) or built for another interpreter
    _speedups = None

FrameScannerPy = _scan_py.FrameScanner
ScanStatsPy = _scan_py.ScanStats
InFlightPy = _scan_py.InFlight
FrameScannerC = _speedups.FrameScanner if _speedups is not None else None
ScanStatsC = _speedups.ScanStats if _speedups is not None else None
InFlightC = _speedups.InFlight if _speedups is not None else None

if _speedups is not None and not NO_EXTENSIONS:
    _impl = _speedups
    IMPLEMENTATION = "compiled"
else:
    _impl = _scan_py  # type: ignore[assignment]
    IMPLEMENTATION = "python"

# The compiled relay pump (receive -> scan -> send in C); None means: pump in Python.
Pump = _speedups.Pump if _impl is _speedups else None

FrameScanner = _impl.FrameScanner
ScanStats = _impl.ScanStats
InFlight = _impl.InFlight
code_slot = _impl.code_slot
slot_code = _impl.slot_code

EV_FORWARD = _scan_py.EV_FORWARD
EV_POLICY = _scan_py.EV_POLICY
EV_ERROR = _scan_py.EV_ERROR
ACTION_PASS = _scan_py.ACTION_PASS
ACTION_POLICY = _scan_py.ACTION_POLICY
CODE_SLOTS = _scan_py.CODE_SLOTS
OTHER_SLOT = _scan_py.OTHER_SLOT
DEFAULT_MAX_FRAME = _scan_py.DEFAULT_MAX_FRAME
DEFAULT_MAX_HEADER = _scan_py.DEFAULT_MAX_HEADER
LATENCY_BOUNDS_NS = _scan_py.LATENCY_BOUNDS_NS
LATENCY_BUCKETS = _scan_py.LATENCY_BUCKETS
RESULTS = _scan_py.RESULTS
MAX_TRACKED = _scan_py.MAX_TRACKED

__all__ = [
    "ACTION_PASS", "ACTION_POLICY", "CODE_SLOTS", "DEFAULT_MAX_FRAME", "DEFAULT_MAX_HEADER",
    "EV_ERROR", "EV_FORWARD", "EV_POLICY", "IMPLEMENTATION", "NO_EXTENSIONS", "OTHER_SLOT",
    "InFlight", "InFlightC", "InFlightPy", "LATENCY_BOUNDS_NS", "LATENCY_BUCKETS", "MAX_TRACKED", "RESULTS",
    "FrameScanner", "FrameScannerC", "Pump", "FrameScannerPy", "ScanStats", "ScanStatsC", "ScanStatsPy",
    "code_slot", "slot_code",
]
