"""Cross-cloud mode of the bench: durable vs fast copies, side by side, with real clusters.

``rmqfast bench --clouds`` (or ``python -m rmqfast.bench_clouds``) starts two RocketMQ 5.3.3
clusters (cloud A and cloud B) and three rmqfast proxies in front of A: one without
replication, one copying every message of the topic to B in ``fast`` mode, and one in
``durable`` mode (each copy synced to the worker's RocksDB before the producer hears SUCCESS).
The Java driver's ``perf-produce`` (rocketmq-client 5.3.3, synchronous sends, every send timed)
runs against each proxy in turn, alternating, for several rounds.  Printed: msg/s and latency per
target, durable / fast (issue 4's goal: at least 0.8), fast / none, and the durable proxy's
messages per fsync (its group commit).  Results go to ``results/bench/`` as JSON lines.

Everything shares the machine's cores: on 2 cores two brokers, the proxies, their deliver
processes and the producer compete, so absolute numbers are low; the ratios are the point.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from contextlib import ExitStack
from typing import Any

from rmqfast.bench import SCHEMA, BenchError
from rmqfast.bench_real import add_java_run_args, check_java_run_args
from rmqfast.testing import RocketMQCluster, ensure_jars
from rmqfast.testing.javaclient import run_driver
from rmqfast.testing.proxy import ProxyProcess

TOPIC = "RmqfastBenchClouds"
TARGETS = ("none", "fast", "durable")


def _config(mode: str, remote_ns: str) -> str:
    if mode == "none":
        return ""
    return f"""
[clouds]
local = "cloud-a"

[[clouds.remote]]
name = "cloud-b"
namesrv = ["{remote_ns}"]

[replicate]
durability = "{mode}"

[[replicate.topic]]
name = "{TOPIC}"
replicate = "always"
"""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="rmqfast bench --clouds",
        description="Durable vs fast cross-cloud copies (and no copies), two real RocketMQ clusters, Java producer.",
    )
    ap.add_argument("--clouds", action="store_true", help=argparse.SUPPRESS)  # how `rmqfast bench` got here
    add_java_run_args(ap, short_s=4.0)
    args = ap.parse_args(argv)
    check_java_run_args(ap, args, short_s=4.0)
    return args


def _fsync_figures(proxy: ProxyProcess) -> tuple[float, float]:
    m = proxy.metrics()
    fsyncs = sum(v for (n, _), v in m.items() if n == "rmqfast_spill_fsyncs_total")
    synced = sum(v for (n, _), v in m.items() if n == "rmqfast_spill_synced_messages_total")
    return fsyncs, synced


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        return _run(args)
    except BenchError as exc:
        print(f"bench --clouds: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    jars = ensure_jars()
    run_id = f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}-clouds"
    args.results.mkdir(parents=True, exist_ok=True)
    out_path = args.results / f"bench-{run_id}.jsonl"
    common: dict[str, Any] = {"schema": SCHEMA, "run_id": run_id, "mode": "clouds"}
    runs: list[dict[str, Any]] = []
    failed = 0
    print(f"bench --clouds: starting two RocketMQ clusters and three proxies; results -> {out_path}",
          file=sys.stderr, flush=True)
    with ExitStack() as stack:
        a = stack.enter_context(RocketMQCluster(jars=jars, cluster_name="CloudA", broker_name="broker-a",
                                                broker_heap_mb=512))
        b = stack.enter_context(RocketMQCluster(jars=jars, cluster_name="CloudB", broker_name="broker-b",
                                                broker_heap_mb=512))
        for c in (a, b):
            c.create_topic(TOPIC, queues=8)
        proxies = {t: stack.enter_context(ProxyProcess([a.namesrv_addr], workers=args.workers,
                                                       extra_config=_config(t, b.namesrv_addr)))
                   for t in TARGETS}
        out = stack.enter_context(open(out_path, "a"))
        for rnd in range(args.rounds):
            order = TARGETS[rnd % 3:] + TARGETS[: rnd % 3]
            for target in order:
                f0 = _fsync_figures(proxies[target])
                res = run_driver(
                    "perf-produce", proxies[target].namesrv_addr, "5",
                    topic=TOPIC, threads=args.threads, body_size=args.body_size,
                    warmup_ms=int(args.warmup * 1000), duration_ms=int(args.duration * 1000),
                    timeout=args.warmup + args.duration + 120, check=False, heap_mb=512, allow_failures=True,
                )
                time.sleep(1.2)  # one metrics publish period
                f1 = _fsync_figures(proxies[target])
                fsyncs, synced = f1[0] - f0[0], f1[1] - f0[1]
                rec = {
                    **common, "ts": dt.datetime.now(dt.UTC).isoformat(), "kind": "run", "round": rnd,
                    "scenario": f"java-sync-{args.threads}t-copies", "target": target,
                    "params": {"threads": args.threads, "body_size": args.body_size, "duration_s": args.duration},
                    "loadgen": {"rps": res.get("msg_per_s", 0.0), "responses": res.get("sent_count", 0),
                                "errors": res.get("failed_count", 0), "lat_us": res.get("lat_us", {})},
                    "fsyncs": fsyncs, "synced_messages": synced,
                }
                if not res.get("ok") or not res.get("sent_count"):
                    failed += 1
                    rec["error"] = res.get("error") or f"exit {res.get('exit_code')}"
                runs.append(rec)
                out.write(json.dumps(rec) + "\n")
                out.flush()
                per = f"  {synced / fsyncs:.1f} msg/fsync" if fsyncs else ""
                print(f"  round {rnd + 1}/{args.rounds}  {target:<8} {rec['loadgen']['rps']:>8,.0f} msg/s  "
                      f"p50 {rec['loadgen']['lat_us'].get('p50', 0) / 1000:6.2f} ms  "
                      f"failed {rec['loadgen']['errors']}{per}", file=sys.stderr, flush=True)
        delivered_note = ""
        try:
            from rmqfast.testing.cluster import remoting_request

            stored = 0
            for q in range(8):
                r = remoting_request(b.broker_addr, 30, {"topic": TOPIC, "queueId": q})  # GET_MAX_OFFSET
                stored += int(r.ext_fields.get("offset", 0)) if r.code == 0 else 0
            delivered_note = f"cloud B holds {stored:,} copies of {TOPIC}"
        except Exception as exc:  # informational only
            delivered_note = f"could not count the copies in cloud B: {exc}"
    rows = []
    for t in TARGETS:
        rs = [r for r in runs if r["target"] == t and r["loadgen"]["responses"]]
        if rs:
            rows.append({"scenario": rs[0]["scenario"], "target": t,
                         "rps": statistics.median(r["loadgen"]["rps"] for r in rs),
                         "p50_us": statistics.median(r["loadgen"]["lat_us"].get("p50", 0) for r in rs),
                         "p99_us": statistics.median(r["loadgen"]["lat_us"].get("p99", 0) for r in rs),
                         "rounds_rps": [r["loadgen"]["rps"] for r in rs],
                         "fsyncs": sum(r["fsyncs"] for r in rs), "synced": sum(r["synced_messages"] for r in rs)})
    with open(out_path, "a") as f:
        for row in rows:
            f.write(json.dumps({**common, "kind": "summary", **row}) + "\n")
    print()
    print(f"cross-cloud copies, Java client 5.3.3, {args.threads} threads of sync {args.body_size} B sends, "
          f"{args.workers} workers per proxy; {args.rounds} round(s) of {args.duration:g} s; medians")
    for r in rows:
        per = f"   {r['synced'] / r['fsyncs']:.1f} messages per fsync" if r["fsyncs"] else ""
        rounds = ", ".join(f"{x:,.0f}" for x in r["rounds_rps"])
        print(f"  {r['target']:<8} {r['rps']:>9,.0f} msg/s  p50 {r['p50_us'] / 1000:6.2f} ms  "
              f"p99 {r['p99_us'] / 1000:7.2f} ms  rounds {rounds}{per}")
    by = {r["target"]: r for r in rows}
    if "durable" in by and "fast" in by and by["fast"]["rps"]:
        ratio = by["durable"]["rps"] / by["fast"]["rps"]
        print(f"\ndurable / fast: {ratio:.3f} (goal >= 0.8: {'met' if ratio >= 0.8 else 'MISSED'})")
    if "fast" in by and "none" in by and by["none"]["rps"]:
        print(f"fast / no copies: {by['fast']['rps'] / by['none']['rps']:.3f}")
    print(delivered_note)
    print(f"results: {out_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
