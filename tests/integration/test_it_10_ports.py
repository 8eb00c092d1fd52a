"""The RocketMQ cluster helper when another program takes one of its reserved ports before the
JVM binds it: the JVM fails to bind and the helper starts again on new ports (no probe-then-bind
race decides a test run)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from rmqfast.testing import JarPaths, RocketMQCluster
from rmqfast.testing import cluster as cluster_mod
from rmqfast.testing.cluster import remoting_request

pytestmark = pytest.mark.integration

GET_BROKER_CLUSTER_INFO = 106


@pytest.mark.parametrize("which", ["namesrv", "broker"])
def test_cluster_moves_when_a_port_was_taken(jars: JarPaths, monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    real_reserve = cluster_mod.reserve
    squatters: list[socket.socket] = []

    def reserve_then_lose_one(*args: Any, **kwargs: Any) -> Any:
        lease = real_reserve(*args, **kwargs)
        if not squatters:  # the first block only: a program that takes no lock binds one port
            s = socket.socket()
            s.bind(("127.0.0.1", lease.base if which == "namesrv" else lease.base + 4))
            s.listen()
            squatters.append(s)
        return lease

    monkeypatch.setattr(cluster_mod, "reserve", reserve_then_lose_one)
    try:
        with RocketMQCluster(jars=jars) as c:
            taken = squatters[0].getsockname()[1]
            assert taken not in c.ports, (taken, c.ports)
            info = remoting_request(c.namesrv_addr, GET_BROKER_CLUSTER_INFO, timeout=30.0)
            assert info.code == 0 and c.broker_addr.encode() in info.body
    finally:
        for s in squatters:
            s.close()
