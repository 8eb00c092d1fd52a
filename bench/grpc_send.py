"""gRPC sends and receives per proxy core: rmqfast's gRPC front beside Apache's proxy, same broker,
same client.

One real RocketMQ 5.3.3 name server + broker; ``rmqfast serve`` (``--workers`` workers, each with
its gRPC front process) and Apache's ``rocketmq-proxy`` 5.3.3 (cluster mode, its gRPC port, C2 on)
in front of it.  The load is the real Java 5.x client (``rocketmq-client-java`` 5.0.7,
``GrpcDriver throughput`` in ``java/grpcclient``, one JVM per run): a Producer keeps ``--inflight``
async sends of ``--body`` bytes in flight for ``--duration`` seconds to a fresh topic; then
``--consumers`` SimpleConsumers of a fresh group (one thread each, batches of 32, acks async)
receive and ack every message that was sent.  Each proxy is driven in turn, ``--rounds`` times, the
order rotating, after a warm-up run each (``--warmup`` seconds of sends: JIT, connections, routes).
``--asyncio-loop`` adds a second ``rmqfast serve`` whose gRPC front runs asyncio's own event loop
instead of uvloop's.

CPU: user + system seconds from /proc of the proxy's processes, read when a phase starts and when
it ends (the clients are built before): rmqfast's supervisor, workers and gRPC front processes;
Apache's proxy JVM.  Printed per run and phase: messages/s, proxy CPU seconds per 1,000 messages,
messages per proxy CPU second (= per core fully used), the load average; then the medians and
the ratios rmqfast / Apache.  A measurement, not a test::

    .venv/bin/python bench/grpc_send.py [--rounds 3] [--duration 10] [--inflight 64] [--consumers 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import tempfile
from collections.abc import Callable

import grpc

from rmqfast.bench.procfs import children, total_cpu
from rmqfast.testing import RocketMQCluster, ensure_jars
from rmqfast.testing.apacheproxy import ApacheProxy
from rmqfast.testing.grpcclient import ensure_grpc_driver
from rmqfast.testing.ports import reserve
from rmqfast.testing.proxy import ProxyProcess
from rmqfast.testing.tools import java_executable


def drive(classpath: str, addr: str, topic: str, group: str, args: argparse.Namespace,
          pids_of: Callable[[], list[int]], seconds: int) -> dict[str, float]:
    """One ``GrpcDriver throughput`` run against ``addr``; the proxy's CPU read around each phase."""
    cmd = [java_executable(), "-Xmx512m", "-cp", classpath, "GrpcDriver", "throughput", addr, topic, group,
           str(seconds), str(args.inflight), str(args.body), str(args.consumers)]
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        assert p.stdin is not None and p.stdout is not None

        def expect(word: str) -> list[str]:
            line = p.stdout.readline()  # type: ignore[union-attr]
            if not line.startswith(word):
                p.kill()
                err.seek(0)
                raise RuntimeError(f"GrpcDriver: expected {word}, got {line!r}: {err.read()[-3000:]!r}")
            return line.split()[1:]

        def go() -> None:
            p.stdin.write("\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]

        try:
            expect("READY")
            pids = pids_of()
            c0 = sum(total_cpu(pids))
            go()
            sent, send_ms, send_failed = (int(x) for x in expect("SENT"))
            c1 = sum(total_cpu(pids))
            go()
            got, recv_ms, deliveries, ack_failed = (int(x) for x in expect("RECV"))
            c2 = sum(total_cpu(pids))
            expect("DONE")
            p.wait(60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    send_cpu, recv_cpu = c1 - c0, c2 - c1
    return {
        "sent": sent, "send_failed": send_failed, "sends_per_s": round(sent / (send_ms / 1000)),
        "send_cpu_s_per_1000": round(send_cpu / max(1, sent) * 1000, 3),
        "sends_per_cpu_s": round(sent / send_cpu) if send_cpu else 0,
        "received": got, "deliveries": deliveries, "ack_failed": ack_failed,
        "receives_per_s": round(got / (max(1, recv_ms) / 1000)),
        "recv_cpu_s_per_1000": round(recv_cpu / max(1, got) * 1000, 3),
        "receives_per_cpu_s": round(got / recv_cpu) if recv_cpu else 0,
        "load_average": round(os.getloadavg()[0], 1),
    }


def rmq_pids(sup: int) -> list[int]:
    """An ``rmqfast serve``'s processes: the supervisor, its workers and their gRPC fronts."""
    workers = children(sup)
    return [sup, *workers, *(f for w in workers for f in children(w))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=int, default=10, help="seconds of sends per run")
    ap.add_argument("--warmup", type=int, default=40,
                    help="seconds of sends of each proxy's warm-up run (Apache's JVM needed some 20,000 messages "
                         "before its CPU per message settled: shorter warm-ups measure it half-compiled)")
    ap.add_argument("--inflight", type=int, default=64, help="async sends in flight")
    ap.add_argument("--body", type=int, default=1024)
    ap.add_argument("--consumers", type=int, default=2, help="SimpleConsumers (one thread each)")
    ap.add_argument("--workers", type=int, default=1, help="rmqfast workers (one gRPC front process each)")
    ap.add_argument("--queues", type=int, default=8, help="queues of each topic")
    ap.add_argument("--asyncio-loop", action="store_true",
                    help="also a second rmqfast whose gRPC front runs asyncio's own loop (RMQFAST_GRPC_LOOP=asyncio)")
    ap.add_argument("--grpcio", action="store_true",
                    help='also a second rmqfast whose gRPC front is grpc.aio ([grpc] server = "grpcio"; '
                         'the first one runs the default, the nghttp2 server)')
    args = ap.parse_args()
    classpath = ensure_grpc_driver()
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(RocketMQCluster(jars=ensure_jars(), fast_start=False))
        lease = reserve([0])
        stack.callback(lease.release)
        extra = f'\n[grpc]\nenabled = true\nlisten = "127.0.0.1:{lease.base}"\n'
        rmq = stack.enter_context(ProxyProcess([cluster.namesrv_addr], workers=args.workers, extra_config=extra))
        fronts = {"rmqfast": (f"127.0.0.1:{lease.base}", rmq)}
        if args.asyncio_loop:
            lease2 = reserve([0])
            stack.callback(lease2.release)
            extra2 = f'\n[grpc]\nenabled = true\nlisten = "127.0.0.1:{lease2.base}"\n'
            fronts["rmqfast-asyncio"] = (f"127.0.0.1:{lease2.base}", stack.enter_context(ProxyProcess(
                [cluster.namesrv_addr], workers=args.workers, extra_config=extra2,
                env={"RMQFAST_GRPC_LOOP": "asyncio"})))
        if args.grpcio:
            lease3 = reserve([0])
            stack.callback(lease3.release)
            extra3 = f'\n[grpc]\nenabled = true\nserver = "grpcio"\nlisten = "127.0.0.1:{lease3.base}"\n'
            fronts["rmqfast-grpcio"] = (f"127.0.0.1:{lease3.base}", stack.enter_context(ProxyProcess(
                [cluster.namesrv_addr], workers=args.workers, extra_config=extra3)))
        apx = stack.enter_context(ApacheProxy(cluster.namesrv_addr, cluster_name=cluster.cluster_name,
                                              fast_start=False))
        targets: dict[str, tuple[str, Callable[[], list[int]]]] = {}
        for name, (addr, proc) in fronts.items():
            ch = grpc.insecure_channel(addr)
            grpc.channel_ready_future(ch).result(timeout=60)
            ch.close()
            assert proc.proc is not None
            targets[name] = (addr, lambda sup=proc.proc.pid: rmq_pids(sup))
        assert apx.pid is not None
        targets["apache"] = (apx.grpc_addr, lambda: [apx.pid])  # type: ignore[list-item]
        tag = os.urandom(3).hex()
        for name, (addr, pids_of) in targets.items():  # warm-up
            topic = f"GrpcBenchWarm_{name}_{tag}"
            cluster.create_topic(topic, args.queues)
            row = drive(classpath, addr, topic, f"warm_{name}_{tag}", args, pids_of, args.warmup)
            print(f"warm-up  {name:8s} {json.dumps(row)}", flush=True)
        results: dict[str, list[dict[str, float]]] = {k: [] for k in targets}
        order = list(targets)
        for r in range(args.rounds):
            for name in order[r % len(order):] + order[: r % len(order)]:
                addr, pids_of = targets[name]
                topic = f"GrpcBench{r}_{name}_{tag}"
                cluster.create_topic(topic, args.queues)
                row = drive(classpath, addr, topic, f"bench{r}_{name}_{tag}", args, pids_of, args.duration)
                results[name].append(row)
                print(f"round {r}  {name:8s} {json.dumps(row)}", flush=True)
        med = {name: {k: statistics.median(x[k] for x in rows) for k in rows[0]} for name, rows in results.items()}
        for name, m in med.items():
            print(f"median   {name:8s} {json.dumps(m)}", flush=True)
        for name in fronts:
            ratio = {k: round(med[name][k] / med["apache"][k], 2) for k in
                     ("sends_per_s", "sends_per_cpu_s", "receives_per_s", "receives_per_cpu_s") if med["apache"][k]}
            print(f"ratio    {name}/apache {json.dumps(ratio)}", flush=True)


if __name__ == "__main__":
    main()
