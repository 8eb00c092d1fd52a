"""Real-broker mode of the bench: Java clients against a real RocketMQ, direct vs rmqfast vs Apache's proxy.

``rmqfast bench --real`` (or ``python -m rmqfast.bench --real``) starts a RocketMQ 5.3.3 name
server and broker from the Maven Central jars (the same harness as the integration tests), and in
front of that one broker both rmqfast and Apache RocketMQ Proxy 5.3.3 (``rocketmq-proxy``, cluster
mode, its Remoting port; :mod:`rmqfast.testing.apacheproxy`).  Two scenarios run alternately
against the three targets, for several rounds:

* ``produce``: the Java driver's ``perf-produce`` (rocketmq-client 5.3.3, synchronous sends,
  every send's latency recorded);
* ``consume``: the driver's ``consume-push`` (DefaultMQPushConsumer, a new consumer group each
  run, from the first offset) reading a backlog of messages stored beforehand; throughput is
  messages over the time from the first to the last delivery.

Before the rounds every target gets produce runs that are not measured, until its throughput
stops climbing (:func:`_warm_up`): the JVMs (broker, Apache's proxy) must have compiled their hot
paths, or the first rounds measure a JIT warm-up.

Per run it records each proxy's CPU (its processes' user + system time from /proc, over the
whole client run) per request: for ``produce`` the requests are the messages the broker stored in
that time (queue max offsets before and after, asked of the broker itself), for ``consume`` the
messages delivered.  It prints msg/s and latency percentiles per target, their medians, the ratios
to direct and between the proxies, and writes JSON lines beside the null-broker bench.

Here the broker (a JVM writing a commit log) is often the bottleneck, not the proxy: the ratio to
direct says what a user of a real cluster gives up by putting a proxy in front of it; throughput
per proxy core (msg/s over the cores the proxy used) compares the proxies' own cost.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from rmqfast.bench.common import guarded
from rmqfast.bench.javarun import JavaRuns, java_args, rounds_text
from rmqfast.bench.procfs import machine_cpu, total_cpu, wait_idle
from rmqfast.codec.codes import GET_MAX_OFFSET, SUCCESS
from rmqfast.progress import Stages
from rmqfast.testing import RocketMQCluster, ensure_jars, run_driver
from rmqfast.testing.apacheproxy import APACHE_PROXY_VERSION, ApacheProxy
from rmqfast.testing.proxy import ProxyProcess
from rmqfast.testing.remoting import remoting_request

TOPIC = "RmqfastBenchReal"
CONSUME_TOPIC = "RmqfastBenchRealConsume"
QUEUES = 8
TARGETS = ("direct", "rmqfast", "apache-proxy")
PROXIES = ("rmqfast", "apache-proxy")
LABEL = "bench --real"


def main(argv: list[str] | None = None) -> int:
    args = java_args(argv, prog="rmqfast bench --real", flag="--real", short_s=3.0,
                     description="Java clients (rocketmq-client 5.3.3) against a real RocketMQ broker, direct vs "
                     "through rmqfast vs through Apache RocketMQ Proxy, alternating, side by side.")
    return guarded(LABEL, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    # what stage the bench is in and for how long (stderr): a status line every 10 s within a stage
    st = Stages(LABEL, every=10.0, out=sys.stderr)
    with st.stage("building/locating the RocketMQ jars"):
        jars = ensure_jars()
    backlog = 4000 if args.short else 10000
    with JavaRuns(args, "real", "real-broker") as jr, contextlib.ExitStack() as up:
        print(f"{LABEL}: starting RocketMQ, rmqfast and Apache RocketMQ Proxy {APACHE_PROXY_VERSION}; "
              f"results -> {jr.path}", file=sys.stderr, flush=True)
        with st.stage(f"starting RocketMQ, rmqfast and Apache RocketMQ Proxy {APACHE_PROXY_VERSION}"):
            cluster = up.enter_context(RocketMQCluster(jars=jars, broker_heap_mb=1024, fast_start=False))
            proxy = up.enter_context(ProxyProcess([cluster.namesrv_addr], workers=args.workers))
            apx = up.enter_context(ApacheProxy(cluster.namesrv_addr, cluster_name=cluster.cluster_name,
                                               heap_mb=1024, fast_start=False))
        cluster.create_topic(TOPIC, queues=QUEUES)
        cluster.create_topic(CONSUME_TOPIC, queues=QUEUES)
        addrs = {"direct": cluster.namesrv_addr, "rmqfast": proxy.namesrv_addr, "apache-proxy": apx.remoting_addr}
        pids: dict[str, Callable[[], list[int]]] = {
            "direct": lambda: [],
            "rmqfast": lambda: ([proxy.proc.pid] if proxy.proc else []) + proxy.worker_pids(),
            "apache-proxy": lambda: [apx.pid] if apx.pid else [],
        }
        with st.stage(f"storing {backlog:,} messages for the consumer runs"):
            # async sends may time out on a loaded machine: the consumers expect what the broker stored
            run_driver("produce", cluster.namesrv_addr, "5", topic=CONSUME_TOPIC, count=backlog, mode="async",
                       body_size=args.body_size, max_body_print=0, timeout=600, heap_mb=512, check=False,
                       allow_failures=True)
        consume_count = _stored(cluster, CONSUME_TOPIC)
        if consume_count < backlog // 2:
            raise RuntimeError(f"the broker stored {consume_count} of {backlog} messages for the consumer runs")
        with st.stage("warm-up produce runs (until each target's throughput stops climbing)"):
            _warm_up(jr, addrs)
        consumes: list[dict[str, Any]] = []
        for rnd in range(args.rounds):
            for i, target in enumerate(_order(rnd)):
                all_pids = [p for f in pids.values() for p in f()]
                with st.stage(f"round {rnd + 1}/{args.rounds} {target}: produce, then consume"):
                    wait_idle(all_pids)
                    _produce_run(jr, cluster, rnd, target, addrs[target], pids[target]())
                    wait_idle(all_pids)
                    _consume_run(jr, consumes, rnd, target, addrs[target], pids[target](), consume_count, i)
        summary = jr.summary(TARGETS, cpu_s="proxy_cpu_s", requests="proxy_requests")
        summary = [{**r, **_consume_summary(consumes, r["target"])} for r in summary]
    print()
    print(render(summary, args, consume_count))
    print(f"\nresults: {jr.path}")
    if jr.failed:
        print(f"{LABEL}: {jr.failed} run(s) failed (see the results file)", file=sys.stderr)
        return 1
    return 0


WARM_RUNS = (2, 5)
"""Warm-up produce runs per target before the measured rounds: at least 2, at most 5."""
WARM_STABLE = 0.15
"""Warm-up ends once a run's msg/s is within this fraction of the run before it."""


def _warm_up(jr: JavaRuns, addrs: dict[str, str]) -> None:
    """Produce runs, not measured, against each target until its throughput stops climbing.

    The JVMs' hot paths have to be compiled first: a fresh Apache proxy runs its send path
    interpreted or C1-compiled, and on a loaded machine its C2 compile takes tens of seconds of
    wall time, so its first runs measured its JIT warm-up (at ~130-650 msg/s its first runs
    do not even make the tier-4 invocation counts), not its steady state.  The broker is warmed
    by storing the consumer backlog, rmqfast needs no JIT; every target gets the same warm-up so
    no target's first measured run is colder than another's.
    """
    a = jr.args
    for target in TARGETS:
        prev = 0.0
        for i in range(WARM_RUNS[1]):
            res = run_driver("perf-produce", addrs[target], "5", topic=TOPIC, threads=a.threads,
                             body_size=a.body_size, warmup_ms=1000, duration_ms=int(a.duration * 1000),
                             timeout=a.duration + 90, check=False, heap_mb=512, allow_failures=True)
            rps = float(res.get("msg_per_s") or 0.0)
            jr.write({**jr.common, "kind": "warmup", "target": target, "run": i, "rps": rps,
                      "lat_us": res.get("lat_us", {}), "driver_ok": bool(res.get("ok"))})
            print(f"  warm-up {i + 1}  {target:<12} produce {rps:>9,.0f} msg/s", file=sys.stderr, flush=True)
            if i + 1 >= WARM_RUNS[0] and prev and abs(rps - prev) <= WARM_STABLE * prev:
                break
            prev = rps


def _order(rnd: int) -> tuple[str, ...]:
    """The targets rotate from round to round, so no target always runs first (cold) or last."""
    k = rnd % len(TARGETS)
    return TARGETS[k:] + TARGETS[:k]


def _stored(cluster: RocketMQCluster, topic: str) -> int:
    """Messages the broker holds in ``topic``: the sum of its queues' max offsets, asked of the broker."""
    total = 0
    for q in range(QUEUES):
        r = remoting_request(cluster.broker_addr, GET_MAX_OFFSET, {"topic": topic, "queueId": q}, timeout=15.0)
        if r.code != SUCCESS:
            raise RuntimeError(f"GET_MAX_OFFSET {topic}/{q}: {r.code} {r.remark}")
        total += int(r.ext_fields.get("offset", 0))
    return total


def _produce_run(jr: JavaRuns, cluster: RocketMQCluster, rnd: int, target: str, addr: str, pids: list[int]) -> None:
    before_cpu, before_machine, before_stored = total_cpu(pids), machine_cpu(), _stored(cluster, TOPIC)
    t0 = time.monotonic()
    res = jr.produce(addr, TOPIC, grace=90)
    wall = time.monotonic() - t0
    stored = _stored(cluster, TOPIC) - before_stored
    cpu = sum(total_cpu(pids)) - sum(before_cpu)
    busy = round((machine_cpu()["task"] - before_machine["task"]) / wall, 2) if wall else None
    extra = _cpu_fields(target, cpu, stored, wall)
    jr.record(rnd, f"java-sync-{jr.args.threads}t", target, res, machine_busy_cores=busy, **extra,
              note=_cpu_note(extra))


def _consume_run(jr: JavaRuns, consumes: list[dict[str, Any]], rnd: int, target: str, addr: str, pids: list[int],
                 count: int, i: int) -> None:
    before_cpu = total_cpu(pids)
    t0 = time.monotonic()
    group = f"rmqfast_bench_real_{target.replace('-', '_')}_{rnd}_{i}_{uuid.uuid4().hex[:6]}"
    res = run_driver("consume-push", addr, "5", topic=CONSUME_TOPIC, expect=count, group=group,
                     **{"from": "CONSUME_FROM_FIRST_OFFSET"}, consume_threads=16, pull_batch_size=32,
                     max_body_print=0, timeout_ms=300_000, timeout=400, check=False, heap_mb=512,
                     api_timeout_ms=15_000)  # the client's 3 s default fails consumer starts on a loaded machine
    wall = time.monotonic() - t0
    cpu = sum(total_cpu(pids)) - sum(before_cpu)
    recv = sorted(m["recv_ms"] for m in res.get("received", []) if "recv_ms" in m)
    got = int(res.get("distinct", 0))
    span_s = (recv[-1] - recv[0]) / 1000 if len(recv) > 1 else 0.0
    rec = {**jr.common, "kind": "consume", "round": rnd, "target": target, "group": group, "expected": count,
           "distinct": got, "deliveries": res.get("deliveries", 0), "span_s": round(span_s, 3),
           "msg_per_s": round(got / span_s, 1) if span_s > 0 else 0.0, "driver_ok": bool(res.get("ok")),
           **_cpu_fields(target, cpu, got, wall)}
    if not res.get("ok") or got < count:
        jr.failed += 1
        rec["error"] = res.get("error") or f"exit {res.get('exit_code')}, {got} of {count} consumed"
    consumes.append(rec)
    jr.write(rec)
    print(f"  round {rnd + 1}/{jr.args.rounds}  {target:<12} consume {rec['msg_per_s']:>9,.0f} msg/s  "
          f"{got:,} of {count:,} in {span_s:.2f} s{_cpu_note(rec)}", file=sys.stderr, flush=True)


def _cpu_fields(target: str, cpu_s: float, requests: int, wall: float) -> dict[str, Any]:
    if target not in PROXIES:
        return {"proxy_cpu_s": 0.0, "proxy_requests": requests}
    return {"proxy_cpu_s": round(cpu_s, 3), "proxy_requests": requests, "proxy_cores": round(cpu_s / wall, 3),
            "proxy_cpu_us_per_req": round(cpu_s * 1e6 / requests, 1) if requests else None}


def _cpu_note(rec: dict[str, Any]) -> str:
    us = rec.get("proxy_cpu_us_per_req")
    return f"  proxy CPU {us:,.0f} us/msg ({rec['proxy_cores']:.2f} cores)" if us is not None else ""


def _consume_summary(runs: list[dict[str, Any]], target: str) -> dict[str, Any]:
    rs = [r for r in runs if r.get("kind") == "consume" and r["target"] == target and r["msg_per_s"]]
    if not rs:
        return {}
    return {"consume_rps": statistics.median(r["msg_per_s"] for r in rs),
            "consume_rounds_rps": [r["msg_per_s"] for r in rs],
            "consume_cpu_s": sum(r["proxy_cpu_s"] for r in rs),
            "consume_requests": sum(r["proxy_requests"] for r in rs)}


def _us_per_req(row: dict[str, Any], prefix: str = "") -> float | None:
    cpu, n = row.get(f"{prefix}cpu_s"), row.get(f"{prefix}requests")
    return cpu * 1e6 / n if cpu and n else None


def render(rows: list[dict[str, Any]], args: argparse.Namespace, consume_count: int) -> str:
    lines = [f"real broker (RocketMQ 5.3.3, one broker), Java client 5.3.3, {args.body_size} B bodies; "
             f"{args.rounds} round(s); medians; Apache RocketMQ Proxy {APACHE_PROXY_VERSION} in cluster mode "
             "(Remoting port); proxy CPU = its processes' CPU time over the whole client run", "",
             f"produce: {args.threads} threads of sync sends, {args.duration:g} s measured after {args.warmup:g} s"]
    head = (f"{'target':<13} {'msg/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'p99.9 ms':>9} {'failed':>7} "
            f"{'CPU us/msg':>11}  rounds (msg/s)")
    lines += [head, "-" * len(head)]
    for r in rows:
        us = _us_per_req(r)
        lines.append(f"{r['target']:<13} {r['rps']:>9,.0f} {r['p50_us'] / 1000:>8.2f} {r['p99_us'] / 1000:>8.2f} "
                     f"{r['p999_us'] / 1000:>9.2f} {r['errors']:>7} {_fmt(us):>11}  {rounds_text(r)}")
    lines += ["", f"consume: push consumer, a backlog of {consume_count:,} messages from the first offset, "
              "16 consume threads"]
    head = f"{'target':<13} {'msg/s':>9} {'CPU us/msg':>11}  rounds (msg/s)"
    lines += [head, "-" * len(head)]
    for r in rows:
        if "consume_rps" in r:
            lines.append(f"{r['target']:<13} {r['consume_rps']:>9,.0f} {_fmt(_us_per_req(r, 'consume_')):>11}  "
                         + ", ".join(f"{x:,.0f}" for x in r["consume_rounds_rps"]))
    lines += [""] + ratios(rows)
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def ratios(rows: list[dict[str, Any]]) -> list[str]:
    """The summary's ratio lines: each proxy over direct, rmqfast over Apache's proxy."""
    by = {r["target"]: r for r in rows}
    out = []
    d = by.get("direct")
    for name in PROXIES:
        p = by.get(name)
        if d and p and d["rps"]:
            out.append(f"{name} / direct: {p['rps'] / d['rps']:.3f} (produce throughput); added latency p50 "
                       f"{(p['p50_us'] - d['p50_us']) / 1000:+.2f} ms, p99 {(p['p99_us'] - d['p99_us']) / 1000:+.2f} ms"
                       + (f"; consume {p['consume_rps'] / d['consume_rps']:.3f}"
                          if p.get("consume_rps") and d.get("consume_rps") else ""))
    r, a = by.get("rmqfast"), by.get("apache-proxy")
    if r and a and a["rps"]:
        out.append(f"rmqfast / apache-proxy: produce throughput {r['rps'] / a['rps']:.3f}, "
                   f"added p99 {(r['p99_us'] - a['p99_us']) / 1000:+.2f} ms vs Apache's")
        for prefix, what in (("", "produce"), ("consume_", "consume")):
            ur, ua = _us_per_req(r, prefix), _us_per_req(a, prefix)
            if ur and ua:
                out.append(f"rmqfast / apache-proxy: {what} throughput per proxy core {ua / ur:.2f} x "
                           f"(CPU per message {ur:,.0f} us vs {ua:,.0f} us)")
    return out
