"""The compiled and pure-Python twins agree on everything but speed.

* one place decides which twin runs (rmqfast.codec); with RMQFAST_NO_EXTENSIONS the extension
  is not imported at all, and production modules never reach for the compiled twin themselves;
* every table the C side copies from the Python side is asserted equal here;
* the same bad argument raises the same exception type in both twins.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rmqfast import codec
from rmqfast.codec import _header_py, _records_py, _scan_py, tables
from rmqfast.limits import LimiterPy, _limiter_py, new_shared_memory, rules

ROOT = Path(__file__).resolve().parent.parent
C = codec.compiled_twin()
needs_c = pytest.mark.skipif(C is None, reason="compiled extension not built")


# One place decides ---------------------------------------------------------------------------

_PRODUCTION_IMPORTS = """
import sys
from pathlib import Path
import rmqfast.codec, rmqfast.limits, rmqfast.limits.worker, rmqfast.limits.shaper
import rmqfast.proxy.relay, rmqfast.server.worker, rmqfast.server.supervisor, rmqfast.bench.run, rmqfast.cli
from rmqfast.limits import create_shared, parse_limits
from rmqfast.limits.worker import WorkerLimits
rt = Path(sys.argv[1])
limits = WorkerLimits(create_shared(rt), parse_limits({"rule": [{"topic": "T", "rate": 5}]}))
lim, rel = limits.limiter_for(), limits.release_limiter()
s = rmqfast.codec.FrameScanner(rmqfast.codec.ScanStats(), limiter=lim, inflight=rmqfast.codec.InFlight())
print(rmqfast.codec.IMPLEMENTATION, type(lim).__module__, type(rel).__module__, type(s).__module__,
      rmqfast.codec.extension_built(), "rmqfast._speedups" in sys.modules)
"""


def _run(env_extra: dict[str, str], tmp_path: Path) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "RMQFAST_NO_EXTENSIONS"}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", _PRODUCTION_IMPORTS, str(tmp_path)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_no_extensions_means_the_extension_is_never_imported(tmp_path):
    impl, lim_mod, rel_mod, scan_mod, built, loaded = _run({"RMQFAST_NO_EXTENSIONS": "1"}, tmp_path)
    assert (impl, lim_mod, rel_mod, scan_mod) == ("python", "rmqfast.limits._limiter_py",
                                                   "rmqfast.limits._limiter_py", "rmqfast.codec._scan_py")
    assert built == str(C is not None)  # found on disk without importing it
    assert loaded == "False", "a production module imported rmqfast._speedups under RMQFAST_NO_EXTENSIONS"


@needs_c
def test_without_the_variable_the_compiled_twin_runs_everywhere(tmp_path):
    impl, lim_mod, rel_mod, scan_mod, built, loaded = _run({"RMQFAST_NO_EXTENSIONS": "0"}, tmp_path)
    assert (impl, lim_mod, rel_mod, scan_mod, built, loaded) == (
        "compiled", "rmqfast._speedups", "rmqfast._speedups", "rmqfast._speedups", "True", "True")


def test_tests_get_the_compiled_twin_only_on_request():
    """compiled_twin() is the explicit way for twin tests; it works under RMQFAST_NO_EXTENSIONS too."""
    code = ("import sys, rmqfast.codec as c; before = 'rmqfast._speedups' in sys.modules; m = c.compiled_twin(); "
            "print(before, m is not None, c.IMPLEMENTATION, c.FrameScannerC is (m.FrameScanner if m else None))")
    env = dict(os.environ, RMQFAST_NO_EXTENSIONS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", str(C is not None), "python", "True"]


# names that load the compiled twin on request: for tests and benchmarks only
_TEST_ONLY = re.compile(r"\b(FrameScannerC|ScanStatsC|InFlightC|LimiterC|compiled_twin)\b")
_EXT_IMPORT = re.compile(
    r"(import\s+rmqfast\._speedups|from\s+rmqfast\._speedups\s+import|from\s+rmqfast\s+import\s+_speedups)")


def test_production_modules_ask_the_codec_which_twin_runs():
    # rmqfast/codec/__init__.py decides; rmqfast/limits/__init__.py maps a twin to its limiter
    # class; relay.py imports the pump's state constants only once codec.Pump says it runs.
    allowed = {"rmqfast/codec/__init__.py": (_TEST_ONLY, _EXT_IMPORT), "rmqfast/limits/__init__.py": (_TEST_ONLY,),
               "rmqfast/proxy/relay.py": (_EXT_IMPORT,), "rmqfast/proxy/pump_c.py": (_EXT_IMPORT,),
               "rmqfast/proxy/pump_py.py": (_EXT_IMPORT,), "rmqfast/proxy/budget.py": (_EXT_IMPORT,)}
    bad = []
    for path in sorted((ROOT / "rmqfast").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("rmqfast/testing/"):
            continue
        text = path.read_text()
        for pattern in (_TEST_ONLY, _EXT_IMPORT):
            if pattern in allowed.get(rel, ()):
                continue
            bad += [f"{rel}: {m.group(0)}" for m in pattern.finditer(text)]
    assert not bad, "decide the twin through rmqfast.codec (IMPLEMENTATION, is_compiled, twin_of): " + ", ".join(bad)
    for module in ("relay", "pump_c", "budget"):
        text = (ROOT / f"rmqfast/proxy/{module}.py").read_text()
        assert re.search(r"if Pump is not None:\n\s+from rmqfast\._speedups import", text), module


def test_twin_helpers():
    assert codec.is_compiled(codec.FrameScannerPy) is False and codec.is_compiled(codec.ScanStatsPy()) is False
    assert codec.twin_of(codec.FrameScannerPy, "InFlight") is _scan_py.InFlight
    if C is not None:
        assert codec.is_compiled(C.FrameScanner) and codec.is_compiled(C.ScanStats())
        assert codec.twin_of(C.FrameScanner, "InFlight") is C.InFlight
    assert codec.IMPLEMENTATION == ("python" if codec.NO_EXTENSIONS or C is None else "compiled")


# Constants -----------------------------------------------------------------------------------

# Python-side constants the C side holds differently (with where to find them)
_PY_ONLY = {
    _scan_py: {"ERRORS": "C: _ERRORS (checked below)", "E_TOPIC_ESCAPED": "C: an enum member"},
    _limiter_py: {"IMPLEMENTATION": "each twin's own name, written into the shared file's header"},
    _header_py: {"ERRORS": "C: _ERRORS (checked below)"},
    _records_py: {},
    tables: {"RESULT_OF_CODE": "C: the comparisons of result_index (checked below)"},
}


@needs_c
@pytest.mark.parametrize("module", [_scan_py, _limiter_py, _header_py, _records_py, tables], ids=lambda m: m.__name__)
def test_every_public_constant_of_the_python_twin_equals_the_compiled_one(module):
    names = [n for n in vars(module) if re.fullmatch(r"[A-Z][A-Z0-9_]*", n) and not isinstance(getattr(module, n),
                                                                                                    type(re))]
    checked = 0
    for n in names:
        if n in _PY_ONLY[module]:
            continue
        assert hasattr(C, n), f"{module.__name__}.{n} has no compiled counterpart; expose it in ext/_speedups.pyx"
        assert getattr(C, n) == getattr(module, n), f"{n}: compiled {getattr(C, n)!r} != python {getattr(module, n)!r}"
        checked += 1
    assert checked >= {_scan_py: 30, _limiter_py: 8, _header_py: 33, _records_py: 12, tables: 40}[module]


@needs_c
def test_copied_tables_are_equal():
    assert C.LATENCY_BOUNDS_NS == _scan_py.LATENCY_BOUNDS_NS and len(C.LATENCY_BOUNDS_NS) + 1 == C.LATENCY_BUCKETS
    assert C.NRESULTS == len(_scan_py.RESULTS) and C.RESULTS == tables.RESULTS
    assert C._ERRORS == _header_py.ERRORS, "the header walk's error messages differ between the twins"
    # result index table: every code the table names and its neighbours, plus extremes
    for code in [*range(-3, 400), 2**31 - 1, -(2**31)]:
        assert C.result_index_of(code) == _scan_py.result_index(code), code
    # latency buckets: each bound, one ns on either side, and the extremes
    for b in [*_scan_py.LATENCY_BOUNDS_NS, 0, -1, 2**63 - 1]:
        for ns in (n for n in (b - 1, b, b + 1) if -(2**63) <= n < 2**63):
            assert C.latency_bucket_of(ns) == _scan_py.latency_bucket(ns), ns
    # the code <-> slot mapping, over every slot and the codes around each range boundary
    for code in [*range(-2, 1100), *range(199_990, 201_100), 2**31 - 1, -(2**31), 2**62]:
        assert C.code_slot(code) == _scan_py.code_slot(code), code
    for slot in range(-2, C.CODE_SLOTS + 2):
        assert C.slot_code(slot) == _scan_py.slot_code(slot), slot
    # the limiter's layout and rule limits, as the supervisor and the rules module see them
    assert C.SHM_BYTES == _limiter_py.SHM_BYTES == C.SHM_HEADER_BYTES + C.SLOT_BYTES * (C.MAX_RULES + 1)
    assert C.MAX_RULES == rules.MAX_RULES
    assert {C.MODE_LIMIT, C.MODE_REJECT, C.MODE_OPEN} == set(rules.MODE_CODES.values())
    assert (C.MODE_LIMIT, C.MODE_REJECT, C.MODE_OPEN) == (rules.MODE_CODES["limit"], rules.MODE_CODES["reject"],
                                                           rules.MODE_CODES["open"])


# One error per bad input -----------------------------------------------------------------------

BIG = 2**70


@pytest.fixture
def m(twin: Any) -> Any:
    """The module of each twin (the ``twin`` fixture of tests/conftest.py)."""
    return twin.module


@pytest.fixture
def L(twin: Any) -> Any:  # noqa: N802 - a class
    """The limiter class of each twin."""
    return twin.Limiter


def _lim(L: Any) -> Any:
    return L(new_shared_memory("compiled" if codec.is_compiled(L) else "python"))


def _rule(**kw: Any) -> tuple[Any, ...]:
    r = {"topic": b"T", "tag": None, "rate": 1.0, "burst": 1.0, "brate": 0.0, "bburst": 0.0, "mode": 0, "slot": 1}
    r.update(kw)
    return tuple(r.values())


# (what, call(module, Limiter), expected exception type or None for "accepted")
CASES: list[tuple[str, Any, type[BaseException] | None]] = []
for _v, _int_err, _ssize_err in [(-1, None, None), (BIG, OverflowError, OverflowError),
                                 (-BIG, OverflowError, OverflowError), ("x", TypeError, TypeError),
                                 (None, TypeError, TypeError), (1.5, None, TypeError),
                                 (float("nan"), ValueError, TypeError), (True, None, None)]:
    CASES += [
        (f"ScanStats.set_sampling({_v!r})", lambda m, L, v=_v: m.ScanStats().set_sampling(v),
         OverflowError if _v in (-1, -BIG, BIG) else _int_err),
        (f"ScanStats.observe(slot={_v!r})", lambda m, L, v=_v: m.ScanStats().observe(v, 1, 0),
         ValueError if _v == -1 else _int_err),
        (f"ScanStats.observe(ns={_v!r})", lambda m, L, v=_v: m.ScanStats().observe(1, v, 0), _int_err),
        (f"ScanStats.count_result(result={_v!r})", lambda m, L, v=_v: m.ScanStats().count_result(1, v),
         ValueError if _v == -1 else _int_err),
        (f"InFlight({_v!r})", lambda m, L, v=_v: m.InFlight(v), ValueError if _v == -1 else _ssize_err),
        (f"InFlight.track(opaque={_v!r})", lambda m, L, v=_v: m.InFlight().track(0, v, 1, 1), _int_err),
        (f"InFlight.track(now_ns={_v!r})", lambda m, L, v=_v: m.InFlight().track(0, 1, 1, v), _int_err),
        (f"InFlight.take(opaque={_v!r})", lambda m, L, v=_v: m.InFlight().take(0, v), _int_err),
        (f"FrameScanner(direction={_v!r})", lambda m, L, v=_v: m.FrameScanner(m.ScanStats(), direction=v),
         ValueError if _v == -1 else _int_err),
        (f"FrameScanner(max_frame_size={_v!r})", lambda m, L, v=_v: m.FrameScanner(m.ScanStats(), max_frame_size=v),
         ValueError if _v in (-1, True) else _ssize_err),
        (f"FrameScanner.scan(start={_v!r})", lambda m, L, v=_v: m.FrameScanner(m.ScanStats()).scan(b"", v, 0),
         ValueError if _v in (-1, True) else _ssize_err),
        (f"code_slot({_v!r})", lambda m, L, v=_v: m.code_slot(v), _int_err),
        (f"Limiter.admit(msgs={_v!r})", lambda m, L, v=_v: _lim(L).admit(b"T", None, v), _int_err),
        (f"Limiter.admit(now_ns={_v!r})", lambda m, L, v=_v: _lim(L).admit(b"T", None, 1, 0, v), _int_err),
        (f"Limiter.configure(slot={_v!r})", lambda m, L, v=_v: _lim(L).configure([_rule(slot=v)]),
         ValueError if _v in (-1,) else (TypeError if isinstance(_v, (bool, float)) else _int_err)),
        (f"Limiter.configure(mode={_v!r})", lambda m, L, v=_v: _lim(L).configure([_rule(mode=v)]),
         ValueError if _v == -1 else (TypeError if isinstance(_v, (bool, float)) else _int_err)),
        (f"Limiter.configure(rate={_v!r})", lambda m, L, v=_v: _lim(L).configure([_rule(rate=v)]),
         ValueError if _v in (-1, -BIG) or (isinstance(_v, float) and math.isnan(_v)) else
         (TypeError if _v is None or isinstance(_v, (str, bool)) else None)),
    ]
CASES += [
    ("ScanStats(1)", lambda m, L: m.ScanStats(1), TypeError),
    ("FrameScanner(stats=None)", lambda m, L: m.FrameScanner(None), TypeError),
    ("FrameScanner(stats=the other twin's)", lambda m, L: m.FrameScanner(
        (_scan_py if m is not _scan_py else C or _scan_py).ScanStats()), TypeError if C is not None else None),
    ("FrameScanner(inflight=object())", lambda m, L: m.FrameScanner(m.ScanStats(), inflight=object()), TypeError),
    ("FrameScanner(limiter=object())", lambda m, L: m.FrameScanner(m.ScanStats(), limiter=object()), TypeError),
    ("FrameScanner(actions=b'x')", lambda m, L: m.FrameScanner(m.ScanStats(), actions=b"x"), ValueError),
    ("FrameScanner(direction=2)", lambda m, L: m.FrameScanner(m.ScanStats(), direction=2), ValueError),
    ("FrameScanner.scan(end beyond the buffer)", lambda m, L: m.FrameScanner(m.ScanStats()).scan(b"abc", 0, 4),
     ValueError),
    ("FrameScanner.policy_topics = (b'T',)", lambda m, L: setattr(m.FrameScanner(m.ScanStats()), "policy_topics",
                                                                  (b"T",)), TypeError),
    ("FrameScanner.policy_topics = [b'T']", lambda m, L: setattr(m.FrameScanner(m.ScanStats()), "policy_topics",
                                                                 [b"T"]), None),
    ("FrameScanner.policy_topics = ['T'], a send scanned", lambda m, L: _scan_with_topics(m, ["T"]), TypeError),
    ("InFlight.abandon(None)", lambda m, L: m.InFlight().abandon(None), TypeError),
    ("Limiter(read-only bytes)", lambda m, L: L(bytes(_limiter_py.SHM_BYTES)), BufferError),
    ("Limiter(no header)", lambda m, L: L(bytearray(_limiter_py.SHM_BYTES)), ValueError),
    ("Limiter(too small)", lambda m, L: L(bytearray(100)), ValueError),
    ("Limiter.configure(None)", lambda m, L: _lim(L).configure(None), TypeError),
    ("Limiter.configure(short tuple)", lambda m, L: _lim(L).configure([(b"T",)]), ValueError),
    ("Limiter.configure(str topic)", lambda m, L: _lim(L).configure([_rule(topic="T")]), TypeError),
    ("Limiter.configure(str tag)", lambda m, L: _lim(L).configure([_rule(tag="x")]), TypeError),
    ("Limiter.configure(topic of 256 bytes)", lambda m, L: _lim(L).configure([_rule(topic=b"t" * 256)]), ValueError),
    ("Limiter.configure(prefix of 255 bytes + *)", lambda m, L: _lim(L).configure([_rule(topic=b"t" * 255 + b"*")]),
     None),
    ("Limiter.configure(1025 rules)", lambda m, L: _lim(L).configure([_rule(slot=i % 1024) for i in range(1025)]),
     ValueError),
    ("Limiter.configure(two rules, one slot)", lambda m, L: _lim(L).configure([_rule(), _rule(topic=b"U")]),
     ValueError),
    ("Limiter.configure(slot 1024)", lambda m, L: _lim(L).configure([_rule(slot=1024)]), ValueError),
    ("Limiter.configure(mode 9)", lambda m, L: _lim(L).configure([_rule(mode=9)]), ValueError),
    ("Limiter.configure(infinite burst)", lambda m, L: _lim(L).configure([_rule(burst=float("inf"))]), ValueError),
    ("Limiter.admit(str topic)", lambda m, L: _lim(L).admit("T"), TypeError),
    ("Limiter.admit(str tag)", lambda m, L: _lim(L).admit(b"T", "x"), TypeError),
]


def _scan_with_topics(m: Any, topics: Any) -> Any:
    sc = m.FrameScanner(m.ScanStats())
    sc.policy_topics = topics
    hb = b'{"code":310,"extFields":{"b":"T"},"flag":0,"opaque":1}'
    frame = (4 + len(hb)).to_bytes(4, "big") + len(hb).to_bytes(4, "big") + hb
    return sc.scan(frame, 0, len(frame))


def _outcome(fn: Any, m: Any, L: Any) -> type[BaseException] | None:
    try:
        fn(m, L)
    except Exception as exc:  # noqa: BLE001 - the type is what is compared
        return type(exc)
    return None


@pytest.mark.parametrize("what,call,expected", CASES, ids=[c[0] for c in CASES])
def test_the_same_bad_argument_raises_the_same_exception_in_both_twins(m, L, what, call, expected):
    assert _outcome(call, m, L) is expected, what


@needs_c
def test_messages_name_what_was_wrong():
    for L in (LimiterPy, C.Limiter):
        with pytest.raises(ValueError, match="limit rule 0: slot 1024 outside 0..1023"):
            _lim(L).configure([_rule(slot=1024)])
        with pytest.raises(TypeError, match="limit rule 0: topic must be bytes, got str"):
            _lim(L).configure([_rule(topic="T")])
        with pytest.raises(ValueError, match="limit rules 0 and 1 share bucket slot 1"):
            _lim(L).configure([_rule(), _rule(topic=b"U")])
        with pytest.raises(ValueError, match="no rmqfast bucket header"):
            L(bytearray(_limiter_py.SHM_BYTES))
    # the pure twin names the argument where Cython's own conversion message cannot
    with pytest.raises(OverflowError, match="opaque=.* does not fit a C int"):
        _scan_py.InFlight().track(0, BIG, 1, 1)
    with pytest.raises(TypeError, match="max_frame_size must be an integer, got float 1.5"):
        _scan_py.FrameScanner(_scan_py.ScanStats(), max_frame_size=1.5)


@needs_c
def test_a_failed_configure_keeps_the_rules_in_force():
    for L in (LimiterPy, C.Limiter):
        lim = _lim(L)
        lim.configure([_rule(rate=1.0, burst=1.0)])
        with pytest.raises(ValueError):
            lim.configure([_rule(topic=b"U", slot=2), _rule(slot=2000)])
        assert lim.admit(b"T", None, 1, 0, 10**12) == -1 and lim.admit(b"T", None, 1, 0, 10**12) == 0
        assert lim.admit(b"U", None, 1, 0, 10**12) == -1  # U was never limited
