"""The constants of the hot path are written once (``rmqfast/codec/tables.py``).

* ``ext/tables.pxi`` is exactly what ``rmqfast.codec.tables_pxi`` renders from them (regenerate
  with ``python -m rmqfast.codec.tables_pxi --write`` after editing ``tables.py``);
* the Cython sources hold no ``DEF`` (deprecated in Cython 3): enums, ``cdef`` constants or
  the generated tables instead;
* production modules never take a constant (or anything else) from a pure-Python twin.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from rmqfast.codec import tables, tables_pxi

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.twin

# the pure-Python twins, and the modules that may import them by name
_TWINS = {"rmqfast.codec._scan_py", "rmqfast.codec._records_py", "rmqfast.codec._header_py",
          "rmqfast.limits._limiter_py"}
_MAY_IMPORT_TWINS = {
    "rmqfast/codec/__init__.py": "the one switch between the twins",
    "rmqfast/limits/__init__.py": "maps a twin to its limiter class (LimiterPy)",
}


def test_the_generated_pxi_is_current():
    assert tables_pxi.PXI_PATH == ROOT / "ext" / "tables.pxi"
    assert tables_pxi.PXI_PATH.read_text() == tables_pxi.render_pxi(), (
        "ext/tables.pxi is stale: run `python -m rmqfast.codec.tables_pxi --write` and rebuild the extension")


def test_every_shared_constant_is_rendered_for_both_sides():
    text = tables_pxi.render_pxi()
    consts = tables_pxi.public_constants()
    assert len(consts) >= 40
    for name, value in consts.items():
        if isinstance(value, dict):
            continue  # RESULT_OF_CODE: the compiled twin's result_index (compared in test_twins.py)
        assert re.search(rf"^{name} = ", text, re.M), name
        if type(value) is int and -(2**31) <= value < 2**31:
            assert re.search(rf"^    {name}_C = {value}$", text, re.M), name
    assert "#define MAX_COST_NS_C 4.611686018427388e+18" in text and float("4.611686018427388e+18") == 2.0**62
    assert "cdef int64_t[17] LATENCY_BOUNDS_NS_C = [100000, " in text
    # a magic code above INT_MAX: the signed int32 the records walk reads from the wire
    assert "    RECORD_MAGIC_V1_I32_C = -626843481" in text and 0xDAA320A7 - 2**32 == -626843481


def test_the_render_follows_the_tables(monkeypatch):
    """A constant changed in tables.py changes the rendered file (the staleness check can fail)."""
    before = tables_pxi.render_pxi()
    monkeypatch.setattr(tables, "MAX_JSON_DEPTH", 33)
    after = tables_pxi.render_pxi()
    assert after != before and "    MAX_JSON_DEPTH_C = 33" in after and "MAX_JSON_DEPTH = 33" in after


def test_no_def_statements_in_the_cython_sources():
    found = [f"{p.name}:{i}: {line.strip()}" for p in sorted((ROOT / "ext").glob("*.p[yx][xi]"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.match(r"\s*DEF\s", line)]
    assert not found, "DEF is deprecated in Cython 3; declare the constant in rmqfast/codec/tables.py " \
                      "(shared with the twins) or as a `cdef enum` member: " + "; ".join(found)


def _imports(tree: ast.Module) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def test_production_modules_never_import_from_a_pure_twin():
    bad = []
    for path in sorted((ROOT / "rmqfast").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        module = rel[:-3].replace("/", ".")
        if rel in _MAY_IMPORT_TWINS or module in _TWINS or rel.startswith("rmqfast/testing/"):
            continue
        for line, name in _imports(ast.parse(path.read_text(), filename=rel)):
            if name in _TWINS or any(name.startswith(t + ".") for t in _TWINS):
                bad.append(f"{rel}:{line}: {name}")
    assert not bad, ("take shared constants from rmqfast.codec.tables and the twin in use from rmqfast.codec, "
                     "never from a pure-Python twin: " + ", ".join(bad))


def test_the_twins_take_their_constants_from_the_tables():
    from rmqfast.codec import _header_py, _records_py, _scan_py
    from rmqfast.limits import _limiter_py

    shared = tables_pxi.public_constants()
    for twin in (_scan_py, _records_py, _header_py, _limiter_py):
        for name, value in vars(twin).items():
            if name in shared:
                assert value is shared[name], f"{twin.__name__}.{name} is a copy: import it from rmqfast.codec.tables"
    # the lookups are the tables' own functions, not copies
    assert _scan_py.result_index is tables.result_index and _scan_py.latency_bucket is tables.latency_bucket
