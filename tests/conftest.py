"""Suite-wide fixtures.

The twins: ``twin`` is the one fixture that runs a test against each twin of the hot path (pure
Python, ``"py"``, and compiled, ``"c"``: a :class:`Twin`); ``relay_twin`` the three ways the relay
runs (pure scanner and pump, compiled scanner with the Python pump, compiled pump).  Every test
that uses one, and every test of a file in :data:`TWIN_FILES`, carries the ``twin`` marker: the
pure-Python pass of ``tests/run_suite.sh`` (``RMQFAST_NO_EXTENSIONS=1``) runs those tests only.
``tests/test_twin_marks.py`` fails when a test file that touches a twin is not in the list.

gevent only *prints* an exception raised in a greenlet (a relay pump, a StreamServer handler)
and carries on, so a test passed while tracebacks scrolled by.  ``greenlet_errors`` (autouse)
records every exception the hub would print and fails the test that produced it.  A test that
provokes one on purpose takes the fixture by name and empties the list before it ends.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gevent.hub import Hub
from hypothesis import HealthCheck, settings

from rmqfast import codec
from tests.twins import TWIN_FILES, TWIN_FIXTURES, Twin, make_twin, needs_c

# Input generation takes longer than Hypothesis' 1 s health limit on a loaded machine (2 cores at a
# load average of 10+): the too_slow check and the per-example deadline measure the machine, not
# the code.  Tests that set their own @settings keep these unless they override them.
settings.register_profile("rmqfast", suppress_health_check=[HealthCheck.too_slow], deadline=None)
settings.load_profile("rmqfast")


class GreenletErrors(list):
    """``(context, formatted traceback)`` of each exception a gevent hub printed during the test."""


_current: GreenletErrors | None = None
_original_print_exception = Hub.print_exception


def _recording_print_exception(self: Hub, context: Any, t: Any, v: Any, tb: Any) -> None:
    if _current is not None:
        _current.append((repr(context)[:200], "".join(traceback.format_exception(t, v, tb))))
    _original_print_exception(self, context, t, v, tb)


Hub.print_exception = _recording_print_exception  # class-level: covers every thread's hub


@pytest.fixture(autouse=True)
def greenlet_errors() -> Iterator[GreenletErrors]:
    global _current
    errors = GreenletErrors()
    _current = errors
    try:
        yield errors
    finally:
        _current = None
    if errors:
        shown = "\n".join(f"--- in {ctx}:\n{tb}" for ctx, tb in errors[:3])
        pytest.fail(f"{len(errors)} exception(s) raised in greenlets during the test "
                    f"(gevent printed and ignored them):\n{shown}", pytrace=False)


@pytest.fixture
def in_process_metrics() -> Iterator[None]:
    """For a test that builds a worker in the test process: the metrics it registers in
    prometheus_client's default registry are taken out again when the test ends, so that another
    in-process worker later in the same run does not collide with them (DuplicateTimeseries)."""
    from prometheus_client.registry import REGISTRY

    before = set(REGISTRY._collector_to_names)  # noqa: SLF001 - the registry has no public listing
    yield
    for collector in set(REGISTRY._collector_to_names) - before:  # noqa: SLF001
        REGISTRY.unregister(collector)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate (rmqfast.testing.tlscerts)."""
    from rmqfast.testing.tlscerts import make_certs

    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A second, unrelated CA and its certificates (for verification failures)."""
    from rmqfast.testing.tlscerts import make_certs

    return make_certs(tmp_path_factory.mktemp("certs2"), prefix="other-")


# The twins -------------------------------------------------------------------------------------

@pytest.fixture(params=["py", pytest.param("c", marks=needs_c)])
def twin(request: pytest.FixtureRequest) -> Twin:
    """The pure-Python (``py``) and the compiled (``c``) twin of the hot path, in turn."""
    return make_twin(request.param)


@pytest.fixture(params=["py", pytest.param("c-py-pump", marks=needs_c), pytest.param("c-pump", marks=[
    needs_c, pytest.mark.skipif(codec.Pump is None, reason="the compiled pump does not run here")])])
def relay_twin(request: pytest.FixtureRequest) -> Twin:
    """How a relay session runs: pure scanner and pump; compiled scanner, Python pump; compiled pump."""
    return make_twin(request.param)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "twin: touches a twin of the hot path (run again by the pure-Python pass)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).name in TWIN_FILES or any(f in getattr(item, "fixturenames", ())
                                                          for f in TWIN_FIXTURES):
            item.add_marker(pytest.mark.twin)
