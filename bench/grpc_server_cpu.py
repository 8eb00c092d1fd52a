"""CPU per gRPC call of the front's HTTP/2 server alone: the nghttp2 server ("h2") and grpc.aio ("grpcio").

The gRPC front's own process (``rmqfast.grpcfront.server.serve`` with the real MessagingService, on
its uvloop loop) is started with each server in turn; grpcio's client, in this process, keeps
``--inflight`` unary ``Heartbeat`` calls in flight (the front answers them without a broker, with the
``x-mq-*`` headers the Java client sends) and the front's user + system CPU is read from /proc
around ``--calls`` calls.  This is the per-call cost of the server stack (HTTP/2, gRPC framing,
task, protobuf), not of the broker work; ``bench/grpc_send.py`` measures the whole::

    .venv/bin/python bench/grpc_server_cpu.py [--calls 20000] [--inflight 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

from rmqfast.bench.procfs import total_cpu
from rmqfast.testing.ports import reserve

SERVE = """
import asyncio, sys
from rmqfast.grpcfront import server
from rmqfast.grpcfront.settings import GrpcSection
s = GrpcSection(enabled=True, listen="127.0.0.1:" + sys.argv[2], server=sys.argv[1])
with asyncio.Runner(loop_factory=server.loop_factory()) as r:
    r.run(server.serve(["127.0.0.1:1"], s, None))
"""

METADATA = (("x-mq-client-id", "bench@1@0"), ("x-mq-language", "JAVA"), ("x-mq-protocol", "v2"),
            ("x-mq-client-version", "5.0.7"), ("x-mq-request-id", "5c1e3c5a-0b0b-4c4c-9d9d-000000000000"),
            ("x-mq-namespace", ""), ("x-mq-date-time", "20260101T000000Z"))


async def drive(port: int, pid: int, calls: int, inflight: int) -> dict[str, float]:
    import grpc

    from rmqfast.grpcfront import protos

    pb = protos.load()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        await asyncio.wait_for(ch.channel_ready(), 60)
        hb = ch.unary_unary("/apache.rocketmq.v2.MessagingService/Heartbeat",
                            request_serializer=pb.HeartbeatRequest.SerializeToString,
                            response_deserializer=pb.HeartbeatResponse.FromString)
        req = pb.HeartbeatRequest(group=pb.Resource(name="bench"))

        async def lane(n: int) -> None:
            for _ in range(n):
                await hb(req, timeout=30, metadata=METADATA)

        await asyncio.gather(*(lane(50) for _ in range(inflight)))  # warm-up
        per = calls // inflight
        c0, t0 = sum(total_cpu([pid])), time.monotonic()
        await asyncio.gather(*(lane(per) for _ in range(inflight)))
        c1, t1 = sum(total_cpu([pid])), time.monotonic()
    done = per * inflight
    return {"calls": done, "calls_per_s": round(done / (t1 - t0)),
            "server_cpu_us_per_call": round((c1 - c0) / done * 1e6, 1), "load_average": round(os.getloadavg()[0], 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--inflight", type=int, default=64)
    ap.add_argument("--servers", default="h2,grpcio")
    args = ap.parse_args()
    for name in args.servers.split(","):
        lease = reserve([0])
        proc = subprocess.Popen([sys.executable, "-c", SERVE, name, str(lease.base)])
        try:
            row = asyncio.run(drive(lease.base, proc.pid, args.calls, args.inflight))
            print(f"{name:7s} {row}", flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
            lease.release()


if __name__ == "__main__":
    main()
