"""Sends survive a broker's death and a worker's planned restart (real RocketMQ 5.3.3 brokers, real
Java 5.3.3 and 4.9.4 producers with default retry settings).

* Hung, then killed broker: two masters of one name server hold the topic (started once for the
  module); producers send continuously through rmqfast and straight to the name server, in the
  same run; ``SIGSTOP`` of broker-a, ``SIGCONT``, then ``kill -9`` and a restart; then every
  message is read back from both brokers.  Through rmqfast: no acknowledged send lost and no
  failed send while the broker was away (a producer's very first send, at JVM start on a loaded
  machine, times out now and then on either path: outside the fault windows).  The direct figures
  are printed beside them (the comparison), not asserted.
* Planned worker restart: SIGTERM to each worker in turn while producers send through rmqfast;
  5.3.2+ clients get GO_AWAY and reconnect: no failed send.
* Raw sends to a killed master's endpoint: a plain send is moved, ordered sends are not; moved
  sends take send-limit tokens and a delayed one is held by the proxy, then released to the live master.

Phases are paced by the producers' acknowledged sends and by what the proxy has seen, each bounded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from itutil import BOUND, metric, request, wait_until

from rmqfast.bench.failover import TOPIC, Producer, read_topic, render, run_scenario, two_masters
from rmqfast.codec import codes as C
from rmqfast.codec.route import parse_route
from rmqfast.testing import JarPaths, RocketMQCluster, ensure_jars
from rmqfast.testing.proxy import ProxyProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def jars4(jars: JarPaths) -> JarPaths:
    return ensure_jars(jars.java_dir, rocketmq4=True)


@pytest.fixture(scope="module")
def pair(jars4: JarPaths) -> Iterator[tuple[RocketMQCluster, RocketMQCluster]]:
    """One name server, broker-a and broker-b holding the bench topic (shared by this module's tests)."""
    with contextlib.ExitStack() as stack:
        yield two_masters(jars4, stack)


def test_hung_then_killed_broker_through_rmqfast_and_direct(
        jars4: JarPaths, pair: tuple[RocketMQCluster, RocketMQCluster], capsys: pytest.CaptureFixture[str]) -> None:
    """SIGSTOP then SIGCONT, then kill -9 and a restart of broker-a, under the same four producers.
    A hung broker keeps its connections and stays in the name server's routes: rmqfast sees it dead
    (probes and relayed sends unanswered), cuts its connections (answering what was in flight) and
    moves sends.  Each fault lasts until every rmqfast producer has 30 acknowledged sends without
    broker-a (direct ones 5: a direct producer gets about one send a second through a hung broker's
    route) and rmqfast has seen broker-a dead."""
    res = run_scenario(jars=jars4, pair=pair, clients=("5", "4"), fault=("stop", "kill"), before=20, during=30,
                       during_direct=5, after=20, down_min=0.0, interval_ms=5, phase_timeout=BOUND * 2,
                       resend="all")
    with capsys.disabled():
        print("\n" + render(res))
    rows = {r["producer"]: r for r in res["rows"]}
    assert set(rows) == {"rmqfast/5", "rmqfast/4", "direct/5", "direct/4"}
    for name, r in rows.items():
        assert r["lost"] == 0, (name, r)  # no acknowledged send missing from the brokers, either path
    for name in ("rmqfast/5", "rmqfast/4"):
        for w in rows[name]["windows"]:  # from SIGSTOP to SIGCONT, from the kill to the restart
            assert w["acknowledged"] >= 30 and w["success_ratio"] >= 0.999, (name, w)
    assert res["proxy_metrics"]["rmqfast_broker_down_total"] >= 2, res["proxy_metrics"]


def _pids_changed(proxy: ProxyProcess, old: int) -> bool:
    try:
        pids = proxy.worker_pids()
    except OSError:
        return False
    return old not in pids and len(pids) == proxy.workers


def test_planned_worker_restart_go_away(jars4: JarPaths, cluster: RocketMQCluster) -> None:
    cluster.create_topic(TOPIC, 4)
    work = Path(tempfile.mkdtemp(prefix="rmqfast-goaway-"))
    with ProxyProcess([cluster.namesrv_addr], workers=2) as proxy:
        producers = [Producer(f"rmqfast/{c}", c, proxy.namesrv_addr, f"ga{c}x{os.getpid()}", work / f"ga{c}.out",
                              work / f"ga{c}.stop") for c in ("5", "4")]
        try:
            for p in producers:
                p.start(jars4, work, 5)

            def progress(n: int) -> bool:
                for p in producers:
                    p.poll()
                    assert p.proc is not None and p.proc.poll() is None, f"{p.name} exited"
                return all(len(p.ok) >= n for p in producers)

            wait_until(lambda: progress(30), BOUND, "30 acknowledged sends per producer")
            # from the first restart on (a producer's very first sends, at JVM start on a loaded machine,
            # time out now and then on any path: not what this test is about)
            restarts_ms = int(time.time() * 1000)
            for pid in proxy.worker_pids():
                os.kill(pid, signal.SIGTERM)  # a planned restart: drain, exit 0, the supervisor starts another
                wait_until(lambda pid=pid: _pids_changed(proxy, pid), BOUND, f"worker {pid} replaced")
                proxy.wait_ready(BOUND)  # the new worker listens: the next restart leaves someone serving
                marks = [len(p.ok) for p in producers]
                wait_until(lambda marks=marks: progress(0) and all(len(p.ok) >= m + 30
                                                                   for p, m in zip(producers, marks, strict=True)),
                           BOUND, "30 more acknowledged sends per producer")
            for p in producers:
                p.stop()
            m = proxy.metrics()
        finally:
            for p in producers:
                p.kill()
    seen = read_topic([cluster.broker_addr])
    failed = {p.name: [f for f in p.failed if f[1] >= restarts_ms][:3] for p in producers}
    failed = {name: f for name, f in failed.items() if f}
    print(f"\nplanned restarts: go_away answers {metric(m, 'rmqfast_go_away_total', role='broker')}, "
          + ", ".join(f"{p.name}: {len(p.ok)} acked, {len(p.failed)} failed" for p in producers))
    for p in producers:
        assert all(seen[f"{p.run}|{i}"] >= 1 for i, _, _ in p.ok), p.name  # nothing acknowledged is lost
    assert "rmqfast/5" not in failed, failed  # 5.3.3 reconnects on GO_AWAY: no failed send
    assert sum(v for (n, _), v in m.items() if n == "rmqfast_go_away_total") >= 1, "no GO_AWAY was answered"


def test_moved_send_stored_on_the_live_master_and_ordered_send_refused(
        pair: tuple[RocketMQCluster, RocketMQCluster]) -> None:
    """Raw frames to the endpoint of a killed master: a plain send is stored by the other real
    broker (its broker name and queue id rewritten, properties kept) and answered with its result;
    a send carrying __SHARDINGKEY and a send to a topic in failover.ordered_topics get
    SERVICE_NOT_AVAILABLE and are stored nowhere.  [limits] and [delay] apply to moved sends: of two
    sends to a topic with a burst of 1 the second gets SYSTEM_BUSY; a send asking for a delivery time
    in 2 s is held by the proxy (queueOffset -1) and released to the live master at its time."""
    topic, ordered, limited, delayed = "FoMoved", "FoOrdered", "FoLimited", "FoDelayed"
    a, b = pair
    for t in (topic, ordered, limited, delayed):
        a.create_topic(t, 4)
        b.create_topic(t, 2)
    cfg = ('[failover]\nprobe_interval = 0.5\nprobe_interval_down = 0.1\nordered_topics = ["FoOrd*"]\n'
           f'[delay]\ntopics = ["{delayed}"]\n[[limits.rule]]\ntopic = "{limited}"\nrate = 0.01\nburst = 1\n')
    with ProxyProcess([a.namesrv_addr], workers=1, extra_config=cfg) as proxy:
        def endpoints() -> dict[str, str]:
            r = request(proxy.namesrv_addr, C.GET_ROUTEINFO_BY_TOPIC, {"topic": topic})
            assert r.code == C.SUCCESS, r
            route, _ = parse_route(r.body)
            found = {bd["brokerName"]: bd["brokerAddrs"][0] for bd in route["brokerDatas"]}
            return found if len(found) == 2 else {}

        eps = wait_until(endpoints, BOUND, "both brokers in the route")
        a.stop_broker()  # kill -9
        wait_until(lambda: metric(proxy.metrics(), "rmqfast_broker_up", broker=a.broker_addr) == 0
                   and metric(proxy.metrics(), "rmqfast_broker_down_total", broker=a.broker_addr) >= 1,
                   BOUND, "the proxy sees broker-a dead")

        def send(t: str, opaque: int, props: str) -> Any:
            ext = {"a": "PG_fo", "b": t, "c": "TBW102", "d": "4", "e": "3", "f": "0", "g": "1", "h": "0",
                   "i": props, "j": "0", "k": "false", "l": "16", "m": "false", "n": "broker-a"}
            return request(eps["broker-a"], C.SEND_MESSAGE_V2, ext, body=f"fo|moved|{opaque}|".encode())

        r = send(topic, 1, "UNIQ_KEY\u0001fo-1\u0002p\u0001v\u0002")
        assert r.code == C.SUCCESS, (r.code, r.remark)
        assert r.ext_fields["queueId"] == "1", r.ext_fields  # 3 mod broker-b's 2 write queues
        r2 = send(topic, 2, "__SHARDINGKEY\u0001k\u0002UNIQ_KEY\u0001fo-2\u0002")
        assert r2.code == 14 and "__SHARDINGKEY" in (r2.remark or ""), (r2.code, r2.remark)
        r3 = send(ordered, 3, "UNIQ_KEY\u0001fo-3\u0002")
        assert r3.code == 14 and "ordered_topics" in (r3.remark or ""), (r3.code, r3.remark)
        r4, r5 = send(limited, 4, "UNIQ_KEY\u0001fo-4\u0002"), send(limited, 5, "UNIQ_KEY\u0001fo-5\u0002")
        assert r4.code == C.SUCCESS and r5.code == C.SYSTEM_BUSY, (r4.code, r5.code, r5.remark)
        due = int(time.time() * 1000) + 2000
        r6 = send(delayed, 6, f"TIMER_DELIVER_MS\u0001{due}\u0002UNIQ_KEY\u0001fo-6\u0002")
        assert r6.code == C.SUCCESS and r6.ext_fields["queueOffset"] == "-1", (r6.code, r6.ext_fields)
        wait_until(lambda: read_topic([b.broker_addr], topic=delayed, queues=2) == {"moved|6": 1}, BOUND,
                   "the held send released to broker-b")
        assert int(time.time() * 1000) >= due
        m = proxy.metrics()
    assert metric(m, "rmqfast_failovers_total", broker=a.broker_addr, to=b.broker_addr) == 2  # FoMoved, FoLimited
    assert metric(m, "rmqfast_failover_refused_total", reason="ordered") == 2
    assert metric(m, "rmqfast_failover_refused_total", reason="send_limit") == 1
    assert read_topic([b.broker_addr], topic=limited, queues=2) == {"moved|4": 1}
    stored = read_topic([b.broker_addr], topic=topic, queues=2)
    assert stored == {"moved|1": 1}, stored
    assert not read_topic([b.broker_addr], topic=ordered, queues=2)
