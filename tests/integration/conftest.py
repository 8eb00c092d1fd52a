"""Fixtures of the integration tests: one real RocketMQ 5.3.3 cluster for the whole session and
one shared rmqfast proxy (2 workers) in front of it.

Tests that disturb a proxy (kill a worker, reload, stop it, other settings) start their own
``ProxyProcess``; the one test that stops the broker restores it (see ``restore_broker``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rmqfast.testing import JarPaths, RocketMQCluster, ToolMissingError, ensure_jars
from rmqfast.testing.proxy import ProxyProcess

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def jars() -> JarPaths:
    try:
        return ensure_jars()
    except ToolMissingError as e:  # no JDK / Maven on this machine: nothing here can run
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def cluster(jars: JarPaths) -> Iterator[RocketMQCluster]:
    with RocketMQCluster(jars=jars) as c:
        yield c


@pytest.fixture(scope="session")
def proxy(cluster: RocketMQCluster) -> Iterator[ProxyProcess]:
    """The shared proxy. Tests may add traffic, never change its configuration or processes."""
    with ProxyProcess([cluster.namesrv_addr]) as p:
        yield p


@pytest.fixture
def restore_broker(cluster: RocketMQCluster) -> Iterator[RocketMQCluster]:
    """For tests that stop the shared broker: it is running again afterwards, whatever happened."""
    yield cluster
    if not cluster.broker_running:
        cluster.start_broker()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """On failure, attach the tail of every proxy log the test used (its own or the shared one)."""
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and call.when == "call":
        funcargs = getattr(item, "funcargs", {})
        for name, value in funcargs.items():
            if isinstance(value, ProxyProcess):
                rep.sections.append((f"proxy log ({name})", value.log_tail(60)))
