"""Apache RocketMQ Proxy 5.3.3 (cluster mode), the benchmarks' second proxy, runs in front of the
shared real broker, and the real Java client sends and consumes through its Remoting port.

One JVM start (~25 s on a loaded 2-core machine) for the whole module; the benchmark
(``rmqfast bench --real``) relies on exactly this setup.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator

import pytest

from rmqfast.codec.codes import GET_ROUTEINFO_BY_TOPIC, SUCCESS
from rmqfast.testing import RocketMQCluster, run_driver
from rmqfast.testing.apacheproxy import ApacheProxy
from rmqfast.testing.remoting import remoting_request

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def apache_proxy(cluster: RocketMQCluster) -> Iterator[ApacheProxy]:
    with ApacheProxy(cluster.namesrv_addr, cluster_name=cluster.cluster_name, heap_mb=256) as apx:
        yield apx


def test_routes_name_the_proxy_and_messages_go_through_it(cluster: RocketMQCluster,
                                                          apache_proxy: ApacheProxy) -> None:
    topic = f"ApacheProxy{uuid.uuid4().hex[:8]}"
    cluster.create_topic(topic, queues=2)
    # Remoting clients take the proxy for their name server; its routes send them back to it.
    r = remoting_request(apache_proxy.remoting_addr, GET_ROUTEINFO_BY_TOPIC, {"topic": topic}, timeout=15.0)
    assert r.code == SUCCESS, (r.code, r.remark)
    route = json.loads(re.sub(r"([{,])(\d+):", r'\1"\2":', r.body.decode()))
    addrs = {a for bd in route["brokerDatas"] for a in bd["brokerAddrs"].values()}
    assert addrs == {apache_proxy.remoting_addr}, route

    sent = run_driver("produce", apache_proxy.remoting_addr, "5", topic=topic, count=6, timeout=120)
    assert sent["sent_count"] == 6 and not sent.get("failed_count"), sent
    got = run_driver("consume-push", apache_proxy.remoting_addr, "5", topic=topic, expect=6, timeout=120,
                     **{"from": "CONSUME_FROM_FIRST_OFFSET", "only_run": sent["run_id"]})
    assert got["distinct"] == 6, got
    assert {m["idx"] for m in got["received"]} == set(range(6)), got["received"]
    # the broker stored them, the proxy only relayed: store host is the broker's
    assert {m["store_host"] for m in got["received"]} == {cluster.broker_addr}, got["received"]
    assert apache_proxy.running
