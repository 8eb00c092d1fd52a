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


def test_the_registry_declares_the_order_the_worker_built_before() -> None:
    from rmqfast.filters.registry import CHAINS, DRAINING

    assert [e.name for e in CHAINS["namesrv"]] == ["deny", "routes"]
    assert [e.name for e in CHAINS["broker"]] == [
        "deny", "acl", "limits", "gray", "delay", "replicate", "addresses", "keep-sends"]
    assert DRAINING.name == "go-away"


def test_build_chains_walks_the_registry_with_every_filter_wanted() -> None:
    """A stand-in host that wants every filter (the replication and delay services are stand-ins:
    their filters are theirs): each chain is the registry's entries in order, one filter each."""
    from types import SimpleNamespace

    from rmqfast.filters.api import Filter
    from rmqfast.filters.registry import CHAINS, build_chains
    from rmqfast.proxy.endpoints import EndpointRegistry

    class Held(Filter):
        name = "held"

    class Copied(Filter):
        name = "copied"

    cfg = config_mod.from_dict({
        "namesrv": {"listen": "127.0.0.1:1", "upstreams": ["127.0.0.1:2"]},
        "failover": {"enabled": True, "resend": "all"},
        "acl": {"topics": {"ak": ["Orders"]}},
        "gray": {"group": [{"group": "G", "topics": ["a"], "gray_queues": 1, "producer_groups": ["pg"]}]},
        "clouds": {"remote": [{"name": "other", "namesrv": ["127.0.0.1:3"]}]},
    })
    assert cfg.replication_enabled
    held, copied = Held(), Copied()
    host = SimpleNamespace(cfg=cfg, index=0, registry=EndpointRegistry(cfg, lambda ep: None), health=None,
                           book=None, failover=None, health_metrics=None, limits=SimpleNamespace(),
                           delay=SimpleNamespace(filter=held), replication=SimpleNamespace(filter=copied),
                           on_denied=lambda s, c: None, on_rewritten=lambda s, c: None, on_healed=lambda a: None)
    chains, built = build_chains(host)  # type: ignore[arg-type]
    assert _names(chains["namesrv"]) == ["DenyAdminCodes", "RewriteRoutes"]
    assert _names(chains["broker"]) == ["DenyAdminCodes", "AclTopics", "SendLimitFilter", "GrayFilter", "Held",
                                        "Copied", "RewriteMessageAddresses", "KeepSendsInFlight"]
    assert built["delay"] is held and built["replicate"] is copied
    assert set(built) == {e.name for entries in CHAINS.values() for e in entries}
    assert chains["broker"].filters[0] is built["deny"]  # the broker chain's deny is built after the name server's


def test_docs_architecture_shows_the_registry_s_order() -> None:
    """docs/architecture.md's table of the chains is the registry's ``order_table()``: change one,
    change the other (the table is generated: paste ``order_table()`` between the markers)."""
    from rmqfast.filters.registry import order_table

    doc = (Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text()
    begin = doc.index("<!-- filter-order:begin")
    start = doc.index("\n", begin) + 1
    end = doc.index("<!-- filter-order:end -->", start)
    assert doc[start:end] == order_table(), "docs/architecture.md's filter order differs from the registry's"
