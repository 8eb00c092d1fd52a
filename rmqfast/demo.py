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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rmqfast.codec import codes
from rmqfast.progress import Stages
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
    _say(f"Spark report over {', '.join(inputs)} (a status line every 5 s while a step runs)")
    try:
        from rmqfast.analytics import analyze

        s = analyze(inputs, out, quiet=True, progress=Stages("demo: spark", every=5.0))
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


def print_metrics(metrics: dict, summary: dict[str, Any] | None = None) -> bool:
    """The scraped figures; the route figures beside the report's (``summary``); True: they add up."""
    print()
    print("Scraped from rmqfast /metrics (all workers), in one scrape after the traffic stopped and every")
    print("worker had published its counters twice since (so every number below is of the same moment):")
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
    ok = print_route_counts(route_counts(metrics), report_route_counts(summary))
    results = route_results(metrics)
    if results:
        print("  The same queries by result (the result label of rmqfast_requests_total): "
              + ", ".join(f"{r} {n:,.0f}" for r, n in sorted(results.items())))
    print()
    print("Per topic:")
    for (n, lbls), v in sorted(metrics.items()):
        if n == "rmqfast_topic_messages_total":
            print(f"  {dict(lbls)['topic']:<30}{v:>10,.0f} messages")
    return ok


#: The route figures: (what, counter and labels in /metrics, the report table and row it is checked against)
ROUTE_COUNTERS = (
    ("route queries", "rmqfast_requests_total", {"role": "namesrv", "code": str(codes.GET_ROUTEINFO_BY_TOPIC)},
     ("agg_requests_by_code", "namesrv", codes.GET_ROUTEINFO_BY_TOPIC)),
    ("rewritten (brokers -> rmqfast endpoints)", "rmqfast_route_rewrites_total",
     {"code": str(codes.GET_ROUTEINFO_BY_TOPIC)}, None),
    ("answered TOPIC_NOT_EXIST (17), unchanged", "rmqfast_responses_total",
     {"role": "namesrv", "code": str(codes.TOPIC_NOT_EXIST)},
     ("agg_responses_by_code", "namesrv", codes.TOPIC_NOT_EXIST)),
)


def route_counts(metrics: dict) -> dict[str, float]:
    """The route figures of one scrape, by their ROUTE_COUNTERS name."""
    return {what: _metric_sum(metrics, name, **labels) for what, name, labels, _ in ROUTE_COUNTERS}


def route_results(metrics: dict) -> dict[str, float]:
    """Route queries by the result label of rmqfast_requests_total (what the other answers were)."""
    out: dict[str, float] = {}
    for (n, lbls), v in metrics.items():
        d = dict(lbls)
        if n == "rmqfast_requests_total" and d.get("role") == "namesrv" and \
                d.get("code") == str(codes.GET_ROUTEINFO_BY_TOPIC) and v:
            out[d.get("result", "?")] = out.get(d.get("result", "?"), 0.0) + v
    return out


def report_route_counts(summary: dict[str, Any] | None) -> dict[str, float]:
    """The same figures from the Spark report's tables (those it has), by ROUTE_COUNTERS name."""
    if summary is None:
        return {}
    tables = Path(summary["report"]).parent / "tables"
    out: dict[str, float] = {}
    for what, _, _, where in ROUTE_COUNTERS:
        if where is None:
            continue
        table, role, code = where
        try:
            with open(tables / f"{table}.csv", newline="", encoding="utf-8") as f:
                out[what] = sum(float(r["count"]) for r in csv.DictReader(f)
                                if r["role"] == role and r["code"] and int(float(r["code"])) == code)
        except (OSError, KeyError, ValueError) as exc:
            _say(f"report figure unavailable: {tables / table}.csv: {exc}")
    return out


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def print_route_counts(counts: dict[str, float], report: dict[str, float]) -> bool:
    """The route figures, each with the counter it comes from and the report's figure; True when
    rewritten + TOPIC_NOT_EXIST + other answers add up to the queries and the report agrees."""
    names = [r[0] for r in ROUTE_COUNTERS]
    queries, rewritten, absent = (counts[n] for n in names)
    other = queries - rewritten - absent
    print()
    print("Route queries (GET_ROUTEINFO_BY_TOPIC 105) to the name server, through rmqfast:")
    print(f"  {'':<42}{'count':>8}   {'report':>7}   from")
    for what, name, labels, _ in ROUTE_COUNTERS:
        rep = f"{report[what]:>7,.0f}" if what in report else f"{'-':>7}"
        print(f"  {what:<42}{counts[what]:>8,.0f}   {rep}   {name}{_labels(labels)}")
    print(f"  {'other answers (not rewritten, not 17)':<42}{other:>8,.0f}   {'-':>7}   "
          "route queries - rewritten - TOPIC_NOT_EXIST")
    agree = all(abs(report[w] - counts[w]) < 0.5 for w in report)
    if report and not agree:
        print("  THE REPORT DISAGREES with the scrape above (it reads the traffic records the workers flushed at stop)")
    elif report:
        print("  The report column is the Spark report's agg_requests_by_code / agg_responses_by_code tables.")
    print("  Fewer rewrites than queries is expected: only an answer that carries a route is rewritten.")
    print("  A client asks for a topic's route before the topic exists (a producer before its first send")
    print("  creates it; a consumer for its group's %RETRY% topic), and the name server answers")
    print("  TOPIC_NOT_EXIST, which rmqfast passes on as it is. These are normal, not errors; the report")
    print("  plots them apart from errors.")
    return other >= 0 and agree


def settled_metrics(scrape: Callable[[], dict], timeout: float = 30.0, poll: float = 0.1) -> dict:
    """One scrape taken once every worker has published its counters twice since the call (the
    traffic has stopped: each publish writes every counter, ``rmqfast_worker_publishes_total``
    last), so the figures read from it are of one moment.  After ``timeout`` the last scrape."""
    first = scrape()
    base = {dict(lbls).get("worker"): v for (n, lbls), v in first.items() if n == "rmqfast_worker_publishes_total"}
    deadline = time.monotonic() + timeout
    while True:
        now = scrape()
        pubs = {dict(lbls).get("worker"): v for (n, lbls), v in now.items() if n == "rmqfast_worker_publishes_total"}
        if base and all(pubs.get(w, 0) >= v + 2 for w, v in base.items()):
            return now
        if time.monotonic() >= deadline:
            _say(f"workers did not publish twice within {timeout:g} s; the figures are of the last scrape")
            return now
        time.sleep(poll)


def run_demo(messages: int = 2000, workers: int = 2, keep_running: bool = False) -> int:
    t_start = time.monotonic()
    st = Stages("demo", total=4)
    with st.stage("building/locating the RocketMQ jars (Maven Central; first run downloads ~130 MB)"):
        jars = ensure_jars()
    # kept after the demo, so that `rmqfast analyze results/demo-records -o DIR` can be re-run
    records_dir = (Path("results") / "demo-records").resolve()
    shutil.rmtree(records_dir, ignore_errors=True)
    # every request recorded (sample_rate 1): exact send latencies; the demo's traffic is small
    records = {"dir": str(records_dir), "sample_rate": 1.0, "rotate_seconds": 10}
    results: list[tuple[str, str, str, dict[str, Any], float]] = []
    with st.stage("RocketMQ 5.3.3 name server + broker, rmqfast in front, real traffic (loopback)"):
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
                # the traffic has stopped: one scrape once every worker published twice since
                metrics = settled_metrics(proxy.metrics)
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
    with st.stage("Spark (local mode) report from the proxy's traffic records", tick=False):  # it ticks itself
        summary = _spark_report(records_dir)  # after RocketMQ stopped: its JVMs no longer compete for the cores
    spark_s = time.monotonic() - t_spark
    with st.stage("figures"):
        ok = print_traffic(results, send_latency(summary))
        counts_ok = print_metrics(metrics, summary)
    ok = ok and summary is not None and counts_ok
    print()
    _say(f"demo took {time.monotonic() - t_start:.0f} s: RocketMQ, rmqfast and traffic {traffic_s:.0f} s, "
         f"Spark step {spark_s:.0f} s")
    _say("everything stopped" + ("" if ok else "; SOME RUNS FAILED OR FIGURES DISAGREE (see above)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_demo())
