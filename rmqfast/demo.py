"""``rmqfast demo``: a local RocketMQ, rmqfast in front, real traffic through it, a report.

Everything is real: the RocketMQ 5.3.3 name server and broker are Maven Central jars started
with ``java`` on loopback ports; the traffic comes from Apache's Java client; the figures at
the end are scraped from rmqfast's Prometheus endpoint over HTTP.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rmqfast.testing import RocketMQCluster, ensure_jars
from rmqfast.testing.javaclient import run_driver
from rmqfast.testing.proxy import ProxyProcess


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def _metric_sum(metrics: dict, name: str, **labels: str) -> float:
    total = 0.0
    for (n, lbls), v in metrics.items():
        if n == name and all(dict(lbls).get(k) == val for k, val in labels.items()):
            total += v
    return total


def _n(value: object) -> object:
    """The driver reports some figures as lists of items; show how many."""
    return len(value) if isinstance(value, list | dict) else value


def _spark_report(records_dir: Path) -> bool:
    """The Spark report over the records the demo's proxy wrote (and results/bench if any)."""
    out = Path("results") / "demo-report"
    inputs = [str(records_dir)]
    if Path("results/bench").is_dir():
        inputs.append("results/bench")
    _say(f"Spark (local mode) report from the proxy's traffic records in {records_dir}")
    try:
        from rmqfast.analytics import analyze

        s = analyze(inputs, out, quiet=True)
    except Exception as exc:  # the traffic part of the demo stands on its own
        _say(f"Spark report FAILED: {exc}")
        return False
    c = s["counts"]
    _say(f"Spark report: {c.get('agg_rows', 0)} aggregate rows from {c.get('agg_files', 0)} files, "
         f"{c.get('bench_runs', 0)} benchmark runs, {len(s['problems'])} input problem(s), {s['seconds']} s")
    _say(f"report: {Path(s['report']).resolve()}")
    return True


def run_demo(messages: int = 2000, workers: int = 2, keep_running: bool = False) -> int:
    _say("building/locating the RocketMQ jars (Maven Central; first run downloads ~130 MB)")
    jars = ensure_jars()
    _say("starting RocketMQ 5.3.3 name server + broker on loopback")
    with RocketMQCluster(jars=jars) as cluster:
        _say(f"RocketMQ up: name server {cluster.namesrv_addr}, broker {cluster.broker_addr}")
        records = {"sample_rate": 0.1, "rotate_seconds": 10}
        with ProxyProcess([cluster.namesrv_addr], workers=workers, log_format="human", records=records) as proxy:
            _say(f"rmqfast up: name server proxy {proxy.namesrv_addr}, admin {proxy.admin_url}")
            results = []
            for client, mode, count in (
                ("5", "sync", messages),
                ("5", "batch", messages),
                ("4", "async", messages // 2),
            ):
                topic = f"DemoTopic{client}{mode.capitalize()}"
                _say(f"client {client}.x: {mode} send of {count} messages to {topic}, push consumer, via rmqfast")
                t0 = time.monotonic()
                r = run_driver(
                    "roundtrip",
                    proxy.namesrv_addr,
                    client,
                    topic=topic,
                    group=f"DemoGroup{client}{mode}",
                    count=count,
                    mode=mode,
                    timeout=300,
                    check=False,
                    jars=jars,
                )
                elapsed = time.monotonic() - t0
                results.append((client, mode, count, r, elapsed))
            metrics = proxy.metrics()
            print()
            print("Traffic through rmqfast (real RocketMQ, real Java clients)")
            print(
                f"{'client':<7}{'mode':<7}{'sent':>7}{'received':>10}{'lost':>6}{'dup':>5}{'mismatch':>9}{'seconds':>9}"
            )
            ok = True
            for client, mode, _count, r, elapsed in results:
                received = _n(r.get("consumed", {}).get("distinct", 0))
                print(
                    f"{client + '.x':<7}{mode:<7}{_n(r.get('sent', 0))!s:>7}{received!s:>10}"
                    f"{_n(r.get('lost', '?'))!s:>6}{_n(r.get('duplicates', '?'))!s:>5}"
                    f"{_n(r.get('mismatched', '?'))!s:>9}{elapsed:>9.1f}"
                )
                ok = ok and bool(r.get("ok"))
            print()
            print("Scraped from rmqfast /metrics (all workers):")
            for name, labels, what in (
                ("rmqfast_requests_total", {"role": "broker", "code": "310"}, "SEND_MESSAGE_V2 requests"),
                ("rmqfast_requests_total", {"role": "broker", "code": "320"}, "SEND_BATCH_MESSAGE requests"),
                ("rmqfast_requests_total", {"role": "broker", "code": "11"}, "PULL_MESSAGE requests"),
                ("rmqfast_requests_total", {"role": "broker", "code": "34"}, "heartbeats"),
                ("rmqfast_requests_total", {"role": "namesrv", "code": "105"}, "route queries"),
                ("rmqfast_route_rewrites_total", {}, "route answers rewritten"),
                ("rmqfast_topic_messages_total", {}, "messages sent (batches counted inside)"),
                ("rmqfast_bytes_total", {}, "bytes relayed"),
                ("rmqfast_connections_total", {}, "client connections"),
                ("rmqfast_protocol_errors_total", {}, "protocol errors"),
            ):
                print(f"  {what:<42}{_metric_sum(metrics, name, **labels):>14,.0f}")
            print()
            print("Per topic:")
            for (n, lbls), v in sorted(metrics.items()):
                if n == "rmqfast_topic_messages_total":
                    print(f"  {dict(lbls)['topic']:<30}{v:>10,.0f} messages")
            if keep_running:
                _say(f"still running: point a client at {proxy.namesrv_addr}; Ctrl-C to stop")
                try:
                    while True:
                        time.sleep(3600)
                except KeyboardInterrupt:
                    pass
            proxy.stop()  # workers close (rename) their last record files
            ok = _spark_report(proxy.records_dir) and ok
    _say("everything stopped" + ("" if ok else "; SOME RUNS FAILED (see above)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_demo())
