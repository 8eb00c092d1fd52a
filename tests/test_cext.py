"""The compiled hot path is the one in use, unless RMQFAST_NO_EXTENSIONS asks otherwise.

A build that silently fell back to pure Python would pass every other test while running
several times slower; this test makes that a failure.
"""

import os

import pytest

from rmqfast import codec

NO_EXT = os.environ.get("RMQFAST_NO_EXTENSIONS", "") not in ("", "0")


@pytest.mark.skipif(NO_EXT, reason="pure-Python run requested")
def test_compiled_scanner_is_in_use():
    assert codec.IMPLEMENTATION == "compiled", "rmqfast._speedups is not built: run `pip install -e .`"
    assert codec.FrameScanner.__module__ == "rmqfast._speedups"
    scanner = codec.FrameScanner(codec.ScanStats())
    assert not hasattr(scanner, "__dict__"), "FrameScanner must be an extension type"
    assert codec.FrameScannerC is codec.FrameScanner


@pytest.mark.skipif(not NO_EXT, reason="compiled run")
def test_pure_python_requested():
    assert codec.IMPLEMENTATION == "python"
    assert codec.FrameScanner is codec.FrameScannerPy
    assert codec.FrameScanner.__module__ == "rmqfast.codec._scan_py"
    assert codec.Pump is None and codec._speedups is None  # not even imported (tests/test_twins.py checks
    # a fresh interpreter's sys.modules; this one may have loaded it on request for twin tests)
