"""Proxy and upstream life cycle: broker down and back, a worker killed, SIGHUP, SIGTERM, and
the pure-Python codec.

Tests that disturb the proxy's processes or configuration run their own ``ProxyProcess``;
``test_upstream_down`` stops the shared broker and restores it (``restore_broker``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from itutil import (
    BOUND,
    GET_BROKER_CONFIG,
    GET_MAX_OFFSET,
    GET_ROUTEINFO_BY_TOPIC,
    HEART_BEAT,
    NO_PERMISSION,
    SEND_TIMEOUT_MS,
    SUCCESS,
    SYSTEM_ERROR,
    assert_roundtrip,
    call,
    checked,
    connect,
    drive,
    finish,
    log_records,
    metric,
    pid_alive,
    properties,
    proxy_broker_endpoint,
    request,
    tcp_connections,
    unique,
    wait_closed,
    wait_metric,
    wait_until,
)

from rmqfast.codec import FrameScannerC
from rmqfast.testing import RocketMQCluster, start_driver
from rmqfast.testing.proxy import ProxyProcess

pytestmark = pytest.mark.integration

#: Seconds one worker restart may take: a bound for a stuck supervisor, not a speed target (a
#: worker took 5 s from start to ready at a load average of 10 on 2 cores).
RESTART_BOUND = 120.0


# --------------------------------------------------------------------------- 9. upstream down


def test_upstream_down(restore_broker: RocketMQCluster, proxy: ProxyProcess) -> None:
    """Broker killed: a request to its proxy endpoint gets SYSTEM_ERROR saying the upstream is
    unreachable (or the connection closes); after the restart new connections work again."""
    cluster = restore_broker
    topic = unique("down")
    cluster.create_topic(topic)
    endpoint = proxy_broker_endpoint(proxy, topic)  # learnt before: the name server forgets a dead broker
    assert request(endpoint, GET_MAX_OFFSET, {"topic": topic, "queueId": 0}).code == SUCCESS
    m0 = proxy.metrics()

    cluster.stop_broker()
    assert not cluster.broker_running
    for code, ext in ((GET_MAX_OFFSET, {"topic": topic, "queueId": 0}), (HEART_BEAT, None)):
        with connect(endpoint) as s:
            try:
                r = call(s, code, ext)
            except ConnectionError:
                r = None  # closed without an answer: allowed
            if r is not None:
                assert r.code == SYSTEM_ERROR, r
                assert r.remark and "upstream unreachable" in r.remark, r.remark
                assert cluster.broker_addr in r.remark  # says which upstream
            assert wait_closed(s) == b""
    assert log_records(proxy, "upstream unreachable", role="broker")
    wait_metric(
        proxy,
        "rmqfast_upstream_errors_total",
        metric(m0, "rmqfast_upstream_errors_total", role="broker") + 2,
        role="broker",
    )
    # the proxy itself is fine
    assert proxy.proc.poll() is None and proxy.health()["restarts"] == 0

    cluster.start_broker()
    r = request(endpoint, GET_MAX_OFFSET, {"topic": topic, "queueId": 0})
    assert r.code == SUCCESS, r
    res = drive("roundtrip", proxy.namesrv_addr, "5", topic=topic, count=10, mode="sync", timeout=60)
    assert_roundtrip(res, 10)


# --------------------------------------------------------------------------- 11. worker killed


def _requests_total(proxy: ProxyProcess) -> dict[tuple[tuple[str, str], ...], float]:
    return {lab: v for (n, lab), v in proxy.metrics().items() if n == "rmqfast_requests_total"}


def test_worker_killed_under_load(cluster: RocketMQCluster) -> None:
    """kill -9 the worker relaying a running producer: the producer (retries) and a consumer
    complete, the supervisor restarts the worker within ~1 s, counters do not go backwards."""
    topic = unique("kill")
    count = 800
    cluster.create_topic(topic)
    with ProxyProcess([cluster.namesrv_addr]) as p:
        endpoint = proxy_broker_endpoint(p, topic)
        ep_port = int(endpoint.rpartition(":")[2])
        pids = p.worker_pids()
        assert len(pids) == 2
        # The consumer's connections may die with the worker too.  Its recovery runs on the Java
        # client's own timers: a pull stranded by the close race described below is failed by
        # its 30 s timeout (then retried 3 s later), the broker forgets the consumer with its
        # connection until the next 30 s heartbeat, and a rebalance every 20 s drops and takes
        # back queues meanwhile: the deadline leaves room for all of them.  The drivers' logs go
        # to the proxy's work directory, which a failing test keeps.
        drivers = p.workdir / "drivers"
        consumer = start_driver(
            "consume-push", p.namesrv_addr, "5", topic=topic, expect=count, timeout_ms=150000, settle_ms=500,
            log_dir=drivers,
        )
        producer = None
        try:
            consumer.wait_started(30)
            # consumer pulling (request bytes count on arrival; requests_total when a long poll ends)
            wait_metric(p, "rmqfast_request_bytes_total", 1, role="broker", code="11")
            before = _requests_total(p)
            producer = start_driver(
                "produce",
                p.namesrv_addr,
                "5",
                topic=topic,
                count=count,
                mode="sync",
                retries=5,
                send_timeout_ms=SEND_TIMEOUT_MS,
                log_dir=drivers,
            )

            # the worker that holds the producer's broker connection: match the producer's
            # local port with the workers' accepted sockets on the endpoint port
            def victim() -> tuple[int, int] | None:
                mine = [lp for lp, rp in tcp_connections(producer.pid) if rp == ep_port]
                for wpid in pids:
                    for lp, rp in tcp_connections(wpid):
                        if lp == ep_port and rp in mine:
                            return wpid, rp
                return None

            wpid, _ = wait_until(victim, 30, "the producer's connection through a worker", interval=0.02)
            assert producer.poll() is None, "producer finished before the kill: raise count"
            os.kill(wpid, signal.SIGKILL)
            killed_at = time.monotonic()

            def restarted() -> list[int] | None:
                now = p.worker_pids()
                return now if len(now) == 2 and wpid not in now and all(pid_alive(x) for x in now) else None

            new_pids = wait_until(restarted, RESTART_BOUND, "the supervisor to restart the killed worker",
                                  interval=0.02)
            print(f"worker restarted after {time.monotonic() - killed_at:.2f} s")  # speed: not asserted here
            assert set(new_pids) - set(pids) and (set(pids) - {wpid}) <= set(new_pids)
            assert p.health()["restarts"] == 1
            assert producer.poll() is None or producer.result(1, check=False)["sent_count"] < count, (
                "the kill did not happen while the producer was sending"
            )

            # counters never go backwards while the run goes on
            samples = [before]
            sent = checked(producer.result(90, check=False))
            samples.append(_requests_total(p))
            # (a send lost to the client's race below is never consumed: the consumer then stops at
            # its timeout, one short)
            consumed = finish(consumer, 180) if not sent["failed"] else checked(consumer.result(180, check=False))
            wait_until(lambda: p.get("/readyz")[0] == 200, BOUND, "readyz after the restart")
            samples.append(_requests_total(p))
            for a, b in zip(samples, samples[1:], strict=False):
                for lab, v in a.items():
                    assert b.get(lab, 0) >= v, (lab, v, b.get(lab))
            assert sum(samples[-1].values()) > sum(before.values())
        finally:
            if producer is not None:
                producer.kill()
            consumer.kill()

        # The Java client fails the requests in flight on a connection the moment it closes
        # (NettyRemotingClient: channelInactive -> closeChannel -> close -> failFast), unless another
        # client thread (its heartbeat, say) met the dead channel first: createChannelAsync drops an
        # inactive channel from the table, closeChannel then finds nothing and skips the failFast,
        # and the send in flight at the kill waits out its whole timeout (15 s: no time left for a
        # retry).  Seen once in CI, 799 of 800.  So at most that one send may fail, by the client's
        # timeout; every other send is acknowledged, and every acknowledged send arrives.
        failed = sent["failed"]
        assert len(failed) <= 1 and all("timeout" in f["error"] for f in failed), failed[:3]
        if failed:
            print(f"one send in flight at the kill timed out in the client: {failed[0]['error']}")
        acked = {d["idx"] for d in sent["sent"]}
        assert sent["sent_count"] == len(acked) == count - len(failed)
        got = {d["idx"] for d in consumed["received"] if d["run"] == sent["run_id"]}
        assert acked <= got, f"missing {sorted(acked - got)[:20]}"
        # (a send whose answer died with the worker may have been retried: duplicates are allowed)
        assert log_records(p, "worker died; restarting it", worker_pid=wpid)
        assert len(log_records(p, "worker ready")) == 3


# --------------------------------------------------------------------------- 12. SIGHUP / SIGTERM


def test_reload_keeps_connections_and_applies_policy_then_sigterm(cluster: RocketMQCluster) -> None:
    """SIGHUP with a changed config: an established connection stays open and gets the new
    policy at once, a long-running consumer keeps receiving; SIGTERM then exits 0 in time."""
    topic = unique("reload")
    cluster.create_topic(topic)
    with ProxyProcess([cluster.namesrv_addr]) as p:
        endpoint = proxy_broker_endpoint(p, topic)
        old = connect(endpoint, timeout=10)
        consumer = start_driver(
            "consume-push", p.namesrv_addr, "5", topic=topic, expect=40, timeout_ms=60000, settle_ms=500
        )
        try:
            r = call(old, GET_BROKER_CONFIG)
            assert r.code == NO_PERMISSION, r
            consumer.wait_started(30)
            first = drive("produce", p.namesrv_addr, "5", topic=topic, count=20, mode="sync", timeout=60)
            assert first["sent_count"] == 20
            pids = p.worker_pids()

            p.config_path.write_text(p.config_path.read_text() + "\n[policy]\nallow_codes = [26]\n")
            p.reload()
            wait_until(
                lambda: {r["pid"] for r in log_records(p, "configuration reloaded") if "worker" in r} >= set(pids),
                BOUND,
                "both workers to log 'configuration reloaded'",
            )
            # same processes, established connection still open and under the new policy
            assert p.worker_pids() == pids
            r = call(old, GET_BROKER_CONFIG)
            assert r.code == SUCCESS, r
            assert properties(r.body).get("brokerName") == cluster.broker_name
            assert call(old, GET_MAX_OFFSET, {"topic": topic, "queueId": 0}).code == SUCCESS
            assert request(endpoint, GET_BROKER_CONFIG).code == SUCCESS  # new connections too

            second = drive("produce", p.namesrv_addr, "4", topic=topic, count=20, mode="sync", timeout=60)
            assert second["sent_count"] == 20
            consumed = finish(consumer, 60)
            runs = {first["run_id"]: 20, second["run_id"]: 20}
            for run, n in runs.items():
                got = sorted(d["idx"] for d in consumed["received"] if d["run"] == run and d["acked"])
                assert got == list(range(n)), (run, got)
            assert consumed["duplicates"] == []
            assert p.proc.poll() is None and p.health()["restarts"] == 0

            # SIGTERM while a consumer is connected (its long-polling pull is in flight)
            lingering = start_driver("consume-push", p.namesrv_addr, "5", topic=topic, expect=1000, timeout_ms=60000)
            try:
                lingering.wait_started(30)
                wait_until(
                    lambda: metric(p.metrics(), "rmqfast_connections_active", role="broker") >= 2,
                    BOUND,
                    "the lingering consumer's broker connection",
                )
                drain = 5.0  # ProxyProcess writes drain_timeout = 5
                t0 = time.monotonic()
                # the lingering consumer would hold the proxy forever: exiting by itself (rc 0, not
                # killed by stop()) within a bound shows drain_timeout cut it; the exact time is slower
                # on a loaded machine
                rc = p.stop(timeout=drain + 60)
                took = time.monotonic() - t0
                assert rc == 0, p.log_tail()
                assert took < drain + 45.0, f"SIGTERM took {took:.1f} s (drain_timeout {drain})"
                print(f"SIGTERM with a lingering consumer took {took:.1f} s (drain_timeout {drain})")
                assert wait_closed(old) == b""
                for wpid in pids:
                    assert not pid_alive(wpid)
                stopped = log_records(p, "worker stopped")
                assert {r["pid"] for r in stopped} == set(pids)
                assert log_records(p, "proxy stopped", exit_code=0)
            finally:
                lingering.kill()
        finally:
            consumer.kill()
            old.close()


# --------------------------------------------------------------------------- 13. codec choice


def test_pure_python_codec(cluster: RocketMQCluster, proxy: ProxyProcess) -> None:
    """RMQFAST_NO_EXTENSIONS=1: the workers run the pure-Python scanner (and say so) and a real
    roundtrip passes; the default proxy runs the compiled one."""
    if FrameScannerC is None:
        pytest.skip("the compiled extension is not built (python setup.py build_ext --inplace)")
    default = {r["pid"]: r["codec"] for r in log_records(proxy, "worker ready")}
    assert len(default) >= 2 and set(default.values()) == {"compiled"}, default
    topic = unique("pycodec")
    with ProxyProcess([cluster.namesrv_addr], env={"RMQFAST_NO_EXTENSIONS": "1"}) as p:
        ready = {r["pid"]: r["codec"] for r in log_records(p, "worker ready")}
        assert set(ready) == set(p.worker_pids()) and set(ready.values()) == {"python"}, ready
        res = drive(
            "roundtrip", p.namesrv_addr, "4", topic=topic, count=20, mode="batch", consumer="litepull", timeout=60
        )
        assert_roundtrip(res, 20)
        wait_metric(p, "rmqfast_topic_messages_total", 20, topic=topic)
        r = request(p.namesrv_addr, GET_ROUTEINFO_BY_TOPIC, {"topic": topic}, version=0)
        assert r.code == SUCCESS and cluster.broker_addr.encode() not in r.body


# --------------------------------------------------------------------------- supervisor race


RESTARTS = 30


def test_healthz_answers_while_workers_restart(cluster: RocketMQCluster) -> None:
    """/healthz, /readyz and /metrics keep answering while workers die and are restarted.

    Regression: the admin HTTP thread used to iterate ``sup.state.workers.values()`` while the
    main loop replaced a restarted worker's entry ("dictionary changed size during iteration").
    """
    with ProxyProcess([cluster.namesrv_addr]) as p:
        errors: list[str] = []
        answered: dict[str, int] = {}
        stop = threading.Event()

        def hammer(path: str) -> None:
            while not stop.is_set():
                try:
                    # slow answers are fine on a loaded machine; a failure or an error page is the finding
                    code, body = p.get(path, timeout=60)
                    assert code == 200 or (path == "/readyz" and code == 503), (code, body[:300])
                    if path == "/healthz":
                        json.loads(body)
                    answered[path] = answered.get(path, 0) + 1
                except Exception as e:  # noqa: BLE001 - every failure is the finding
                    errors.append(f"{path}: {e!r}")

        threads = [
            threading.Thread(target=hammer, args=(path,), daemon=True)
            for path in ("/healthz",) * 6 + ("/readyz", "/metrics")
        ]
        for t in threads:
            t.start()
        try:
            for i in range(RESTARTS):
                pids = p.worker_pids()
                victim = pids[i % 2]
                os.kill(victim, signal.SIGKILL)
                wait_until(
                    lambda victim=victim: (
                        (now := p.worker_pids())
                        and len(now) == 2
                        and victim not in now
                        and all(pid_alive(x) for x in now)
                    ),
                    RESTART_BOUND,
                    f"restart #{i + 1}",
                    interval=0.02,
                )
        finally:
            stop.set()
            for t in threads:
                t.join(10)
        log = p.log_path.read_text(errors="replace")
        assert "dictionary changed size during iteration" not in log, log[log.find("Traceback") :][:1500]
        assert errors == [], f"{len(errors)} admin requests failed: {errors[:3]}"
        assert answered.get("/healthz", 0) > 20 and answered.get("/metrics", 0) > 0
        assert p.health()["restarts"] == RESTARTS
