"""Peak shaving with a real RocketMQ broker and the real Java 5.3.3 client.

A topic shaped at 10 msg/s (burst 5): a producer sends 60 ordered messages (one sharding key,
so one queue) as fast as the proxy answers; every send succeeds at once, and the consumer gets
all 60, in send order, spread over about (60 - 5) / 10 s by the broker's store timestamps.
"""

from __future__ import annotations

import time

import pytest
from itutil import BOUND, metric, unique, wait_metric, wait_until

from rmqfast.testing import RocketMQCluster, start_driver
from rmqfast.testing.javaclient import run_driver
from rmqfast.testing.proxy import ProxyProcess

pytestmark = pytest.mark.integration

RATE, BURST, N = 10, 5, 60


@pytest.fixture(scope="module")
def shaped(cluster: RocketMQCluster):
    topic = unique("shaped")
    cluster.create_topic(topic)
    extra = f"""
[limits]
[[limits.rule]]
topic = "{topic}"
rate = {RATE}
burst = {BURST}
mode = "shape"
"""
    with ProxyProcess([cluster.namesrv_addr], extra_config=extra) as p:
        yield p, topic


def test_shaped_sends_succeed_at_once_and_arrive_in_order_at_the_rate(cluster: RocketMQCluster, shaped) -> None:
    p, topic = shaped
    run, group = unique("r"), unique("g")
    consumer = start_driver("consume-push", cluster.namesrv_addr, "5", topic=topic, group=group, expect=N,
                            orderly=True, only_run=run, timeout_ms=90000)
    with consumer:
        consumer.wait_started(60)
        prod = run_driver("produce", p.namesrv_addr, "5", topic=topic, count=N, mode="ordered", shard_keys=1,
                          run_id=run, send_timeout_ms=10000, retries=0)
        res = consumer.result(120, check=False)
    # every send succeeded; the shaped ones carry the proxy's answer
    assert prod["sent_count"] == N and not prod["failed"], prod["failed"][:3]
    assert all(s["status"] == "SEND_OK" for s in prod["sent"])
    shaped_sends = [s for s in prod["sent"] if s["queue_offset"] == -1]
    # the burst (and what refilled while the cold client sent its first messages) went direct
    assert len(shaped_sends) >= N // 2, [s["queue_offset"] for s in prod["sent"]]
    # msgId is the UNIQ_KEY and offsetMsgId is not a broker id (there is none yet): the same string
    assert all(s["msg_id"] and s["offset_msg_id"] == s["msg_id"] for s in shaped_sends), [
        (s["msg_id"], s["offset_msg_id"]) for s in shaped_sends[:2]]
    # the consumer got every message once, in send order
    got = [d for d in res["received"] if d.get("run") == run]
    assert res["distinct"] == N and not res["duplicates"], {k: res.get(k) for k in ("distinct", "timed_out")}
    assert len({(d["broker_name"], d["queue_id"]) for d in got}) == 1  # one sharding key: one queue
    by_offset = sorted(got, key=lambda d: d["queue_offset"])
    assert [int(d["idx"]) for d in by_offset] == list(range(N))
    assert {d["msg_id"] for d in got} == {s["msg_id"] for s in prod["sent"]}
    # the producer was not held back: it sent everything well before the releases were done
    born = [d["born_timestamp"] for d in got]
    stored = sorted(d["store_timestamp"] for d in got)
    send_span = (max(born) - min(born)) / 1000
    store_span = (stored[-1] - stored[0]) / 1000
    expected = (N - BURST) / RATE
    print(f"sends over {send_span:.2f} s; stored over {store_span:.2f} s (expected ~{expected:.1f} s)")
    # held back (answered only once released), every message but the last would be stored before
    # the last send was born; a backlog at the last send proves the answers came first, however
    # slowly a loaded machine lets the producer send
    waiting = sum(1 for s in stored if s > max(born))
    assert waiting >= 3, (waiting, send_span, store_span)
    # the admitted + released rate: within 20 % of the limit
    rate = (N - BURST) / store_span
    assert 0.8 * RATE <= rate <= 1.2 * RATE, (rate, store_span)
    # the steady part alone (after the burst): within 20 % too
    tail = stored[BURST:]
    steady = (len(tail) - 1) / ((tail[-1] - tail[0]) / 1000)
    assert 0.8 * RATE <= steady <= 1.2 * RATE, steady
    # metrics: what the proxy shaped, released, and an empty backlog at the end
    wait_metric(p, "rmqfast_limit_released_total", len(shaped_sends), topic=topic)
    m = p.metrics()
    assert metric(m, "rmqfast_limit_shaped_total", topic=topic) == len(shaped_sends)
    assert metric(m, "rmqfast_limit_admitted_total", topic=topic) == N - len(shaped_sends)
    assert metric(m, "rmqfast_limit_rejected_total", topic=topic) == 0
    # the backlog gauges are published once a second
    wait_until(lambda: metric(p.metrics(), "rmqfast_limit_shaped_backlog_messages", topic=topic) == 0, BOUND,
               "an empty backlog")


def test_unshaped_sends_go_direct_once_the_backlog_drained(cluster: RocketMQCluster, shaped) -> None:
    p, topic = shaped
    wait_until(lambda: metric(p.metrics(), "rmqfast_limit_shaped_backlog_messages", topic=topic) == 0
               and metric(p.metrics(), "rmqfast_limit_shaped_total", topic=topic) > 0, 30, "a drained backlog")
    time.sleep(1.0)  # the bucket refills
    prod = run_driver("produce", p.namesrv_addr, "5", topic=topic, count=3, mode="sync", send_timeout_ms=10000,
                      retries=0)
    assert prod["sent_count"] == 3 and all(s["queue_offset"] >= 0 for s in prod["sent"]), prod["sent"]


def test_the_4x_client_accepts_the_shaped_answer_too(cluster: RocketMQCluster, shaped) -> None:
    p, topic = shaped
    run, group = unique("r"), unique("g")
    consumer = start_driver("consume-push", cluster.namesrv_addr, "5", topic=topic, group=group, expect=20,
                            only_run=run, timeout_ms=60000)
    with consumer:
        consumer.wait_started(60)
        prod = run_driver("produce", p.namesrv_addr, "4", topic=topic, count=20, mode="sync", run_id=run,
                          send_timeout_ms=10000, retries=0)
        res = consumer.result(90, check=False)
    assert prod["sent_count"] == 20 and not prod["failed"], prod["failed"][:3]
    assert sum(1 for s in prod["sent"] if s["queue_offset"] == -1) >= 10  # most of them were shaped
    assert res["distinct"] == 20 and not res["duplicates"]
    # sync sends keep their order per queue
    per_queue: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for d in res["received"]:
        if d.get("run") == run:
            per_queue.setdefault((d["broker_name"], d["queue_id"]), []).append((d["queue_offset"], int(d["idx"])))
    for q, rows in per_queue.items():
        idxs = [i for _o, i in sorted(rows)]
        assert idxs == sorted(idxs), (q, idxs)
