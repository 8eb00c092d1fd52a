"""Remoting protocol codec.

The hot-path frame scanner (and the send limiter) exist twice: compiled (``rmqfast._speedups``,
built from ``ext/_speedups.pyx``) and as a pure-Python reference (``rmqfast.codec._scan_py``,
``rmqfast.limits._limiter_py``).  **This module is the one place that decides which twin runs**:
the compiled one when it is built, unless ``RMQFAST_NO_EXTENSIONS`` is set (anything but ``""``
or ``"0"``), in which case the extension is not even imported.  Every other module asks here:
:data:`IMPLEMENTATION`, the names bound below, :func:`is_compiled`, :func:`twin_of`.

Tests and benchmarks that compare the twins side by side ask for the compiled one explicitly
with :func:`compiled_twin` (or the ``FrameScannerC`` / ``ScanStatsC`` / ``InFlightC`` names,
resolved on first use through it); that imports the extension even under
``RMQFAST_NO_EXTENSIONS``.  The proxy itself never does: a source check in
``tests/test_twins.py`` keeps those names out of production modules.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType
from typing import Any

from rmqfast.codec import _scan_py, tables

_EXT_NAME = "rmqfast._speedups"

NO_EXTENSIONS = os.environ.get("RMQFAST_NO_EXTENSIONS", "") not in ("", "0")

_speedups: ModuleType | None = None
if not NO_EXTENSIONS:
    try:
        _speedups = importlib.import_module(_EXT_NAME)
    except ImportError:  # not built (pure install) or built for another interpreter
        _speedups = None

#: The twin in use in this process: ``"compiled"`` or ``"python"``.
IMPLEMENTATION = "compiled" if _speedups is not None else "python"
_impl: Any = _speedups if _speedups is not None else _scan_py

FrameScannerPy = _scan_py.FrameScanner
ScanStatsPy = _scan_py.ScanStats
InFlightPy = _scan_py.InFlight

# The compiled relay pump (receive -> scan -> send in C); None means: pump in Python.
Pump = _speedups.Pump if _speedups is not None else None

FrameScanner = _impl.FrameScanner
ScanStats = _impl.ScanStats
InFlight = _impl.InFlight
AddressMap = _impl.AddressMap
code_slot = _impl.code_slot
slot_code = _impl.slot_code

# The constants both twins share: declared once in rmqfast.codec.tables (ext/tables.pxi is made from it).
EV_FORWARD = tables.EV_FORWARD
EV_POLICY = tables.EV_POLICY
EV_ERROR = tables.EV_ERROR
ACTION_PASS = tables.ACTION_PASS
ACTION_POLICY = tables.ACTION_POLICY
ACTION_RECORDS = tables.ACTION_RECORDS
CODE_SLOTS = tables.CODE_SLOTS
OTHER_SLOT = tables.OTHER_SLOT
DEFAULT_MAX_FRAME = tables.DEFAULT_MAX_FRAME
DEFAULT_MAX_HEADER = tables.DEFAULT_MAX_HEADER
LATENCY_BOUNDS_NS = tables.LATENCY_BOUNDS_NS
LATENCY_BUCKETS = tables.LATENCY_BUCKETS
RESULTS = tables.RESULTS
MAX_TRACKED = tables.MAX_TRACKED


def extension_built() -> bool:
    """Whether the compiled twin is installed (found without importing it)."""
    if _speedups is not None:
        return True
    try:
        return importlib.util.find_spec(_EXT_NAME) is not None
    except (ImportError, ValueError):
        return False


def compiled_twin() -> ModuleType | None:
    """The compiled module for tests and benchmarks that run both twins; None when not built.

    Under ``RMQFAST_NO_EXTENSIONS`` this imports the extension on request: only code that
    compares the twins may call it (the proxy asks :data:`IMPLEMENTATION`).
    """
    if _speedups is not None:
        return _speedups
    try:
        return importlib.import_module(_EXT_NAME)
    except ImportError:
        return None


def is_compiled(obj: Any) -> bool:
    """Whether ``obj`` (a class or an instance) belongs to the compiled twin; imports nothing."""
    cls = obj if isinstance(obj, type) else type(obj)
    return getattr(cls, "__module__", "") == _EXT_NAME


def twin_of(obj: Any, name: str) -> Any:
    """The class ``name`` (``InFlight``, ``ScanStats``...) of the twin ``obj`` belongs to."""
    if is_compiled(obj):
        mod = compiled_twin()  # already imported: obj came from it
        assert mod is not None
        return getattr(mod, name)
    return getattr(_scan_py, name)


def twin_class(compiled: bool, name: str) -> Any:
    """The class ``name`` of the compiled (``compiled``) or pure twin: for a part that must match
    a scanner already made (:func:`twin_of` when no object of that twin is at hand)."""
    if compiled:
        mod = compiled_twin()
        if mod is None:
            raise ImportError(f"{_EXT_NAME} is not built")
        return getattr(mod, name)
    return getattr(_scan_py, name)


_TEST_NAMES = {"FrameScannerC": "FrameScanner", "ScanStatsC": "ScanStats", "InFlightC": "InFlight"}


def __getattr__(name: str) -> Any:
    # FrameScannerC / ScanStatsC / InFlightC: the compiled classes for twin tests (None when not
    # built), resolved on first use so that merely importing the codec never loads the extension.
    if name in _TEST_NAMES:
        mod = compiled_twin()
        return getattr(mod, _TEST_NAMES[name]) if mod is not None else None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ACTION_PASS", "ACTION_POLICY", "ACTION_RECORDS", "AddressMap", "CODE_SLOTS", "DEFAULT_MAX_FRAME",
    "DEFAULT_MAX_HEADER",
    "EV_ERROR", "EV_FORWARD", "EV_POLICY", "IMPLEMENTATION", "NO_EXTENSIONS", "OTHER_SLOT",
    "InFlight", "InFlightPy", "LATENCY_BOUNDS_NS", "LATENCY_BUCKETS", "MAX_TRACKED", "RESULTS",
    "FrameScanner", "Pump", "FrameScannerPy", "ScanStats", "ScanStatsPy",
    "code_slot", "compiled_twin", "extension_built", "is_compiled", "slot_code", "twin_class", "twin_of",
]
