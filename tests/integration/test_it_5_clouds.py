"""Cross-cloud selective delivery with real parts: two RocketMQ 5.3.3 clusters on
loopback (cloud A and cloud B), rmqfast in front of A (and of B where loops are checked), the
real Java client producing in A and consuming in B.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from itutil import BOUND, metric, unique, wait_until

from rmqfast.testing import JarPaths, RocketMQCluster, run_driver, start_driver
from rmqfast.testing.cluster import HarnessError, remoting_request
from rmqfast.testing.proxy import ProxyProcess

pytestmark = pytest.mark.integration

GET_MAX_OFFSET = 30
N = 200


@pytest.fixture(scope="module")
def cloud_a(jars: JarPaths) -> Iterator[RocketMQCluster]:
    with RocketMQCluster(jars=jars, cluster_name="CloudA", broker_name="broker-a") as c:
        yield c


@pytest.fixture(scope="module")
def cloud_b(jars: JarPaths) -> Iterator[RocketMQCluster]:
    with RocketMQCluster(jars=jars, cluster_name="CloudB", broker_name="broker-b") as c:
        yield c


def stored(cluster: RocketMQCluster, topic: str, queues: int = 4) -> int:
    """Messages the cluster's broker holds for ``topic`` (sum of the queues' max offsets)."""
    total = 0
    for q in range(queues):
        r = remoting_request(cluster.broker_addr, GET_MAX_OFFSET, {"topic": topic, "queueId": q})
        if r.code == 0:
            total += int(r.ext_fields.get("offset", 0))
    return total


def clouds_config(remote_ns: str, topics: list[dict[str, Any]], *, durability: str = "fast", local: str = "cloud-a",
                  remote: str = "cloud-b", extra: str = "") -> str:
    rules = ""
    for t in topics:
        groups = ", ".join(f'"{g}"' for g in t.get("groups", []))
        rules += f'\n[[replicate.topic]]\nname = "{t["name"]}"\nreplicate = "{t.get("replicate", "online")}"\n'
        rules += f"groups = [{groups}]\n"
    return f"""
[clouds]
local = "{local}"
detect_interval = 0.5
detect_timeout = 2.0

[[clouds.remote]]
name = "{remote}"
namesrv = ["{remote_ns}"]

[replicate]
durability = "{durability}"
retry_initial = 0.05
retry_max = 0.5
{extra}
{rules}
"""


def wait_online(proxy: ProxyProcess, topic: str, timeout: float = 30.0) -> None:
    wait_until(lambda: metric(proxy.metrics(), "rmqfast_remote_consumers_online", topic=topic) >= 1, timeout,
               f"remote consumers of {topic} detected online")


def check_copies(res: dict[str, Any], sent: list[dict[str, Any]], run: str) -> None:
    """Every acknowledged message arrived once, identical (body, user properties, UNIQ_KEY)."""
    by_idx = {int(r["idx"]): r for r in res["received"] if r.get("run") == run and r.get("acked", True)}
    acked = {int(s["idx"]): s for s in sent}
    missing = sorted(set(acked) - set(by_idx))
    assert not missing, f"{len(missing)} acknowledged messages never reached cloud B: {missing[:10]}"
    for idx, s in acked.items():
        got = by_idx[idx]
        assert got["msg_id"] == s["msg_id"], (idx, got["msg_id"], s["msg_id"])  # UNIQ_KEY preserved
        assert got["body"].startswith(f"rmq|{run}|{idx}|"), got["body"]
        assert got["props"]["p1"] == f"v{idx}" and got["props"]["idx"] == str(idx)
        assert got["props"]["RMQFAST_ORIGIN"] == "cloud-a"


def assert_order_in_b(res: dict[str, Any], run: str) -> None:
    """The copies sit in B's queues in the producer's order, per sharding key.

    Judged by B's queue offsets (what the deliverer controls), not by delivery order: a consumer
    redelivers from its last committed offset after B's broker is killed, which is not disorder.
    """
    per_queue: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for d in res["received"]:
        if d.get("run") == run:
            per_queue.setdefault((d["broker_name"], d["queue_id"]), {})[d["queue_offset"]] = d
    shards: dict[str, list[int]] = {}
    for q, by_offset in per_queue.items():
        for off in sorted(by_offset):
            d = by_offset[off]
            shards.setdefault(f"{d['shard']}@{q}", []).append(int(d["idx"]))
    assert len({k.split("@")[0] for k in shards}) == len(shards), f"a sharding key spans queues: {sorted(shards)}"
    for key, idxs in shards.items():
        first = list(dict.fromkeys(idxs))  # a re-sent copy may repeat an index; order is of first copies
        assert first == sorted(first), f"{key}: copies stored out of order in B: {first}"


def test_online_topic_is_copied_offline_topic_is_not_and_copies_never_come_back(
    cloud_a: RocketMQCluster, cloud_b: RocketMQCluster
) -> None:
    t1, t2 = unique("c1"), unique("c2")
    g1, g2 = unique("g1"), unique("g2")
    for c in (cloud_a, cloud_b):
        c.create_topic(t1, 4)
        c.create_topic(t2, 4)
    run = unique("r")
    # B's own rmqfast replicates t1 back to A ("always"): a copy arriving from A must not bounce.
    cfg_b = clouds_config(cloud_a.namesrv_addr, [{"name": t1, "replicate": "always"}], local="cloud-b",
                          remote="cloud-a")
    with ProxyProcess([cloud_b.namesrv_addr], workers=1, extra_config=cfg_b) as proxy_b:
        cfg_a = clouds_config(proxy_b.namesrv_addr, [{"name": t1, "groups": [g1]}, {"name": t2, "groups": [g2]}])
        with ProxyProcess([cloud_a.namesrv_addr], workers=1, extra_config=cfg_a) as proxy_a:
            consumer = start_driver("consume-push", cloud_b.namesrv_addr, "5", topic=t1, group=g1, expect=N,
                                    orderly=True, only_run=run, timeout_ms=90000)
            with consumer:
                consumer.wait_started(60)
                wait_online(proxy_a, t1)
                assert metric(proxy_a.metrics(), "rmqfast_remote_consumers_online", topic=t2) == 0
                prod = run_driver("produce", proxy_a.namesrv_addr, "5", topic=t1, count=N, mode="ordered",
                                  shard_keys=4, run_id=run, send_timeout_ms=15000)
                assert prod["sent_count"] == N, prod["failed"][:3]
                p2 = run_driver("produce", proxy_a.namesrv_addr, "5", topic=t2, count=50, mode="sync",
                                run_id=run + "x", send_timeout_ms=15000)
                assert p2["sent_count"] == 50
                res = consumer.result(120, check=False)
            assert res["distinct"] == N, {k: res.get(k) for k in ("distinct", "timed_out", "error")}
            assert res["duplicates"] == []
            check_copies(res, prod["sent"], run)
            assert res["shard_in_order"] and all(res["shard_in_order"].values()), res["order_by_shard"]
            assert_order_in_b(res, run)
            time.sleep(2.0)  # let anything wrongly copied arrive
            assert stored(cloud_b, t2) == 0, "copies of a topic without consumers in B reached B"
            assert stored(cloud_b, t1) == N
            # nothing came back: A holds exactly what its producer sent
            assert stored(cloud_a, t1) == N
            m_b = proxy_b.metrics()
            assert metric(m_b, "rmqfast_replicate_not_copied_total", reason="copy_of_copy") >= N
            assert metric(m_b, "rmqfast_replicate_copies_total") == 0
            m_a = proxy_a.metrics()
            assert metric(m_a, "rmqfast_deliver_messages_total", topic=t1) == N
            assert metric(m_a, "rmqfast_deliver_messages_total", topic=t2) == 0


def test_remote_broker_down_copies_spill_then_drain_in_order(
    cloud_a: RocketMQCluster, cloud_b: RocketMQCluster
) -> None:
    t, g, run = unique("sp"), unique("gs"), unique("r")
    cloud_a.create_topic(t, 4)
    cloud_b.create_topic(t, 4)
    first, count = 50, 150  # 50 while B is up, 150 while its broker is down
    # a channel of 20 copies: most of the backlog must go to RocksDB
    cfg = clouds_config(cloud_b.namesrv_addr, [{"name": t, "groups": [g]}], extra="channel_size = 20")
    with ProxyProcess([cloud_a.namesrv_addr], workers=1, extra_config=cfg) as proxy:
        consumer = start_driver("consume-push", cloud_b.namesrv_addr, "5", topic=t, group=g, expect=first + count,
                                orderly=True, only_run=run, timeout_ms=420000)  # a bound: it ends at 200
        with consumer:
            consumer.wait_started(60)
            wait_online(proxy, t)
            before = run_driver("produce", proxy.namesrv_addr, "5", topic=t, count=first, mode="ordered",
                                shard_keys=4, run_id=run, send_timeout_ms=15000)
            wait_until(lambda: stored(cloud_b, t) >= first, BOUND, "the first copies in B")
            cloud_b.stop_broker()
            try:
                prod = run_driver("produce", proxy.namesrv_addr, "5", topic=t, count=count, start_index=first,
                                  mode="ordered", shard_keys=4, run_id=run, send_timeout_ms=15000)
                assert prod["sent_count"] == count  # cloud A is not affected by B being away
                try:
                    backlog = wait_until(
                        lambda: metric(proxy.metrics(), "rmqfast_replicate_backlog_messages", topic=t) >= count
                        and proxy.metrics(), BOUND, "backlog of every copy")
                except AssertionError:
                    m = proxy.metrics()
                    print({k: v for k, v in m.items() if "replicate" in k[0] or "spill" in k[0] or "deliver" in k[0]})
                    print(proxy.log_tail(40))
                    raise
                # beyond the 20-copy memory channel, every copy waits in RocksDB
                assert metric(backlog, "rmqfast_spill_messages") >= count - 20
                assert metric(backlog, "rmqfast_replicate_backlog_oldest_seconds", topic=t) > 0
            finally:
                cloud_b.start_broker()
            res = consumer.result(450, check=False)
        if res["distinct"] != first + count:
            m = proxy.metrics()
            print("B stored", stored(cloud_b, t), {k: v for k, v in m.items() if "bucket" not in k[0] and (
                "replicate" in k[0] or "spill" in k[0] or "deliver" in k[0])})
            print(proxy.log_tail(60))
            print(consumer.stderr_text()[-3000:])
        assert res["distinct"] == first + count, {k: res.get(k) for k in ("distinct", "timed_out", "error")}
        check_copies(res, before["sent"] + prod["sent"], run)
        assert_order_in_b(res, run)
        wait_until(lambda: metric(proxy.metrics(), "rmqfast_replicate_backlog_messages", topic=t) == 0, BOUND,
                   "the backlog drained")
        m = proxy.metrics()
        assert metric(m, "rmqfast_spill_messages") == 0
        assert metric(m, "rmqfast_deliver_retries_total") > 0


#: What the durable kill -9 test must have seen, however slow the machine is.
MIN_KILLS = 12  # 6 workers and 6 deliverers, alternating (20 took 136 s of the 17 min lane)
MIN_ACKED = 500
#: Messages that must pass through between two kills: stored in A (a worker relayed them) and
#: copies stored in B (a deliverer sent them), so every kill finds both restarted and working.
PROGRESS_PER_KILL = 10
#: Seconds without one acknowledged send (or, while sends are acknowledged, without a kill):
#: no progress at all, the only slowness the test fails on.
STALL = 240.0


@pytest.mark.timeout(2400)
def test_durable_mode_kill9_of_workers_and_deliverers_loses_nothing_acknowledged(
    cloud_a: RocketMQCluster, cloud_b: RocketMQCluster
) -> None:
    """Kills paced by progress, not by the clock: a worker or deliverer is killed only after
    messages went through both since the last kill.  Runs until MIN_KILLS kills and MIN_ACKED
    acknowledged sends (however long that takes on a loaded machine, within STALL of progress),
    then checks that every acknowledged send reached B."""
    import os
    import signal

    t, g, run = unique("du"), unique("gd"), unique("r")
    cloud_a.create_topic(t, 4)
    cloud_b.create_topic(t, 4)
    cfg = clouds_config(cloud_b.namesrv_addr, [{"name": t, "groups": [g]}], durability="durable")
    t0 = time.monotonic()
    with ProxyProcess([cloud_a.namesrv_addr], workers=1, extra_config=cfg) as proxy:
        # a consumer that stays online (records nothing: only_run matches no message)
        presence = start_driver("consume-push", cloud_b.namesrv_addr, "5", topic=t, group=g, expect=1,
                                only_run="nobody", timeout_ms=3_600_000)
        with presence:
            presence.wait_started(120)
            wait_online(proxy, t, timeout=120)
            stop = threading.Event()
            kills: list[str] = []
            last_kill = [time.monotonic()]
            killer_error: list[BaseException] = []

            def both_stored() -> tuple[int, int] | None:
                try:
                    return stored(cloud_a, t), stored(cloud_b, t)
                except (OSError, ValueError, HarnessError):
                    return None  # a broker busy: ask again

            def killer() -> None:
                killed: set[int] = set()
                try:
                    base = wait_until(both_stored, STALL, "message counts of both brokers")
                    while not stop.wait(0.05):
                        kind = "worker" if len(kills) % 2 == 0 else "deliver"
                        now_ab = both_stored()
                        if now_ab is None or min(now_ab[0] - base[0], now_ab[1] - base[1]) < PROGRESS_PER_KILL:
                            continue
                        try:
                            h = proxy.health()
                        except (OSError, ValueError):
                            continue  # the admin endpoint busy: ask again
                        pids = [p for p in h.get("worker_pids" if kind == "worker" else "deliver_pids", [])
                                if p not in killed]
                        if not pids:
                            continue  # not restarted yet
                        os.kill(pids[0], signal.SIGKILL)
                        killed.add(pids[0])
                        kills.append(kind)
                        last_kill[0] = time.monotonic()
                        base = wait_until(both_stored, STALL, "message counts of both brokers")
                except BaseException as exc:  # reported by the main thread
                    killer_error.append(exc)

            th = threading.Thread(target=killer, daemon=True)
            th.start()
            sent: list[dict[str, Any]] = []
            batches = 0
            last_ack = time.monotonic()
            try:
                while len(kills) < MIN_KILLS or len(sent) < MIN_ACKED:
                    now = time.monotonic()
                    assert not killer_error, f"the killer thread failed: {killer_error[0]!r}"
                    assert now - last_ack < STALL, (
                        f"no progress: no send acknowledged for {STALL:.0f} s "
                        f"({len(sent)} acknowledged, kills={len(kills)})\n{proxy.log_tail(30)}")
                    assert now - last_kill[0] < STALL, (
                        f"no progress: sends are acknowledged ({len(sent)}) but no kill for {STALL:.0f} s: "
                        f"copies do not reach B?\n{proxy.log_tail(30)}")
                    # a batch starts only with a worker that answers, so each batch can make progress
                    proxy.wait_ready(STALL)
                    r = run_driver("produce", proxy.namesrv_addr, "5", topic=t, count=50, start_index=50 * batches,
                                   mode="sync", run_id=run, allow_failures=True, send_timeout_ms=3000, retries=4,
                                   check=False, timeout=STALL)
                    batches += 1
                    if r["sent"]:
                        last_ack = time.monotonic()
                    sent += r["sent"]
            finally:
                stop.set()
                th.join()
            assert kills.count("worker") >= MIN_KILLS // 2 and kills.count("deliver") >= MIN_KILLS // 2, kills
            proxy.wait_ready(STALL)
        # every acknowledged message reaches B (duplicates allowed, counted); B may also hold copies
        # of sends whose answer the producer never saw (at least once), so wait for B to settle first
        wait_until(lambda: stored(cloud_b, t) >= len(sent), STALL, "the copies of every acknowledged send in B")
        wait_until(lambda: metric(proxy.metrics(), "rmqfast_replicate_backlog_messages", topic=t) == 0, STALL,
                   "the replication backlog drained")
        last = -1
        while (now_b := stored(cloud_b, t)) != last:  # copies in flight when the backlog read 0
            last = now_b
            time.sleep(2.0)
        m = proxy.metrics()
        # read everything B holds (it may hold more than was acknowledged: delivery is at least once);
        # with duplicates in B the consumer never reaches `in_b` distinct and ends at its timeout
        in_b = stored(cloud_b, t)
        verify = run_driver("consume-push", cloud_b.namesrv_addr, "5", topic=t, group=unique("gv"),
                            expect=in_b, only_run=run, timeout_ms=60000, settle_ms=2000, check=False, timeout=180)
        assert metric(m, "rmqfast_replicate_delivered_total", outcome="gave_up") == 0
        assert metric(m, "rmqfast_replicate_backlog_messages", topic=t) == 0
        check_copies(verify, sent, run)
        dups = sum(1 for d in verify["received"] if d.get("run") == run) - verify["distinct"]
        print(f"durable kill -9: kills={len(kills)} ({kills.count('worker')} workers) acknowledged={len(sent)} "
              f"of {50 * batches} in {batches} batches, delivered_distinct={verify['distinct']} duplicates={dups} "
              f"in {time.monotonic() - t0:.0f} s")
