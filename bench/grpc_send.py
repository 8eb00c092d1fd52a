"""gRPC sends per proxy core: rmqfast's gRPC front beside Apache's proxy, same broker, same client.

One real RocketMQ 5.3.3 name server + broker; ``rmqfast serve`` (1 worker, so one gRPC front
process) and Apache's ``rocketmq-proxy`` 5.3.3 (cluster mode, its gRPC port) in front of it.  A
``grpc.aio`` client (the 5.x clients' metadata headers) keeps ``--inflight`` SendMessage calls of
``--body`` bytes in flight for ``--duration`` seconds against each proxy in turn (``--rounds``
times, the order rotating).  Printed per run: sends/s, p99 and the proxy's CPU seconds per 1000
sends (user + system from /proc: the rmqfast gRPC front process, the Apache proxy JVM), then the
medians.  A measurement, not a test::

    .venv/bin/python bench/grpc_send.py [--rounds 3] [--duration 5] [--inflight 32]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
import uuid

import grpc

from rmqfast.bench.procfs import children, total_cpu
from rmqfast.grpcfront import protos
from rmqfast.testing import RocketMQCluster, ensure_jars
from rmqfast.testing.apacheproxy import ApacheProxy
from rmqfast.testing.ports import reserve
from rmqfast.testing.proxy import ProxyProcess

TOPIC = "GrpcSendBench"


async def load(pb, addr: str, seconds: float, inflight: int, body: bytes) -> tuple[int, list[float], int]:  # type: ignore[no-untyped-def]
    md = (("x-mq-client-id", f"bench@{uuid.uuid4().hex[:8]}"), ("x-mq-language", "JAVA"),
          ("x-mq-client-version", "5.0.7"), ("x-mq-protocol", "v2"))
    async with grpc.aio.insecure_channel(addr) as ch:
        send = ch.unary_unary(f"/{pb.service.full_name}/SendMessage",
                              request_serializer=pb.SendMessageRequest.SerializeToString,
                              response_deserializer=pb.SendMessageResponse.FromString)
        lat: list[float] = []
        fails = 0
        stop = time.monotonic() + seconds

        async def one() -> None:
            nonlocal fails
            while time.monotonic() < stop:
                req = pb.SendMessageRequest()
                m = req.messages.add(body=body)
                m.topic.name = TOPIC
                m.system_properties.message_id = uuid.uuid4().hex.upper()
                m.system_properties.tag = "b"
                m.system_properties.message_type = pb.MessageType.NORMAL
                m.system_properties.born_timestamp.GetCurrentTime()
                t0 = time.monotonic()
                r = await send(req, timeout=10, metadata=md)
                if r.status.code == pb.Code.OK:
                    lat.append(time.monotonic() - t0)
                else:
                    fails += 1

        await asyncio.gather(*(one() for _ in range(inflight)))
        return len(lat), lat, fails


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--inflight", type=int, default=32)
    ap.add_argument("--body", type=int, default=1024)
    args = ap.parse_args()
    pb = protos.load()
    body = b"x" * args.body
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(RocketMQCluster(jars=ensure_jars(), fast_start=False))
        cluster.create_topic(TOPIC, 4)
        lease = reserve([0])
        stack.callback(lease.release)
        extra = f'\n[grpc]\nenabled = true\nlisten = "127.0.0.1:{lease.base}"\n'
        rmq = stack.enter_context(ProxyProcess([cluster.namesrv_addr], workers=1, extra_config=extra))
        apx = stack.enter_context(ApacheProxy(cluster.namesrv_addr, cluster_name=cluster.cluster_name,
                                              fast_start=False))
        ch = grpc.insecure_channel(f"127.0.0.1:{lease.base}")
        grpc.channel_ready_future(ch).result(timeout=60)
        ch.close()
        assert rmq.proc is not None and apx.pid is not None

        def rmq_pids() -> list[int]:
            pids = []
            for w in children(rmq.proc.pid):  # type: ignore[union-attr]
                pids += children(w)  # each worker's gRPC front
            return pids

        targets = {"rmqfast": (f"127.0.0.1:{lease.base}", rmq_pids), "apache": (apx.grpc_addr, lambda: [apx.pid])}
        for addr, _ in targets.values():  # warm-up (JIT, connections, routes)
            asyncio.run(load(pb, addr, 3.0, args.inflight, body))
        results: dict[str, list[dict[str, float]]] = {k: [] for k in targets}
        order = list(targets)
        for r in range(args.rounds):
            for name in order[r % 2:] + order[: r % 2]:
                addr, pids_of = targets[name]
                pids = pids_of()
                u0, s0 = total_cpu(pids)
                t0 = time.monotonic()
                n, lat, fails = asyncio.run(load(pb, addr, args.duration, args.inflight, body))
                took = time.monotonic() - t0
                u1, s1 = total_cpu(pids)
                lat.sort()
                row = {"sends_per_s": round(n / took), "p99_ms": round(lat[int(0.99 * (len(lat) - 1))] * 1000, 1),
                       "cpu_s_per_1000": round((u1 - u0 + s1 - s0) / max(1, n) * 1000, 3), "failed": fails}
                results[name].append(row)
                print(f"round {r} {name:8s} {json.dumps(row)}", flush=True)
        for name, rows in results.items():
            med = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
            print(f"median {name:8s} {json.dumps(med)}", flush=True)


if __name__ == "__main__":
    main()
