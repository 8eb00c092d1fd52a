"""The real Go client (rocketmq-client-go/v2 v2.1.2) through the proxy alone.

The driver (``godriver/``) is built from the Go module proxy on first use and cached.  Every
test watches the client's TCP connections while it runs: it must never connect to the real
name server or broker ports, only to the proxy.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from itutil import in_port_range, unique

from rmqfast.codec.msgaddr import format_host
from rmqfast.testing import RocketMQCluster, ToolMissingError
from rmqfast.testing.connwatch import GO_DRIVER, ConnectionWatch
from rmqfast.testing.goclient import ensure_godriver, run_godriver, start_godriver
from rmqfast.testing.proxy import ProxyProcess

pytestmark = pytest.mark.integration

COUNT = 24


@pytest.fixture(scope="module")
def godriver() -> Path:
    try:
        return ensure_godriver()
    except ToolMissingError as e:  # no Go toolchain and none installable here
        pytest.skip(str(e))


@pytest.fixture
def watch(cluster: RocketMQCluster) -> Iterator[ConnectionWatch]:
    """The Go driver's connections during the test; afterwards: none to a real RocketMQ port."""
    with ConnectionWatch((GO_DRIVER,)) as w:
        yield w
    real = {int(cluster.namesrv_addr.rpartition(":")[2]), cluster.broker_port, cluster.broker_port - 2}
    assert w.pids, "the watch saw no Go driver connection at all"
    assert not w.touched(real), f"the Go client connected to real RocketMQ ports {w.touched(real)}"


def offset_id_addr(mid: str) -> str:
    return format_host(bytes.fromhex(mid[:16]))


def assert_proxy_addresses(proxy: ProxyProcess, received: list[dict]) -> None:
    """Every broker address the client learnt from a consumed message names a proxy endpoint.
    (Send answers' offset ids too under the default policy.message_addresses = "all": see
    test_go_sends_and_push_consumer; test_it_11_addresses covers mqadmin queryMsgById on them.)"""
    for r in received:
        assert in_port_range(proxy, r["store_host"]), r
        assert offset_id_addr(r["offset_msg_id"]) == r["store_host"], r


@pytest.mark.parametrize("mode", ["sync", "batch", "ordered"])
def test_go_sends_and_push_consumer(godriver: Path, proxy: ProxyProcess, cluster: RocketMQCluster,
                                    watch: ConnectionWatch, mode: str) -> None:
    topic = unique(f"go_{mode}")
    cluster.create_topic(topic, queues=4)
    sent = run_godriver("produce", proxy.namesrv_addr, topic=topic, count=COUNT, mode=mode, prefix="m", timeout=90)
    assert sent["ok"] and sent["sent"] == COUNT and sent["failed"] == 0, sent
    ids = [one for mid in sent["offset_msg_ids"] for one in mid.split(",")]
    assert len(ids) == COUNT and all(in_port_range(proxy, offset_id_addr(i)) for i in ids), ids  # the default
    got = run_godriver("consume-push", proxy.namesrv_addr, topic=topic, group=unique("gogrp"), expect=COUNT,
                       orderly=(mode == "ordered"), timeout_ms=45000, timeout=90)
    bodies = Counter(r["body"] for r in got["received"])
    assert set(bodies) == {f"m-{i}" for i in range(COUNT)}, got.get("error")
    assert all(n == 1 for n in bodies.values()), [b for b, n in bodies.items() if n > 1]
    assert_proxy_addresses(proxy, got["received"])
    # identity unchanged: keys and UNIQ_KEY as sent (batches: the client ids each inner message)
    by_body = {r["body"]: r for r in got["received"]}
    for i in range(COUNT):
        assert by_body[f"m-{i}"]["keys"] == f"key-{i}"
    if mode != "batch":
        assert [by_body[f"m-{i}"]["uniq_key"] for i in range(COUNT)] == sent["msg_ids"]
    if mode == "ordered":  # one sharding key -> one queue, consumed in send order
        for k in range(4):
            seq = [r for r in got["received"] if int(r["body"][2:]) % 4 == k]
            assert len({r["queue_id"] for r in seq}) == 1
            assert [int(r["body"][2:]) for r in seq] == sorted(int(r["body"][2:]) for r in seq)


def test_go_pull_consumer(godriver: Path, proxy: ProxyProcess, cluster: RocketMQCluster,
                          watch: ConnectionWatch) -> None:
    topic = unique("go_pull")
    cluster.create_topic(topic, queues=2)
    sent = run_godriver("produce", proxy.namesrv_addr, topic=topic, count=COUNT, mode="sync", prefix="p",
                        timeout=90)
    assert sent["ok"], sent
    got = run_godriver("consume-pull", proxy.namesrv_addr, topic=topic, group=unique("gopull"), expect=COUNT,
                       timeout_ms=45000, timeout=90)
    assert {r["body"] for r in got["received"]} == {f"p-{i}" for i in range(COUNT)}
    assert_proxy_addresses(proxy, got["received"])


@pytest.mark.parametrize("orderly", [False, True], ids=["concurrent", "orderly"])
def test_go_retry_until_dead_letter_queue(godriver: Path, proxy: ProxyProcess, cluster: RocketMQCluster,
                                          watch: ConnectionWatch, orderly: bool) -> None:
    """A listener that always fails: retried up to --max-reconsume, then in %DLQ%group.

    The orderly consumer sends the exhausted message back to ``msg.StoreHost`` (the address in
    the pulled record): it reaches the broker only because that address is a proxy endpoint."""
    topic, group, n, max_re = unique("go_dlq"), unique("godlq"), 3, 2
    cluster.create_topic(topic, queues=2)
    # made now rather than by the first send-back: the Go client looks routes up every 30 s
    cluster.create_topic(f"%RETRY%{group}", queues=1)
    cluster.create_topic(f"%DLQ%{group}", queues=1)
    sent = run_godriver("produce", proxy.namesrv_addr, topic=topic, count=n, mode="sync", prefix="d", timeout=90)
    assert sent["ok"], sent
    proc = start_godriver("retry-dlq", proxy.namesrv_addr, topic=topic, group=group, expect=n,
                          max_reconsume=max_re, orderly=orderly, timeout_ms=50000, linger_ms=500)
    res = proc.result(timeout=90, check=False)
    assert res["ok"], (res.get("error"), res.get("attempts"), proc.stderr_tail())
    assert {r["body"] for r in res["dlq"]} == {f"d-{i}" for i in range(n)}
    # delivered 1 + max_re times each, then dead-lettered (orderly: 1 + max_re + 1 local tries)
    assert all(a >= 1 + max_re for a in res["attempts"].values()), res["attempts"]
    assert set(res["attempts"]) == {f"d-{i}" for i in range(n)}
    assert_proxy_addresses(proxy, res["received"] + res["dlq"])
    by_body = {r["body"]: r for r in res["dlq"]}
    for i in range(n):  # the dead letter keeps the message's identity
        assert by_body[f"d-{i}"]["uniq_key"] == sent["msg_ids"][i]
        assert by_body[f"d-{i}"]["keys"] == f"key-{i}"
