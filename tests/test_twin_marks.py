"""The pure-Python pass runs every test that touches a twin, and only those.

``tests/run_suite.sh`` runs the unit tests a second time under ``RMQFAST_NO_EXTENSIONS=1`` limited
to the ``twin`` marker, which ``tests/conftest.py`` gives to the tests of the ``twin`` and
``relay_twin`` fixtures and of the files in ``TWIN_FILES``.  A test file touches a twin when its
source names the hot path's objects (a scanner, limiter, in-flight table, address map, pump,
reactor, a pure twin module, the session core or the relay...), or when it both starts a proxy
(supervisor, worker, ``python -m rmqfast``, the harness's proxy) and speaks Remoting to it.  Such a
file left out of ``TWIN_FILES`` fails here, by name; so does a listed file that no longer exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.twins import TWIN_FILES, TWIN_FIXTURES

HERE = Path(__file__).resolve().parent

# the hot path's objects, named in a test's source
DIRECT = re.compile(
    r"FrameScanner|ScanStats|InFlight|Limiter|AddressMap|\bPump\b|Reactor|rmqfast\._speedups|import _speedups|"
    r"_scan_py|_records_py|_header_py|_limiter_py|compiled_twin|codec\.IMPLEMENTATION|is_compiled|"
    r"walk_store_hosts|code_slot|slot_code|SessionCore|proxy\.relay|proxy import relay|WorkerLimits|"
    r"create_shared|new_shared_memory|header_fuzz|records_fuzz")
# a proxy started by the test (in this process or another)
STARTS = re.compile(r"testing\.proxy|ProxyProcess|Supervisor|server\.supervisor|server\.worker|"
                    r"\"-m\", \"rmqfast\"|testing\.cluster|rmqfast\.bench")
# Remoting frames written or read by the test
SPEAKS = re.compile(r"testing\.remoting|testing\.wire|read_frame|RemotingCommand|codec\.command|javaclient|"
                    r"goclient|encode_frame|send_frame")
USES_FIXTURE = re.compile(r"\b(" + "|".join(TWIN_FIXTURES) + r")\b")


def touches_a_twin(source: str) -> bool:
    return bool(DIRECT.search(source) or USES_FIXTURE.search(source)
                or (STARTS.search(source) and SPEAKS.search(source)))


def test_every_test_file_that_touches_a_twin_is_in_the_pure_pass():
    missing = [p.name for p in sorted(HERE.glob("test_*.py"))
               if p.name != Path(__file__).name  # (its source is the rule: it names everything)
               and touches_a_twin(p.read_text()) and p.name not in TWIN_FILES
               and not re.search(r"pytestmark\s*=.*mark\.twin", p.read_text())]
    assert not missing, ("these test files touch a twin of the hot path but the pure-Python pass would skip "
                         "them: add them to TWIN_FILES in tests/twins.py (or use the twin fixture): "
                         + ", ".join(missing))


def test_the_listed_files_exist():
    gone = sorted(n for n in TWIN_FILES if not (HERE / n).is_file())
    assert not gone, f"TWIN_FILES in tests/conftest.py names files that do not exist: {gone}"


@pytest.mark.parametrize("source,expected", [
    ("from rmqfast.codec import FrameScannerPy", True),
    ("def test_x(twin):\n    pass", True),
    ("from rmqfast.testing.proxy import ProxyProcess\nfrom rmqfast.testing.wire import read_frame", True),
    ("from rmqfast.testing.proxy import ProxyProcess\nhttp_get(admin)", False),
    ("from rmqfast.config import load_config", False),
])
def test_the_rule_tells_them_apart(source, expected):
    assert touches_a_twin(source) is expected


def test_the_marker_reaches_fixture_and_listed_tests(request):
    # this file is not listed and uses no twin fixture: no marker
    assert request.node.get_closest_marker("twin") is None
    assert "test_scan.py" in TWIN_FILES and "test_config.py" not in TWIN_FILES
