"""Cross-cloud mode of the bench: durable vs fast copies, side by side, with real clusters.

``rmqfast bench --clouds`` (or ``python -m rmqfast.bench --clouds``) starts two RocketMQ 5.3.3
clusters (cloud A and cloud B) and three rmqfast proxies in front of A: one without
replication, one copying every message of the topic to B in ``fast`` mode, and one in
``durable`` mode (each copy synced to the worker's RocksDB before the producer hears SUCCESS).
The Java driver's ``perf-produce`` (rocketmq-client 5.3.3, synchronous sends, every send timed)
runs against each proxy in turn, alternating, for several rounds.  Printed: msg/s and latency per
target, durable / fast (goal: at least 0.8), fast / none, and the durable proxy's
messages per fsync (its group commit).  Results go to ``results/bench/`` as JSON lines.

``--baseline DIR`` adds a fourth proxy, durable too, run from another source tree (a checkout of
an earlier commit with its extension built, e.g. ``git worktree add /tmp/base main && make -C
/tmp/base install``): the ``baseline`` target, measured in the same rounds as ``durable``, so a
change's effect on durable throughput is read side by side (``durable / baseline``).

Everything shares the machine's cores: on 2 cores two brokers, the proxies, their deliver
processes and the producer compete, so absolute numbers are low; the ratios are the point.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from rmqfast.bench.common import guarded
from rmqfast.bench.javarun import JavaRuns, java_args, rounds_text
from rmqfast.codec.codes import GET_MAX_OFFSET, SUCCESS
from rmqfast.testing import RocketMQCluster, ensure_jars, remoting_request
from rmqfast.testing.proxy import ProxyProcess

TOPIC = "RmqfastBenchClouds"
TARGETS = ("none", "fast", "durable")
LABEL = "bench --clouds"


def _config(mode: str, remote_ns: str) -> str:
    if mode == "baseline":
        mode = "durable"
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


def _fsync_figures(proxy: ProxyProcess) -> tuple[float, float]:
    m = proxy.metrics()
    fsyncs = sum(v for (n, _), v in m.items() if n == "rmqfast_spill_fsyncs_total")
    synced = sum(v for (n, _), v in m.items() if n == "rmqfast_spill_synced_messages_total")
    return fsyncs, synced


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--baseline", type=Path, default=None)
    known, rest = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    args = java_args(rest, prog="rmqfast bench --clouds", flag="--clouds", short_s=4.0,
                     description="Durable vs fast cross-cloud copies (and no copies), two real RocketMQ clusters, "
                     "Java producer; --baseline DIR adds a durable proxy run from the source tree DIR.")
    args.baseline = known.baseline
    if args.baseline is not None and not (args.baseline / "rmqfast" / "__init__.py").is_file():
        print(f"{LABEL}: --baseline {args.baseline}: no rmqfast/__init__.py there; give the root of an rmqfast "
              "source tree whose extension is built (make install in it)", file=sys.stderr)
        return 2
    return guarded(LABEL, lambda: _run(args))


def _proxy(target: str, args: argparse.Namespace, a: RocketMQCluster, b: RocketMQCluster) -> ProxyProcess:
    """A proxy for ``target``; ``baseline`` runs from the source tree ``args.baseline``."""
    if target != "baseline":
        return ProxyProcess([a.namesrv_addr], workers=args.workers, extra_config=_config(target, b.namesrv_addr))
    root = str(args.baseline.resolve())
    env = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    return ProxyProcess([a.namesrv_addr], workers=args.workers, extra_config=_config(target, b.namesrv_addr),
                        env=env, cwd=root)


def _copies_in(cluster: RocketMQCluster) -> str:
    """How many messages of the topic cluster B stores (informational)."""
    try:
        stored = 0
        for q in range(8):
            r = remoting_request(cluster.broker_addr, GET_MAX_OFFSET, {"topic": TOPIC, "queueId": q})
            stored += int(r.ext_fields.get("offset", 0)) if r.code == SUCCESS else 0
        return f"cloud B holds {stored:,} copies of {TOPIC}"
    except Exception as exc:  # informational only
        return f"could not count the copies in cloud B: {exc}"


def _run(args: argparse.Namespace) -> int:
    jars = ensure_jars()
    with ExitStack() as stack:
        jr = stack.enter_context(JavaRuns(args, "clouds", "clouds"))
        print(f"{LABEL}: starting two RocketMQ clusters and {4 if args.baseline else 3} proxies; results -> {jr.path}",
              file=sys.stderr, flush=True)
        a = stack.enter_context(RocketMQCluster(jars=jars, cluster_name="CloudA", broker_name="broker-a",
                                                broker_heap_mb=512))
        b = stack.enter_context(RocketMQCluster(jars=jars, cluster_name="CloudB", broker_name="broker-b",
                                                broker_heap_mb=512))
        for c in (a, b):
            c.create_topic(TOPIC, queues=8)
        targets = TARGETS + (("baseline",) if args.baseline is not None else ())
        proxies = {t: stack.enter_context(_proxy(t, args, a, b)) for t in targets}
        n = len(targets)
        for rnd in range(args.rounds):
            for target in targets[rnd % n:] + targets[: rnd % n]:
                f0 = _fsync_figures(proxies[target])
                res = jr.produce(proxies[target].namesrv_addr, TOPIC, grace=120)
                time.sleep(1.2)  # one metrics publish period
                f1 = _fsync_figures(proxies[target])
                fsyncs, synced = f1[0] - f0[0], f1[1] - f0[1]
                jr.record(rnd, f"java-sync-{args.threads}t-copies", target, res,
                          note=f"  {synced / fsyncs:.1f} msg/fsync" if fsyncs else "",
                          fsyncs=fsyncs, synced_messages=synced)
        delivered_note = _copies_in(b)
        rows = jr.summary(targets, fsyncs="fsyncs", synced="synced_messages")
    print()
    print(render(rows, args))
    print(delivered_note)
    print(f"results: {jr.path}")
    return 1 if jr.failed else 0


def render(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"cross-cloud copies, Java client 5.3.3, {args.threads} threads of sync {args.body_size} B sends, "
             f"{args.workers} workers per proxy; {args.rounds} round(s) of {args.duration:g} s; medians"]
    for r in rows:
        per = f"   {r['synced'] / r['fsyncs']:.1f} messages per fsync" if r["fsyncs"] else ""
        lines.append(f"  {r['target']:<8} {r['rps']:>9,.0f} msg/s  p50 {r['p50_us'] / 1000:6.2f} ms  "
                     f"p99 {r['p99_us'] / 1000:7.2f} ms  rounds {rounds_text(r)}{per}")
    by = {r["target"]: r for r in rows}
    if "durable" in by and "fast" in by and by["fast"]["rps"]:
        ratio = by["durable"]["rps"] / by["fast"]["rps"]
        lines.append(f"\ndurable / fast: {ratio:.3f} (goal >= 0.8: {'met' if ratio >= 0.8 else 'MISSED'})")
    if "durable" in by and "baseline" in by and by["baseline"]["rps"]:
        ratio = by["durable"]["rps"] / by["baseline"]["rps"]
        verdict = "met" if ratio >= 0.95 else "MISSED"
        lines.append(f"durable / baseline (same rounds): {ratio:.3f} (goal >= 0.95: {verdict})")
    if "fast" in by and "none" in by and by["none"]["rps"]:
        lines.append(f"fast / no copies: {by['fast']['rps'] / by['none']['rps']:.3f}")
    return "\n".join(lines)
