"""Proves the real-RocketMQ harness: real Java clients against a real name server + broker.

No proxy is involved: if these fail, the harness (or the environment) is broken, not rmqfast.
Needs Java 17+ and Maven (the first run downloads the jars from Maven Central).
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from rmqfast.testing import (
    JarPaths,
    RocketMQCluster,
    ToolMissingError,
    ensure_jars,
    remoting_request,
    run_driver,
)
from rmqfast.testing.cluster import GET_BROKER_CLUSTER_INFO
from rmqfast.testing.javaclient import Client

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def jars() -> JarPaths:
    try:
        return ensure_jars()
    except ToolMissingError as e:  # a machine without a JDK/Maven cannot run these at all
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def cluster(jars: JarPaths) -> Iterator[RocketMQCluster]:
    with RocketMQCluster(jars=jars) as c:
        yield c


def _topic(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def _assert_same_messages(sent: dict[str, Any], consumed: dict[str, Any], count: int) -> None:
    """Every sent message arrives exactly once with identical body, keys, tag and properties."""
    assert sent["sent_count"] == count, sent.get("failed")
    assert all(m["status"] == "SEND_OK" for m in sent["sent"])
    received = consumed["received"]
    per_idx = Counter(m["idx"] for m in received)
    assert sorted(per_idx) == list(range(count)), f"lost/extra: {sorted(per_idx)}"
    assert all(n == 1 for n in per_idx.values()), f"duplicates: {per_idx}"
    assert consumed["duplicates"] == []
    got = {m["idx"]: m for m in received}
    for s in sent["sent"]:
        r = got[s["idx"]]
        assert r["msg_id"] == s["msg_id"]
        assert r["body_sha256"] == s["body_sha256"]
        assert r["body_len"] == s["body_len"]
        assert r["body"] == s["body"]
        assert r["keys"] == s["keys"]
        assert r["tags"] == s["tag"]
        assert r["props"] == s["props"]
        assert r["topic"] == sent["topic"]
        assert r["reconsume_times"] == 0
        assert r["queue_id"] == s["queue_id"]
        assert r["queue_offset"] == s["queue_offset"]


@pytest.mark.parametrize(("producer", "consumer"), [("5", "5"), ("4", "4"), ("5", "4"), ("4", "5")])
def test_sync_produce_then_push_consume(
    cluster: RocketMQCluster, producer: Client, consumer: Client
) -> None:
    topic = _topic(f"smoke_p{producer}c{consumer}")
    t0 = time.monotonic()
    sent = run_driver(
        "produce", cluster.namesrv_addr, producer, topic=topic, count=20, mode="sync", timeout=50
    )
    assert sent["client_major"] == producer
    consumed = run_driver(
        "consume-push",
        cluster.namesrv_addr,
        consumer,
        topic=topic,
        expect=20,
        timeout_ms=30000,
        settle_ms=1000,
        timeout=50,
    )
    assert consumed["client_major"] == consumer
    _assert_same_messages(sent, consumed, 20)
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("client", ["5", "4"])
def test_transaction_check_back(cluster: RocketMQCluster, client: Client) -> None:
    """UNKNOW local state -> broker's CHECK_TRANSACTION_STATE reaches the producer -> COMMIT."""
    topic = _topic(f"smoke_tx{client}")
    res = run_driver(
        "transaction",
        cluster.namesrv_addr,
        client,
        topic=topic,
        count=6,
        unknown_every=2,
        timeout_ms=40000,
        timeout=55,
    )
    assert res["local_states"] == {
        str(i): ("UNKNOW" if i % 2 == 1 else "COMMIT_MESSAGE") for i in range(6)
    }
    checked = {c["idx"] for c in res["checked"]}
    assert {1, 3, 5} <= checked
    assert res["not_checked"] == []
    assert res["missing"] == [] and res["unexpected"] == []
    assert res["consumed_idx"] == list(range(6))


def test_cluster_admin_and_broker_restart(cluster: RocketMQCluster) -> None:
    info = remoting_request(cluster.namesrv_addr, GET_BROKER_CLUSTER_INFO)
    assert info.code == 0 and cluster.broker_addr.encode() in info.body
    topic = _topic("smoke_admin")
    cluster.create_topic(topic, queues=8)
    queues = run_driver("queues", cluster.namesrv_addr, "5", topic=topic, timeout=40)
    assert sorted(q["queue_id"] for q in queues["queues"]) == list(range(8))
    sent = run_driver("produce", cluster.namesrv_addr, "4", topic=topic, count=8, timeout=40)
    cluster.stop_broker()
    assert not cluster.broker_running
    cluster.start_broker()
    consumed = run_driver(
        "consume-push",
        cluster.namesrv_addr,
        "5",
        topic=topic,
        expect=8,
        timeout_ms=30000,
        timeout=45,
    )
    _assert_same_messages(sent, consumed, 8)


def test_rocketmq4_broker_roundtrip() -> None:
    """The optional 4.9.4 broker (mvn -Procketmq4) also runs on this JDK, with both clients."""
    try:
        jars4 = ensure_jars(rocketmq4=True)
    except ToolMissingError as e:
        pytest.skip(str(e))
    with RocketMQCluster(version="4", jars=jars4) as c4:
        clients: tuple[Client, ...] = ("4", "5")
        for client in clients:
            res = run_driver(
                "roundtrip",
                c4.namesrv_addr,
                client,
                topic=_topic(f"smoke_b4c{client}"),
                count=20,
                mode="batch",
                timeout_ms=30000,
                timeout=45,
            )
            assert res["lost"] == [] and res["duplicates"] == [] and res["mismatched"] == []
            assert len(res["sent"]) == 20
