"""The twins of the hot path as the tests see them (the ``twin`` and ``relay_twin`` fixtures of
``tests/conftest.py`` give a :class:`Twin`; :data:`TWIN_FILES` says which files the pure-Python
pass runs besides the fixtures' tests).  A module of its own so that tests can import it
(``from tests.twins import Twin``) without importing a conftest."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest

from rmqfast import codec
from rmqfast.codec import _scan_py

C = codec.compiled_twin()  # imported on request even under RMQFAST_NO_EXTENSIONS (twin tests compare)
needs_c = pytest.mark.skipif(C is None, reason="compiled extension not built")


@dataclass(frozen=True)
class Twin:
    """One twin of the hot path as a test sees it: its module and its classes."""

    id: str  # the test id: "py", "c"; for relay_twin also "c-py-pump", "c-pump"
    module: ModuleType  # rmqfast.codec._scan_py or rmqfast._speedups
    pump: bool = False  # (relay_twin) the compiled pump drives the relay

    @property
    def compiled(self) -> bool:
        return self.module is not _scan_py

    @property
    def name(self) -> str:
        """``"compiled"`` or ``"python"``: what ``create_shared`` / ``new_shared_memory`` take."""
        return "compiled" if self.compiled else "python"

    @property
    def FrameScanner(self) -> Any:  # noqa: N802 - the class's name
        return self.module.FrameScanner

    @property
    def ScanStats(self) -> Any:  # noqa: N802
        return self.module.ScanStats

    @property
    def InFlight(self) -> Any:  # noqa: N802
        return self.module.InFlight

    @property
    def AddressMap(self) -> Any:  # noqa: N802
        return self.module.AddressMap

    @property
    def Limiter(self) -> Any:  # noqa: N802
        from rmqfast.limits import LimiterPy

        return self.module.Limiter if self.compiled else LimiterPy


def make_twin(twin_id: str) -> Twin:
    """The twin of a fixture parameter: ``py``, ``c``, ``c-py-pump`` or ``c-pump``."""
    if twin_id == "py":
        return Twin("py", _scan_py)
    assert C is not None, "compiled extension not built"
    return Twin(twin_id, C, pump=twin_id == "c-pump")


def all_twins() -> list[Twin]:
    """Every twin built here, for a test that runs them side by side in one call."""
    return [make_twin("py")] + ([make_twin("c")] if C is not None else [])


#: Test files whose tests touch a twin without the fixture: they build scanners, limiters,
#: pumps or reactors themselves, or send frames through a relay, a worker or a whole proxy.
#: tests/test_twin_marks.py keeps this list complete.
TWIN_FILES = frozenset({
    "test_acl.py", "test_admin_http.py", "test_batchflag.py", "test_bench_smoke.py", "test_cext.py",
    "test_check_config.py", "test_filter_order.py", "test_sendids_scan.py",
    "test_delay.py", "test_failover.py", "test_failover_policy.py", "test_gray.py", "test_grpcfront.py",
    "test_h2server_deadlines.py", "test_health_starvation.py", "test_listen_caps.py", "test_listen_evict.py",
    "test_local_shortage.py",
    "test_harness_smoke.py", "test_header_fuzz.py", "test_header_walk_strings.py", "test_limits.py",
    "test_limits_proxy.py", "test_pump.py", "test_pump_buffers.py", "test_reactor.py", "test_reactor_edges.py",
    "test_reactor_repoll.py", "test_reactor_uring.py", "test_records.py", "test_records_fuzz.py",
    "test_records_scan.py", "test_relay.py", "test_relay_parked.py", "test_request_timing.py", "test_scan.py",
    "test_session_core.py", "test_shape.py", "test_spark_report.py", "test_stub.py", "test_supervisor_spawn.py",
    "test_tables.py", "test_tls.py", "test_tls_serve.py", "test_twins.py",
})
#: The fixtures whose tests are marked ``twin``.
TWIN_FIXTURES = ("twin", "relay_twin")
