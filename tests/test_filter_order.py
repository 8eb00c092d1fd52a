"""The order of the filter chains a worker builds: every filter of the broker chain and of the name
server chain switched on, the chains' filters by class, in the order the worker used before the
filters moved to ``rmqfast/filters/`` (issue 29): the registry must keep it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rmqfast import config as config_mod
from rmqfast.limits import create_shared


def _names(chain: Any) -> list[str]:
    return [type(f).__name__ for f in chain.filters]


@pytest.mark.usefixtures("in_process_metrics")
def test_the_worker_builds_every_filter_in_the_registered_order(tmp_path: Path) -> None:
    from rmqfast.server.worker import Worker

    raw: dict[str, Any] = {
        "namesrv": {"listen": "127.0.0.1:1", "upstreams": ["127.0.0.1:2"]},
        "proxy": {"state_dir": str(tmp_path / "state")},
        "failover": {"enabled": True, "resend": "all"},
        "acl": {"topics": {"ak": ["Orders"]}},
        "limits": {"rule": [{"topic": "T", "rate": 10, "burst": 10}]},
        "gray": {"group": [{"group": "G", "topics": ["a"], "gray_queues": 1, "producer_groups": ["pg"]}]},
        "delay": {"topics": ["Delayed"]},
    }
    create_shared(tmp_path)
    w = Worker(config_mod.from_dict(raw), 0, lambda status: None, runtime=tmp_path)
    try:
        assert _names(w.chains["namesrv"]) == ["DenyAdminCodes", "RewriteRoutes"]
        assert _names(w.chains["broker"]) == [
            "DenyAdminCodes", "AclTopics", "SendLimitFilter", "GrayFilter", "DelayFilter",
            "RewriteMessageAddresses", "KeepSendsInFlight"]
        assert w.failover.place is not None and w.failover.delay is w.delay and w.failover.limits is w.limits
    finally:
        w.health.close()
        if w.delay is not None:
            w.delay.close()


@pytest.mark.usefixtures("in_process_metrics")
def test_the_worker_builds_only_the_default_filters_when_nothing_is_configured(tmp_path: Path) -> None:
    from rmqfast.server.worker import Worker

    raw: dict[str, Any] = {"namesrv": {"listen": "127.0.0.1:1", "upstreams": ["127.0.0.1:2"]},
                           "proxy": {"state_dir": str(tmp_path / "state")}}
    w = Worker(config_mod.from_dict(raw), 0, lambda status: None)
    try:
        assert _names(w.chains["namesrv"]) == ["DenyAdminCodes", "RewriteRoutes"]
        # [failover] is on by default with resend = "policy": the keep filter is there
        assert _names(w.chains["broker"]) == ["DenyAdminCodes", "RewriteMessageAddresses", "KeepSendsInFlight"]
        assert w.failover.place is None and w.failover.replicate is None
    finally:
        w.health.close()
