"""``rmqfast demo``: a local RocketMQ, rmqfast in front, real traffic through it, a report.

Everything is real: the RocketMQ 5.3.3 name server and broker are Maven Central jars started
with ``java`` on loopback ports; the traffic comes from Apache's Java client; the figures at
the end are scraped from rmqfast's Prometheus endpoint over HTTP, and the send latencies come
from the traffic records the proxy wrote (every request is recorded in the demo), analysed by
the Spark report.
"""

from __future__ import annotations

import csv
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from rmqfast.codec import codes
from rmqfast.testing import RocketMQCluster, ensure_jars
from rmqfast.testing.javaclient import run_driver
from rmqfast.testing.proxy import ProxyProcess

#: Request codes of sends (their latency is what the demo's table shows).


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


def _spark_report(records_dir: Path) -> dict[str, Any] | None:
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
        return None
    c = s["counts"]
    tm = s.get("timings", {})
    _say(f"Spark report: {c.get('agg_rows', 0)} aggregate rows from {c.get('agg_files', 0)} files, "
         f"{c.get('sample_records', 0)} request records, {c.get('bench_runs', 0)} benchmark runs, "
         f"{len(s['problems'])} input problem(s); {s['seconds']} s (JVM start {tm.get('spark_start', '?')} s, "
         f"{s.get('spark_jobs', '?')} Spark jobs {tm.get('spark_jobs', '?')} s, charts {tm.get('charts', '?')} s)")
    _say(f"report: {Path(s['report']).resolve()}")
    return s


def send_latency(summary: dict[str, Any] | None) -> dict[str, dict[str, float]]:
    """{topic: {"p50_us", "p90_us", "p99_us", "records"}} of the send requests in the report's
    latency table (the send code with most records per topic)."""
    if summary is None:
        return {}
    path = Path(summary["report"]).parent / "tables" / "latency_by_code_topic.csv"
    out: dict[str, dict[str, float]] = {}
    try:
        with open(path, newline="", encoding="utf-8") as f:
            for r in csv.DictReader(f):
                if int(r["code"]) not in codes.SEND_CODES or not r.get("p50_us"):
                    continue
                row = {k: float(r[k]) for k in ("p50_us", "p90_us", "p99_us", "records")}
                if row["records"] > out.get(r["topic"], {}).get("records", -1):
                    out[r["topic"]] = row
    except (OSError, KeyError, ValueError) as exc:
        _say(f"send latencies unavailable: {path}: {exc}")
    return out


def _ms(us: float | None) -> str:
    return "-" if us is None else f"{us / 1000:.2f}"


def print_traffic(results: list[tuple[str, str, str, dict[str, Any], float]],
                  latency: dict[str, dict[str, float]]) -> bool:
    print()
    print("Traffic through rmqfast (real RocketMQ, real Java clients)")
    print(f"{'client':<7}{'mode':<7}{'sent':>7}{'received':>10}{'lost':>6}{'dup':>5}{'mismatch':>9}{'seconds':>9}"
          f"   send latency ms: {'p50':>6}{'p90':>7}{'p99':>7}")
    ok = True
    for client, mode, topic, r, elapsed in results:
        received = _n(r.get("consumed", {}).get("distinct", 0))
        lat = latency.get(topic, {})
        print(f"{client + '.x':<7}{mode:<7}{_n(r.get('sent', 0))!s:>7}{received!s:>10}"
              f"{_n(r.get('lost', '?'))!s:>6}{_n(r.get('duplicates', '?'))!s:>5}"
              f"{_n(r.get('mismatched', '?'))!s:>9}{elapsed:>9.1f}"
              f"{'':>21}{_ms(lat.get('p50_us')):>6}{_ms(lat.get('p90_us')):>7}{_ms(lat.get('p99_us')):>7}")
        ok = ok and bool(r.get("ok"))
    if latency:
        print("  send latency: every send request's time at the proxy, from the request passing rmqfast to the")
        print("  broker's answer passing back (so it includes the broker), from the traffic records (Spark report).")
        print("  The batch row's sends carry 10 messages each.")
    else:
        print("  send latency: not available (it comes from the Spark report of the proxy's traffic records)")
    return ok


def print_metrics(metrics: dict) -> None:
    print()
    print("Scraped from rmqfast /metrics (all workers):")
    for name, labels, what in (
        ("rmqfast_requests_total", {"role": "broker", "code": "310"}, "SEND_MESSAGE_V2 requests"),
        ("rmqfast_requests_total", {"role": "broker", "code": "320"}, "SEND_BATCH_MESSAGE requests"),
        ("rmqfast_requests_total", {"role": "broker", "code": "11"}, "PULL_MESSAGE requests"),
        ("rmqfast_requests_total", {"role": "broker", "code": "34"}, "heartbeats"),
        ("rmqfast_topic_messages_total", {}, "messages sent (batches counted inside)"),
        ("rmqfast_bytes_total", {}, "bytes relayed"),
        ("rmqfast_connections_total", {}, "client connections"),
        ("rmqfast_protocol_errors_total", {}, "protocol errors"),
    ):
        print(f"  {what:<42}{_metric_sum(metrics, name, **labels):>14,.0f}")
    queries = _metric_sum(metrics, "rmqfast_requests_total", role="namesrv", code=str(codes.GET_ROUTEINFO_BY_TOPIC))
    rewritten = _metric_sum(metrics, "rmqfast_route_rewrites_total", code=str(codes.GET_ROUTEINFO_BY_TOPIC))
    absent = _metric_sum(metrics, "rmqfast_responses_total", role="namesrv", code=str(codes.TOPIC_NOT_EXIST))
    print()
    print("Route queries (GET_ROUTEINFO_BY_TOPIC 105) to the name server, through rmqfast:")
    print(f"  {'route queries':<42}{queries:>14,.0f}")
    print(f"  {'  rewritten (brokers -> rmqfast endpoints)':<42}{rewritten:>14,.0f}")
    print(f"  {'  answered TOPIC_NOT_EXIST (17), unchanged':<42}{absent:>14,.0f}")
    print("  Fewer rewrites than queries is expected: only an answer that carries a route is rewritten.")
    print("  A client asks for a topic's route before the topic exists (a producer before its first send")
    print("  creates it; a consumer for its group's %RETRY% topic), and the name server answers")
    print("  TOPIC_NOT_EXIST, which rmqfast passes on as it is. These are normal, not errors; the report")
    print("  plots them apart from errors.")
    print()
    print("Per topic:")
    for (n, lbls), v in sorted(metrics.items()):
        if n == "rmqfast_topic_messages_total":
            print(f"  {dict(lbls)['topic']:<30}{v:>10,.0f} messages")


def run_demo(messages: int = 2000, workers: int = 2, keep_running: bool = False) -> int:
    t_start = time.monotonic()
    _say("building/locating the RocketMQ jars (Maven Central; first run downloads ~130 MB)")
    jars = ensure_jars()
    # kept after the demo, so that `rmqfast analyze results/demo-records -o DIR` can be re-run
    records_dir = (Path("results") / "demo-records").resolve()
    shutil.rmtree(records_dir, ignore_errors=True)
    # every request recorded (sample_rate 1): exact send latencies; the demo's traffic is small
    records = {"dir": str(records_dir), "sample_rate": 1.0, "rotate_seconds": 10}
    results: list[tuple[str, str, str, dict[str, Any], float]] = []
    _say("starting RocketMQ 5.3.3 name server + broker on loopback")
    with RocketMQCluster(jars=jars) as cluster:
        _say(f"RocketMQ up: name server {cluster.namesrv_addr}, broker {cluster.broker_addr}")
        with ProxyProcess([cluster.namesrv_addr], workers=workers, log_format="human", records=records) as proxy:
            _say(f"rmqfast up: name server proxy {proxy.namesrv_addr}, admin {proxy.admin_url}")
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
                results.append((client, mode, topic, r, time.monotonic() - t0))
            metrics = proxy.metrics()
            if keep_running:
                _say(f"still running: point a client at {proxy.namesrv_addr}; Ctrl-C to stop")
                try:
                    while True:
                        time.sleep(3600)
                except KeyboardInterrupt:
                    pass
            proxy.stop()  # workers close (rename) their last record files
    _say("RocketMQ and rmqfast stopped")
    traffic_s = time.monotonic() - t_start
    t_spark = time.monotonic()
    summary = _spark_report(records_dir)  # after RocketMQ stopped: its JVMs no longer compete for the cores
    spark_s = time.monotonic() - t_spark
    ok = print_traffic(results, send_latency(summary))
    print_metrics(metrics)
    ok = ok and summary is not None
    print()
    _say(f"demo took {time.monotonic() - t_start:.0f} s: RocketMQ, rmqfast and traffic {traffic_s:.0f} s, "
         f"Spark step {spark_s:.0f} s")
    _say("everything stopped" + ("" if ok else "; SOME RUNS FAILED (see above)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_demo())
