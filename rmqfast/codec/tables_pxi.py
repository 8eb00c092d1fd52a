"""``ext/tables.pxi``, the compiled twin's copy of :mod:`rmqfast.codec.tables`, generated from it.

``python -m rmqfast.codec.tables_pxi --write`` rewrites the file; ``tests/test_tables.py`` fails when
the file in the tree differs from what this renders (edit ``tables.py``, then regenerate and rebuild).
Integers that fit a C int become members of an anonymous ``cdef enum`` (``<NAME>_C``: compile-time
constants, as the ``DEF`` statements they replaced), 32-bit words above it (the records' magic
codes) their signed int32 reading (``<NAME>_I32_C``), floats C macros, tuples of integers ``int64_t``
arrays (with ``<NAME>_LEN_C``); every constant is also bound under its own name for Python.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rmqfast.codec import tables

PXI_PATH = Path(__file__).resolve().parents[2] / "ext" / "tables.pxi"
_INT32 = range(-(2**31), 2**31)
_UINT32_HIGH = range(2**31, 2**32)


def public_constants() -> dict[str, object]:
    """Every constant of :mod:`rmqfast.codec.tables` (upper-case names), in declaration order."""
    return {n: v for n, v in vars(tables).items() if n.isupper() and not n.startswith("_")}


def render_pxi() -> str:
    """The text of ``ext/tables.pxi`` for the constants of :mod:`rmqfast.codec.tables`."""
    consts = public_constants()
    enums = [(n, v) for n, v in consts.items() if type(v) is int and v in _INT32]
    # a 32-bit word the wire carries (a magic code) as the signed int32 it is read into
    enums += [(f"{n}_I32", v - 2**32) for n, v in consts.items() if type(v) is int and v in _UINT32_HIGH]
    floats = [(n, v) for n, v in consts.items() if type(v) is float]
    arrays = [(n, v) for n, v in consts.items()
              if type(v) is tuple and v and all(type(x) is int for x in v)]
    out = ["# Generated from rmqfast/codec/tables.py by `python -m rmqfast.codec.tables_pxi --write`: do not edit.",
           "# Included first by _speedups.pyx: the constants both twins share, as C compile-time constants",
           "# (<NAME>_C) and as Python values (<NAME>, compared with the pure twins' by tests/test_twins.py).",
           "", "cdef enum:"]
    out += [f"    {n}_C = {v}" for n, v in enums]
    if floats:
        out += ["", "cdef extern from *:", '    """']
        out += [f"    #define {n}_C {v!r}" for n, v in floats]
        out += ['    """']
        out += [f"    const double {n}_C" for n, v in floats]
    for n, v in arrays:
        out += ["", f"cdef enum:\n    {n}_LEN_C = {len(v)}",
                f"cdef int64_t[{len(v)}] {n}_C = [{', '.join(str(x) for x in v)}]"]
    out += [""]
    out += [f"{n} = {v!r}" for n, v in consts.items() if not isinstance(v, dict)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rmqfast.codec.tables_pxi",
                                 description="print (or --write) ext/tables.pxi, made from rmqfast/codec/tables.py")
    ap.add_argument("--write", action="store_true", help=f"write {PXI_PATH} instead of printing it")
    args = ap.parse_args(argv)
    text = render_pxi()
    if args.write:
        PXI_PATH.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
