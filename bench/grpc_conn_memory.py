"""Memory of the gRPC front (``[grpc] server = "h2"``) before, during and after many connections.

``python bench/grpc_conn_memory.py [--conns 1500] [--wave 100] [--rounds 2] [--trace]``

A child process serves the real :class:`~rmqfast.grpcfront.service.MessagingService` on the nghttp2
server (loopback, a port from the OS); this process opens ``--conns`` connections in waves of
``--wave`` at once, each with grpcio's client as a 5.x client does (a Telemetry stream with its
settings, a Heartbeat), then closes them.  The child's RSS (``VmRSS``), Python's traced heap
(``--trace``: tracemalloc, the top growth by line) and glibc's heap (``mallinfo2``) are read after a
warm-up, with all the connections of a wave open, and after each round once every connection is
gone.  One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from typing import Any

SVC = "/apache.rocketmq.v2.MessagingService/"

CHILD = r"""
import asyncio, ctypes, gc, json, sys, time, tracemalloc
from rmqfast.grpcfront import protos
from rmqfast.grpcfront.h2server import H2Server
from rmqfast.grpcfront.service import MessagingService
from rmqfast.grpcfront.settings import GrpcSection

TRACE = sys.argv[1] == "1"
libc = ctypes.CDLL("libc.so.6")

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]

libc.mallinfo2.restype = Mallinfo2

def pymalloc():
    # pymalloc's arenas (sys._debugmallocstats, read through a pipe)
    import os, re
    r, w = os.pipe()
    saved = os.dup(2)
    os.dup2(w, 2)
    try:
        sys._debugmallocstats()
    finally:
        os.dup2(saved, 2)
        os.close(w)
    text = b""
    while chunk := os.read(r, 65536):
        text += chunk
    os.close(r)
    t = text.decode()
    def num(label):
        m = re.search(re.escape(label) + r"\s*=\s*([\d,]+)", t)
        return int(m.group(1).replace(",", "")) if m else -1
    return {"arenas_allocated_current": num("# arenas allocated current"),
            "arena_bytes": num("# bytes in allocated blocks") + num("# bytes in available blocks")}

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0

async def main():
    pb = protos.load()
    svc = MessagingService(pb, [], GrpcSection(enabled=True))
    server = H2Server(svc, 4 << 20, max_connections_per_client=100_000)  # all from 127.0.0.1
    port = await server.start("127.0.0.1", 0)
    if TRACE:
        tracemalloc.start(1)
    base = None
    print(json.dumps({"port": port}), flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        cmd = line.strip()
        if not cmd:
            break
        gc.collect()
        out = {"rss": rss(), "conns": len(server.conns), "gc_objects": len(gc.get_objects()),
               "trims": server.heap.trims, "last_trim_ms": server.heap.last_ms,
               "peak": server.gate.peak}
        mi = libc.mallinfo2()
        out["malloc_in_use"], out["malloc_free"] = mi.uordblks + mi.hblkhd, mi.fordblks
        out["pymalloc"] = pymalloc()
        if TRACE:
            snap = tracemalloc.take_snapshot()
            out["traced"] = tracemalloc.get_traced_memory()[0]
            if cmd == "base":
                base = snap
            elif base is not None:
                out["top"] = [str(s) for s in snap.compare_to(base, "lineno")[:8]]
        if cmd == "trim":
            t0 = time.perf_counter()
            libc.malloc_trim(0)
            out["trim_ms"] = (time.perf_counter() - t0) * 1000
            out["rss_after_trim"] = rss()
        print(json.dumps(out), flush=True)
    await server.stop(0.5)

from rmqfast.grpcfront.server import loop_factory
with asyncio.Runner(loop_factory=loop_factory()) as runner:  # uvloop, as the front runs
    runner.run(main())
"""


async def _client(pb: Any, port: int, i: int, hold: asyncio.Event) -> None:
    import grpc

    # a subchannel pool of its own: channels to one target would share one connection otherwise
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        hb = ch.unary_unary(SVC + "Heartbeat", request_serializer=pb.HeartbeatRequest.SerializeToString,
                            response_deserializer=pb.HeartbeatResponse.FromString)
        tel = ch.stream_stream(SVC + "Telemetry", request_serializer=pb.TelemetryCommand.SerializeToString,
                               response_deserializer=pb.TelemetryCommand.FromString)
        call = tel(metadata=(("x-mq-client-id", f"bench-{i}"),))
        cmd = pb.TelemetryCommand()
        cmd.settings.client_type = pb.ClientType.PRODUCER
        cmd.settings.publishing.SetInParent()
        await call.write(cmd)
        await call.read()
        await hb(pb.HeartbeatRequest(group=pb.Resource(name=f"G{i}")), timeout=30)
        await hold.wait()
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass


async def run(conns: int, wave: int, rounds: int, trace: bool) -> dict[str, Any]:
    from rmqfast.grpcfront import protos

    pb = protos.load()
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", CHILD, "1" if trace else "0",
                                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdin is not None and child.stdout is not None

    async def ask(cmd: str) -> dict[str, Any]:
        child.stdin.write(cmd.encode() + b"\n")  # type: ignore[union-attr]
        await child.stdin.drain()  # type: ignore[union-attr]
        return json.loads(await child.stdout.readline())  # type: ignore[union-attr,no-any-return]

    port = json.loads(await child.stdout.readline())["port"]

    async def wave_of(n: int, start: int) -> dict[str, Any]:
        hold = asyncio.Event()
        tasks = [asyncio.create_task(_client(pb, port, start + k, hold)) for k in range(n)]
        for _ in range(600):  # all open at once (within 30 s): the high-water mark
            if (await ask("peek"))["conns"] >= n:
                break
            await asyncio.sleep(0.05)
        peak = await ask("peek")
        hold.set()
        await asyncio.gather(*tasks)
        return peak

    async def drained(trims: int) -> dict[str, Any]:
        """All connections gone, and the server's sweep (every 5 s) trimmed after the last of them
        closed (a trim sets the peak to the connections then open)."""
        for _ in range(300):
            snap = await ask("after")
            if not snap["conns"] and snap["trims"] > trims and not snap["peak"]:
                break
            await asyncio.sleep(0.05)
        return snap

    await wave_of(min(wave, 50), 0)  # warm-up: imports, the loop's and grpc's first allocations
    await drained(-1)
    out: dict[str, Any] = {"conns_per_round": conns, "wave": wave, "base": await ask("base"), "rounds": []}
    done = 0
    for _ in range(rounds):
        peak = None
        for start in range(0, conns, wave):
            peak = await wave_of(min(wave, conns - start), done + start)
        done += conns
        out["rounds"].append({"peak_wave": peak, "after": await drained(peak["trims"] if peak else -1)})
    out["trim"] = await ask("trim")
    child.stdin.close()
    await child.wait()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="grpc_conn_memory")
    ap.add_argument("--conns", type=int, default=1500)
    ap.add_argument("--wave", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--trace", action="store_true")
    a = ap.parse_args(argv)
    print(json.dumps(asyncio.run(run(a.conns, a.wave, a.rounds, a.trace)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
