"""A worker raises its open-files soft limit to the hard limit at start and says so."""

from __future__ import annotations

import logging
import resource

import pytest

from rmqfast.server.accept import auto_max_connections
from rmqfast.server.fdlimit import raise_nofile


def test_soft_limit_raised_to_hard_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    soft0, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 600:
        pytest.skip(f"hard limit {hard} leaves nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    try:
        with caplog.at_level(logging.INFO, logger="rmqfast.worker"):
            soft, hard_after = raise_nofile(3)
        assert hard_after == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == soft
        assert soft == hard if hard != resource.RLIM_INFINITY else soft >= 512
        rec = [r for r in caplog.records if r.getMessage() == "open-files limit raised to the hard limit"]
        assert rec and rec[0].ctx["soft_before"] == 512 and rec[0].ctx["soft"] == soft
        assert rec[0].ctx["max_client_connections"] == auto_max_connections(soft)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft0, hard))
