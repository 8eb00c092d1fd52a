"""Real-broker mode of the bench: the Java producer against a real RocketMQ, direct vs rmqfast.

``rmqfast bench --real`` (or ``python -m rmqfast.bench --real``) starts a RocketMQ 5.3.3 name
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
import sys
import time
from typing import Any

from rmqfast.bench.common import guarded
from rmqfast.bench.javarun import JavaRuns, java_args, rounds_text
from rmqfast.bench.procfs import machine_cpu
from rmqfast.testing import RocketMQCluster, ensure_jars
from rmqfast.testing.proxy import ProxyProcess

TOPIC = "RmqfastBenchReal"
TARGETS = ("direct", "rmqfast")
LABEL = "bench --real"


def main(argv: list[str] | None = None) -> int:
    args = java_args(argv, prog="rmqfast bench --real", flag="--real", short_s=3.0,
                     description="Java producer (rocketmq-client 5.3.3, sync sends) against a real RocketMQ broker, "
                     "direct vs through rmqfast, alternating, side by side.")
    return guarded(LABEL, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    jars = ensure_jars()
    with JavaRuns(args, "real", "real-broker") as jr:
        print(f"{LABEL}: starting RocketMQ and rmqfast; results -> {jr.path}", file=sys.stderr, flush=True)
        with RocketMQCluster(jars=jars, broker_heap_mb=1024) as cluster, \
                ProxyProcess([cluster.namesrv_addr], workers=args.workers) as proxy:
            cluster.create_topic(TOPIC, queues=8)
            addrs = {"direct": cluster.namesrv_addr, "rmqfast": proxy.namesrv_addr}
            for rnd in range(args.rounds):
                for target in TARGETS if rnd % 2 == 0 else TARGETS[::-1]:
                    before = machine_cpu()
                    t0 = time.monotonic()
                    res = jr.produce(addrs[target], TOPIC, grace=90)
                    wall = time.monotonic() - t0
                    busy = round((machine_cpu()["task"] - before["task"]) / wall, 2) if wall else None
                    jr.record(rnd, f"java-sync-{args.threads}t", target, res, machine_busy_cores=busy)
            summary = jr.summary(TARGETS)
    print()
    print(render(summary, args))
    print(f"\nresults: {jr.path}")
    if jr.failed:
        print(f"{LABEL}: {jr.failed} run(s) failed (see the results file)", file=sys.stderr)
        return 1
    return 0


def render(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"real broker (RocketMQ 5.3.3, one broker), Java client 5.3.3, {args.threads} threads of sync sends, "
             f"{args.body_size} B bodies; {args.rounds} round(s) of {args.duration:g} s; medians", ""]
    head = f"{'target':<9} {'msg/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'p99.9 ms':>9} {'failed':>7}  rounds (msg/s)"
    lines += [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['target']:<9} {r['rps']:>9,.0f} {r['p50_us'] / 1000:>8.2f} {r['p99_us'] / 1000:>8.2f} "
                     f"{r['p999_us'] / 1000:>9.2f} {r['errors']:>7}  {rounds_text(r)}")
    by = {r["target"]: r for r in rows}
    if "direct" in by and "rmqfast" in by and by["direct"]["rps"]:
        d, p = by["direct"], by["rmqfast"]
        lines.append("")
        lines.append(f"rmqfast / direct: {p['rps'] / d['rps']:.3f} (throughput); added latency p50 "
                     f"{(p['p50_us'] - d['p50_us']) / 1000:+.2f} ms, p99 {(p['p99_us'] - d['p99_us']) / 1000:+.2f} ms")
    return "\n".join(lines)
