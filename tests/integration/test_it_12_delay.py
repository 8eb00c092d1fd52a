"""Proxy-held delayed messages with real RocketMQ brokers (5.3.3 and 4.9.4) and real Java clients.

* 5.3.3 broker, clients 5.3.3 and 4.9.4: messages asking for a delivery time a few seconds out
  (TIMER_DELIVER_MS, TIMER_DELAY_SEC, TIMER_DELAY_MS, __STARTDELIVERTIME) are answered by the
  proxy (queueOffset -1), stored by the broker at their due time, neither early nor later than
  the bound, in due-time order within each queue, without delay properties and without the broker's timer having
  touched them (no TIMER_OUT_MS), and the consumer's msgId is the producer's.
* 4.9.4 broker (no timer messages at all) and a delay level beyond its 18 (mapped by [delay] levels).
* kill -9 of both workers while 3000 are pending: every acknowledged message arrives exactly once.
"""

from __future__ import annotations

import os
import signal
import statistics
import time

import pytest
from itutil import metric, unique, wait_until

from rmqfast.testing import RocketMQCluster, start_driver
from rmqfast.testing.javaclient import run_driver
from rmqfast.testing.proxy import ProxyProcess

pytestmark = pytest.mark.integration

#: Lateness bound (due -> stored by the broker) on the 2-core machine under load; measured figures
#: are printed (the benchmark has the lateness targets).
LATE_BOUND_MS = 5000


def delay_proxy(namesrv: str, topic: str, workers: int = 2, levels: str = "") -> ProxyProcess:
    extra = f"""
[delay]
topics = ["{topic}"]
{levels}
"""
    return ProxyProcess([namesrv], workers=workers, extra_config=extra)


def check_deliveries(got: list[dict], sent: list[dict], label: str, *, order: bool = True) -> list[int]:
    """None early, none too late, no delay property left, consumer msgId = producer msgId; lateness list.

    ``due_ms`` is the client's (time the message was built + delay): for the relative properties the
    proxy counts from when the send reached it, a little later, so "not early" holds against it; the
    order check (``order``) needs absolute times (the first send of a client is the slow one).
    """
    late = []
    for d in got:
        due = int(d["props"]["due_ms"])
        assert d["store_timestamp"] >= due, (label, "stored early by ms", due - d["store_timestamp"])
        assert d["recv_epoch_ms"] >= due, (label, "received early by ms", due - d["recv_epoch_ms"])
        late.append(d["store_timestamp"] - due)
        props = {**d["props"], **d["sys_props"]}
        assert not {"TIMER_DELIVER_MS", "TIMER_DELAY_SEC", "TIMER_DELAY_MS", "__STARTDELIVERTIME", "DELAY",
                    "TIMER_OUT_MS", "REAL_TOPIC"} & set(props), (label, props)
    assert max(late) < LATE_BOUND_MS, (label, sorted(late)[-5:])
    assert {d["msg_id"] for d in got} == {s["msg_id"] for s in sent}
    if not order:
        return late
    # due-time order as the broker stored them, in each queue: the proxy releases each queue's
    # messages in due order (one lane per queue); across queues the lanes run side by side, so two
    # messages of different queues due 150 ms apart may be stored the other way round on a
    # loaded machine, which no ordering contract of RocketMQ covers
    queues: dict[tuple[str, int], list[dict]] = {}
    for d in got:
        queues.setdefault((d.get("broker_name", ""), int(d["queue_id"])), []).append(d)
    for q, ds in queues.items():
        dues = [int(d["props"]["due_ms"]) for d in sorted(ds, key=lambda d: int(d["queue_offset"]))]
        assert dues == sorted(dues), (label, q, "stored out of due order", dues)
    assert len(queues) > 1 or len(got) < 2, (label, "every message on one queue: the order check would be weak")
    return late


@pytest.mark.parametrize("client", ["5", "4"])
@pytest.mark.parametrize("prop", ["TIMER_DELIVER_MS", "TIMER_DELAY_SEC", "TIMER_DELAY_MS", "__STARTDELIVERTIME"])
def test_delayed_sends_arrive_on_time_in_due_order(cluster: RocketMQCluster, client: str, prop: str) -> None:
    topic = unique("delay")
    cluster.create_topic(topic)
    n = 20
    with delay_proxy(cluster.namesrv_addr, topic) as p:
        run, group = unique("r"), unique("g")
        consumer = start_driver("consume-push", cluster.namesrv_addr, "5", topic=topic, group=group, expect=n,
                                only_run=run, timeout_ms=90000)
        with consumer:
            consumer.wait_started(60)
            # sent in an order that is NOT their due order: message k is due 6 s - k * 150 ms after
            # it is built (TIMER_DELAY_SEC: whole seconds, 3 s + k s)
            step, base = (-150, 6000) if prop != "TIMER_DELAY_SEC" else (1000, 3000)
            prod = run_driver("produce", p.namesrv_addr, client, topic=topic, count=n, mode="sync", run_id=run,
                              delay_prop=prop, delay_ms=base, delay_step_ms=step, send_timeout_ms=10000)
            res = consumer.result(150, check=False)
        assert prod["sent_count"] == n and not prod["failed"]
        assert all(s["status"] == "SEND_OK" and s["queue_offset"] == -1 for s in prod["sent"])  # proxy-held
        got = [d for d in res["received"] if d.get("run") == run]
        assert res["distinct"] == n and not res["duplicates"], {k: res.get(k) for k in ("distinct", "duplicates")}
        late = check_deliveries(got, prod["sent"], f"{prop}/client{client}",
                                order=prop in ("TIMER_DELIVER_MS", "__STARTDELIVERTIME"))
        print(f"{prop} client {client}: lateness ms p50={statistics.median(late):.0f} max={max(late)}")
        # published every second: the counters reach n (and stay there: checked once more after)
        wait_until(lambda: metric(p.metrics(), "rmqfast_delay_released_total") == n, 60, "released == n")
        assert metric(p.metrics(), "rmqfast_delay_accepted_total") == n
        assert metric(p.metrics(), "rmqfast_delay_released_total") == n


def test_kill_workers_with_pending_messages_every_one_arrives_once(cluster: RocketMQCluster) -> None:
    topic = unique("delaykill")
    cluster.create_topic(topic)
    n = 3000
    with delay_proxy(cluster.namesrv_addr, topic) as p:
        run, group = unique("r"), unique("g")
        consumer = start_driver("consume-push", cluster.namesrv_addr, "5", topic=topic, group=group, expect=n,
                                only_run=run, timeout_ms=240000)
        with consumer:
            consumer.wait_started(60)
            prod = run_driver("produce", p.namesrv_addr, "5", topic=topic, count=n, mode="async", run_id=run,
                              async_inflight=64, delay_prop="TIMER_DELAY_MS", delay_ms=15000, delay_step_ms=2,
                              send_timeout_ms=20000, timeout_ms=100000, timeout=150)
            assert prod["sent_count"] == n and not prod["failed"], prod["failed"][:3]
            acked = time.time() * 1000
            # each worker publishes its gauge every second: wait until both have (a loaded machine may have
            # released the first ones already: pending + released is every message)
            def held() -> tuple[float, float] | None:
                m = p.metrics()
                pr = metric(m, "rmqfast_delay_pending_messages"), metric(m, "rmqfast_delay_released_total")
                return pr if sum(pr) == n else None

            pending, released = wait_until(held, 10, "pending + released == n in the metrics", interval=0.05)
            pids = p.worker_pids()
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            killed = time.time() * 1000
            res = consumer.result(300, check=False)
        got = [d for d in res["received"] if d.get("run") == run]
        print(f"kill -9 of {len(pids)} workers {killed - acked:.0f} ms after the last answer, {pending:.0f} pending "
              f"({released:.0f} released before); received {res['distinct']} distinct, "
              f"{len(res['duplicates'])} duplicates")
        assert res["distinct"] == n, res["distinct"]
        assert not res["duplicates"], res["duplicates"][:5]
        # order: not checked here (due 2 ms apart, counted by the proxy from each send's arrival, and
        # what was overdue after the restart goes out on every queue at once)
        late = check_deliveries(got, prod["sent"], "kill -9", order=False)
        print(f"after kill -9: lateness ms p50={statistics.median(late):.0f} max={max(late)}")


@pytest.fixture(scope="module")
def cluster4(jars):  # noqa: ANN001
    with RocketMQCluster(jars=jars, version="4") as c:
        yield c


def test_on_a_4x_broker_timer_properties_and_a_level_beyond_18(cluster4: RocketMQCluster) -> None:
    """A 4.9.4 broker has no timer messages (it would deliver at once) and 18 levels (19 would be 2 h)."""
    topic = unique("delay4")
    cluster4.create_topic(topic)
    n = 10
    with delay_proxy(cluster4.namesrv_addr, topic, levels='levels = { 19 = "4s" }') as p:
        run, group = unique("r"), unique("g")
        consumer = start_driver("consume-push", cluster4.namesrv_addr, "4", topic=topic, group=group, expect=2 * n,
                                only_run=run, timeout_ms=90000)
        with consumer:
            consumer.wait_started(60)
            prod = run_driver("produce", p.namesrv_addr, "4", topic=topic, count=n, mode="sync", run_id=run,
                              delay_prop="TIMER_DELIVER_MS", delay_ms=5000, delay_step_ms=-200)
            t0 = int(time.time() * 1000)
            prod2 = run_driver("produce", p.namesrv_addr, "4", topic=topic, count=n, start_index=n, mode="sync",
                               run_id=run, delay_level=19)
            t1 = int(time.time() * 1000)
            res = consumer.result(150, check=False)
        assert res["distinct"] == 2 * n and not res["duplicates"]
        got = [d for d in res["received"] if d.get("run") == run]
        timer = [d for d in got if d["idx"] < n]
        late = check_deliveries(timer, prod["sent"], "4.x TIMER_DELIVER_MS")
        level = [d for d in got if d["idx"] >= n]
        # level 19 = 4 s: stored from 4 s after the first send was built, within the bound after the last
        assert all(t0 - 30_000 < d["born_timestamp"] and d["store_timestamp"] >= d["born_timestamp"] + 4000
                   for d in level), [(d["born_timestamp"], d["store_timestamp"]) for d in level]
        assert all(d["store_timestamp"] <= t1 + 4000 + LATE_BOUND_MS for d in level)
        assert all(d["delay_level"] == 0 for d in level)
        assert all(s["queue_offset"] == -1 for s in prod2["sent"])
        print(f"4.x broker: timer lateness ms p50={statistics.median(late):.0f} max={max(late)}")
