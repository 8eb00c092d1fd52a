"""Real-broker mode of the bench: the Java producer against a real RocketMQ, direct vs rmqfast.

``rmqfast bench --real`` (or ``python -m rmqfast.bench_real``) starts a RocketMQ 5.3.3 name
server and broker from the Maven Central jars (the same harness as the integration tests),
rmqfast in front of it, and runs the Java driver's ``perf-produce`` scenario (rocketmq-client
5.3.3, synchronous sends, every send's latency recorded) alternately straight at the name server
and through the proxy, for several rounds.  It prints msg/s and latency percentiles per target,
their medians, the rmqfast/direct ratio, and writes JSON lines beside the null-broker bench.

Here the broker (a JVM writing a commit log) is the bottleneck, not the proxy: the ratio says
what a user of a real cluster gives up by putting rmqfast in front of it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rmqfast.bench import DEFAULT_RESULTS_DIR, SCHEMA, BenchError, machine_cpu
from rmqfast.testing import RocketMQCluster, ensure_jars
from rmqfast.testing.javaclient import run_driver
from rmqfast.testing.proxy import ProxyProcess

TOPIC = "RmqfastBenchReal"
TARGETS = ("direct", "rmqfast")


def add_java_run_args(ap: argparse.ArgumentParser, short_s: float) -> None:
    """The options every Java-producer bench mode shares (real broker, cross-cloud)."""
    ap.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--duration", type=float, default=8.0, help="measured seconds per run (default 8)")
    ap.add_argument("--warmup", type=float, default=3.0, help="warm-up seconds per run (default 3)")
    ap.add_argument("--threads", type=int, default=16, help="sending threads in the producer (default 16)")
    ap.add_argument("--body-size", type=int, default=1024, help="message body bytes (default 1024)")
    ap.add_argument("--workers", type=int, default=2, help="rmqfast worker processes per proxy (default 2)")
    ap.add_argument("--short", action="store_true", help=f"1 round of {short_s:g} s runs")
    ap.add_argument("--results", type=Path, default=DEFAULT_RESULTS_DIR, help="results folder (default results/bench)")


def check_java_run_args(ap: argparse.ArgumentParser, args: argparse.Namespace, short_s: float) -> None:
    if args.short:
        args.rounds, args.duration, args.warmup = 1, short_s, 2.0
    if args.rounds < 1 or args.duration <= 0 or args.warmup < 0 or args.threads < 1 or args.body_size < 1 \
            or args.workers < 1:
        ap.error("--rounds, --threads, --body-size and --workers must be >= 1, --duration > 0, --warmup >= 0")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="rmqfast bench --real",
        description="Java producer (rocketmq-client 5.3.3, sync sends) against a real RocketMQ broker, "
        "direct vs through rmqfast, alternating, side by side.",
    )
    ap.add_argument("--real", action="store_true", help=argparse.SUPPRESS)  # how `rmqfast bench` got here
    add_java_run_args(ap, short_s=3.0)
    args = ap.parse_args(argv)
    check_java_run_args(ap, args, short_s=3.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        return _run(args)
    except BenchError as exc:
        print(f"bench --real: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    jars = ensure_jars()
    stamp = dt.datetime.now(dt.UTC)
    run_id = f"{stamp:%Y%m%dT%H%M%SZ}-real"
    args.results.mkdir(parents=True, exist_ok=True)
    out_path = args.results / f"bench-{run_id}.jsonl"
    common: dict[str, Any] = {"schema": SCHEMA, "run_id": run_id, "mode": "real-broker"}
    runs: list[dict[str, Any]] = []
    failed = 0
    print(f"bench --real: starting RocketMQ and rmqfast; results -> {out_path}", file=sys.stderr, flush=True)
    with RocketMQCluster(jars=jars, broker_heap_mb=1024) as cluster, \
            ProxyProcess([cluster.namesrv_addr], workers=args.workers) as proxy, open(out_path, "a") as out:
        cluster.create_topic(TOPIC, queues=8)
        addrs = {"direct": cluster.namesrv_addr, "rmqfast": proxy.namesrv_addr}
        for rnd in range(args.rounds):
            order = TARGETS if rnd % 2 == 0 else TARGETS[::-1]
            for target in order:
                before = machine_cpu()
                t0 = time.monotonic()
                res = run_driver(
                    "perf-produce", addrs[target], "5",
                    topic=TOPIC, threads=args.threads, body_size=args.body_size,
                    warmup_ms=int(args.warmup * 1000), duration_ms=int(args.duration * 1000),
                    timeout=args.warmup + args.duration + 90, check=False, heap_mb=512, allow_failures=True,
                )
                wall = time.monotonic() - t0
                after = machine_cpu()
                rec = {
                    **common, "ts": dt.datetime.now(dt.UTC).isoformat(), "kind": "run", "round": rnd,
                    "scenario": f"java-sync-{args.threads}t", "target": target,
                    "params": {"threads": args.threads, "body_size": args.body_size, "duration_s": args.duration},
                    "loadgen": {
                        "rps": res.get("msg_per_s", 0.0), "responses": res.get("sent_count", 0),
                        "errors": res.get("failed_count", 0), "lat_us": res.get("lat_us", {}),
                    },
                    "machine_busy_cores": round((after["task"] - before["task"]) / wall, 2) if wall else None,
                    "driver_ok": bool(res.get("ok")),
                }
                if not res.get("ok") or not res.get("sent_count"):
                    failed += 1
                    rec["error"] = res.get("error") or f"exit {res.get('exit_code')}"
                runs.append(rec)
                out.write(json.dumps(rec) + "\n")
                out.flush()
                lat = rec["loadgen"]["lat_us"]
                print(f"  round {rnd + 1}/{args.rounds}  {target:<8} {rec['loadgen']['rps']:>9,.0f} msg/s  "
                      f"p50 {lat.get('p50', 0) / 1000:6.2f} ms  p99 {lat.get('p99', 0) / 1000:7.2f} ms  "
                      f"failed {rec['loadgen']['errors']}", file=sys.stderr, flush=True)
        summary = summarize(runs)
        for row in summary:
            out.write(json.dumps({**common, "kind": "summary", **row}) + "\n")
    print()
    print(render(summary, args))
    print(f"\nresults: {out_path}")
    if failed:
        print(f"bench --real: {failed} run(s) failed (see the results file)", file=sys.stderr)
        return 1
    return 0


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for target in TARGETS:
        rs = [r for r in runs if r["target"] == target and r["loadgen"]["responses"]]
        if not rs:
            continue
        lat = [r["loadgen"]["lat_us"] for r in rs]
        rows.append({
            "scenario": rs[0]["scenario"], "target": target, "rounds": len(rs),
            "rps": statistics.median(r["loadgen"]["rps"] for r in rs),
            "rounds_rps": [r["loadgen"]["rps"] for r in rs],
            "p50_us": statistics.median(x.get("p50", 0) for x in lat),
            "p99_us": statistics.median(x.get("p99", 0) for x in lat),
            "p999_us": statistics.median(x.get("p999", 0) for x in lat),
            "errors": sum(r["loadgen"]["errors"] for r in rs),
        })
    return rows


def render(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"real broker (RocketMQ 5.3.3, one broker), Java client 5.3.3, {args.threads} threads of sync sends, "
             f"{args.body_size} B bodies; {args.rounds} round(s) of {args.duration:g} s; medians", ""]
    head = f"{'target':<9} {'msg/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'p99.9 ms':>9} {'failed':>7}  rounds (msg/s)"
    lines += [head, "-" * len(head)]
    for r in rows:
        rounds = ", ".join(f"{x:,.0f}" for x in r["rounds_rps"])
        lines.append(f"{r['target']:<9} {r['rps']:>9,.0f} {r['p50_us'] / 1000:>8.2f} {r['p99_us'] / 1000:>8.2f} "
                     f"{r['p999_us'] / 1000:>9.2f} {r['errors']:>7}  {rounds}")
    by = {r["target"]: r for r in rows}
    if "direct" in by and "rmqfast" in by and by["direct"]["rps"]:
        d, p = by["direct"], by["rmqfast"]
        lines.append("")
        lines.append(f"rmqfast / direct: {p['rps'] / d['rps']:.3f} (throughput); added latency p50 "
                     f"{(p['p50_us'] - d['p50_us']) / 1000:+.2f} ms, p99 {(p['p99_us'] - d['p99_us']) / 1000:+.2f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
