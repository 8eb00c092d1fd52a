"""Real Java clients (5.3.3 and 4.9.4, which sends no broker name) through the shared proxy.

Every test also checks the proxy's topic counters: they prove the traffic really went through
the proxy (the clients only know the proxy's name-server address).
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
from itutil import (
    GET_CONSUMER_LIST_BY_GROUP,
    SUCCESS,
    assert_roundtrip,
    drive,
    metric,
    request,
    unique,
    wait_metric,
)

from rmqfast.testing import RocketMQCluster, start_driver
from rmqfast.testing.javaclient import Client
from rmqfast.testing.proxy import ProxyProcess

pytestmark = pytest.mark.integration

CLIENTS = ("5", "4")
COUNT = 30


@pytest.mark.parametrize("consumer", ["push", "litepull"])
@pytest.mark.parametrize("mode", ["sync", "async", "oneway", "batch"])
@pytest.mark.parametrize("client", CLIENTS)
def test_send_modes_and_consumers(proxy: ProxyProcess, client: Client, mode: str, consumer: str) -> None:
    """Each send mode x consumer kind x client: every message exactly once, identical content.

    One-way sends are fire-and-forget, but on loopback all of them arrive: assert that."""
    topic = unique(f"rt{client}_{mode}_{consumer}")
    res = drive(
        "roundtrip",
        proxy.namesrv_addr,
        client,
        topic=topic,
        count=COUNT,
        mode=mode,
        consumer=consumer,
        timeout_ms=30000,
        settle_ms=500,
        timeout=60,
    )
    assert res["client_major"] == client
    assert res["consumer"] == consumer and res["mode"] == mode
    assert_roundtrip(res, COUNT)
    if mode == "batch":
        assert len({s["batch_no"] for s in res["sent"]}) == COUNT // 10
    # the messages went through the proxy (batches count every inner message)
    wait_metric(proxy, "rmqfast_topic_messages_total", COUNT, topic=topic)
    wait_metric(proxy, "rmqfast_topic_pulls_total", 1, topic=topic)


@pytest.mark.parametrize(("consumer_client", "kind"), [("5", "push"), ("4", "litepull")])
def test_tag_filtering(proxy: ProxyProcess, consumer_client: Client, kind: str) -> None:
    """Subscription "TagA || TagB" receives exactly the TagA and TagB messages, no TagC."""
    topic = unique(f"tags{consumer_client}")
    sent = drive(
        "produce", proxy.namesrv_addr, "5", topic=topic, count=COUNT, mode="sync", tags="TagA,TagB,TagC", timeout=60
    )
    assert sent["sent_count"] == COUNT and sent["failed"] == []
    wanted = {s["idx"]: s for s in sent["sent"] if s["tag"] in ("TagA", "TagB")}
    assert len(wanted) == 2 * COUNT // 3
    consumed = drive(
        f"consume-{kind}",
        proxy.namesrv_addr,
        consumer_client,
        topic=topic,
        expect=len(wanted),
        sub="TagA || TagB",
        timeout_ms=30000,
        settle_ms=1500,  # time for a wrongly delivered TagC to show up
        timeout=60,
    )
    received = consumed["received"]
    assert {d["tags"] for d in received} <= {"TagA", "TagB"}, Counter(d["tags"] for d in received)
    per_idx = Counter(d["idx"] for d in received)
    assert sorted(per_idx) == sorted(wanted)
    assert all(n == 1 for n in per_idx.values()), per_idx
    for d in received:
        s = wanted[d["idx"]]
        assert (d["tags"], d["keys"], d["body_sha256"], d["props"]) == (
            s["tag"],
            s["keys"],
            s["body_sha256"],
            s["props"],
        )
    wait_metric(proxy, "rmqfast_topic_sends_total", COUNT, topic=topic)


@pytest.mark.parametrize("client", CLIENTS)
def test_ordered_messages(proxy: ProxyProcess, client: Client) -> None:
    """Ordered sends (queue per sharding key) + orderly consumer: order per key preserved."""
    topic = unique(f"ord{client}")
    res = drive(
        "roundtrip",
        proxy.namesrv_addr,
        client,
        topic=topic,
        count=40,
        mode="ordered",
        shard_keys=4,
        orderly=True,
        timeout_ms=30000,
        timeout=60,
    )
    assert_roundtrip(res, 40)
    consumed = res["consumed"]
    order = consumed["order_by_shard"]
    assert sorted(order) == ["s0", "s1", "s2", "s3"]
    for k, seq in order.items():
        shard = int(k[1:])
        assert seq == [i for i in range(40) if i % 4 == shard], (k, seq)
    assert all(consumed["shard_in_order"].values())
    # every message of one key went to one queue
    shard_queues: dict[str, set[int]] = {}
    for s in res["sent"]:
        shard_queues.setdefault(s["shard"], set()).add(s["queue_id"])
    assert all(len(q) == 1 for q in shard_queues.values()), shard_queues
    wait_metric(proxy, "rmqfast_topic_messages_total", 40, topic=topic)


@pytest.mark.parametrize("client", CLIENTS)
def test_transaction_check_back(proxy: ProxyProcess, client: Client) -> None:
    """UNKNOW at send time; the broker's CHECK_TRANSACTION_STATE (39) travels broker -> proxy ->
    client, which answers COMMIT; every committed message is consumed, nothing else."""
    topic = unique(f"tx{client}")
    before = proxy.metrics()
    res = drive(
        "transaction",
        proxy.namesrv_addr,
        client,
        topic=topic,
        count=6,
        unknown_every=2,
        check_result="commit",
        timeout_ms=40000,
        timeout=60,
    )
    assert res["ok"], res.get("error")
    assert res["failed"] == []
    assert res["local_states"] == {str(i): ("UNKNOW" if i % 2 == 1 else "COMMIT_MESSAGE") for i in range(6)}
    checked = {c["idx"]: c for c in res["checked"]}
    assert set(checked) >= {1, 3, 5}, checked
    assert all(c["answer"] == "COMMIT_MESSAGE" for c in checked.values())
    assert res["not_checked"] == []
    assert res["missing"] == [] and res["unexpected"] == []
    assert res["consumed_idx"] == list(range(6))
    # The check-backs (39, broker -> client) and the client's END_TRANSACTION answers (37: one per
    # half message, one more per check-back) were relayed by the proxy.
    wait_metric(
        proxy,
        "rmqfast_requests_total",
        metric(before, "rmqfast_requests_total", role="broker", code="39") + 3,
        role="broker",
        code="39",
    )
    wait_metric(
        proxy,
        "rmqfast_requests_total",
        metric(before, "rmqfast_requests_total", role="broker", code="37") + 9,
        role="broker",
        code="37",
    )


@pytest.mark.parametrize("client", CLIENTS)
def test_broker_sees_consumer_group_online(cluster: RocketMQCluster, proxy: ProxyProcess, client: Client) -> None:
    """While a consumer runs through the proxy, the broker itself (asked directly) lists it."""
    topic = unique(f"online{client}")
    group = unique(f"g_online{client}")
    cluster.create_topic(topic)
    # not there before
    r = request(cluster.broker_addr, GET_CONSUMER_LIST_BY_GROUP, {"consumerGroup": group})
    assert r.code != SUCCESS or b"@" not in r.body
    with start_driver(
        "consume-push", proxy.namesrv_addr, client, topic=topic, group=group, expect=1, timeout_ms=30000
    ) as drv:
        drv.wait_started(30)

        def online() -> list[str]:
            r = request(cluster.broker_addr, GET_CONSUMER_LIST_BY_GROUP, {"consumerGroup": group})
            if r.code != SUCCESS:
                return []
            return list(json.loads(r.body).get("consumerIdList") or [])

        t0 = time.monotonic()
        ids = online()
        while not ids and time.monotonic() - t0 < 15:
            time.sleep(0.2)
            ids = online()
        assert ids, f"broker does not list group {group} while its consumer runs through the proxy"
        assert len(ids) == 1 and "@" in ids[0], ids  # clientId "ip@instance"
        assert drv.poll() is None, "the consumer stopped early"
    # the heartbeat carrying the group went through the proxy
    wait_metric(proxy, "rmqfast_requests_total", 1, role="broker", code="34")
