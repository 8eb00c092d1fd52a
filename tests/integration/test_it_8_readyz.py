"""/readyz asks the real RocketMQ 5.3.3 name server one Remoting question (not only a TCP connect)."""

from __future__ import annotations

import json
import socket

import pytest

from rmqfast.server.probe import PROBE_CODE, probe_remoting
from rmqfast.testing import RocketMQCluster
from rmqfast.testing.proxy import ProxyProcess

pytestmark = pytest.mark.integration

QUERY_NOT_FOUND = 22  # the name server's answer to GET_KV_CONFIG for a key it does not hold


def test_probe_gets_a_remoting_answer_from_the_real_name_server(cluster: RocketMQCluster) -> None:
    assert PROBE_CODE == 101  # GET_KV_CONFIG: read-only, what clients ask for ordered topics
    host, _, port = cluster.namesrv_addr.rpartition(":")
    r = probe_remoting(host, int(port), timeout=5.0)
    assert r.ok, r
    assert f"response code {QUERY_NOT_FOUND} " in r.detail, r


def test_readyz_reports_each_upstream(cluster: RocketMQCluster, proxy: ProxyProcess) -> None:
    code, body = proxy.get("/readyz")
    doc = json.loads(body)
    assert code == 200 and doc["ready"] is True, doc
    assert doc["upstreams"][cluster.namesrv_addr].startswith(f"ok: Remoting response code {QUERY_NOT_FOUND}")


def test_probe_refuses_a_tcp_server_that_is_not_a_name_server(cluster: RocketMQCluster) -> None:
    """The broker's HA port accepts TCP but speaks the HA protocol: a TCP connect check would pass."""
    socket.create_connection(("127.0.0.1", cluster.broker_ha_port), timeout=5).close()
    r = probe_remoting("127.0.0.1", cluster.broker_ha_port, timeout=2.0)
    assert not r.ok, r
