"""Worker memory under hostile traffic: many connections each send part of a big policy frame.

Starts ``rmqfast serve`` (one worker) in front of a stand-in name server and reads the worker's
VmRSS (/proc) before, during and after rounds of N connections that each send the head and the
first K bytes of an UPDATE_NAMESRV_CONFIG (318) frame claiming ~15 MiB.  The admin-code filter
reads such a frame whole, so the relay must hold it: before proxy.buffer_budget, each one grew a
buffer to the whole frame.

* round "close": the connections close themselves after sending;
* round "stall": they stay open and silent until proxy.frame_timeout closes them.

    .venv/bin/python bench/relay_memory.py [--connections 200] [--sent 1048576]
        [--budget 67108864] [--frame-timeout 3] [--rounds 3]

Prints one line per measurement and a JSON summary.  A measurement, not a test (no asserts).
"""

from __future__ import annotations

import argparse
import json
import socket
import time

from rmqfast.bench.procfs import memory_kib
from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand, encode
from rmqfast.testing.proxy import ProxyProcess
from rmqfast.testing.standins import FakeNameServer
from rmqfast.testing.wire import read_frame

UPDATE_NAMESRV_CONFIG = 318


def rss_kib(pid: int) -> int:
    rss = memory_kib(pid).get("VmRSS")
    if rss is None:
        raise RuntimeError(f"no VmRSS for pid {pid} (has the worker exited?)")
    return rss


def roundtrips(port: int, n: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        for i in range(n):
            s.sendall(encode(RemotingCommand(code=C.GET_KV_CONFIG, opaque=i,
                                             ext_fields={"namespace": "NS", "key": f"k{i}"})))
            assert read_frame(s) is not None


def active(proxy: ProxyProcess) -> int:
    return int(sum(v for (name, _labels), v in proxy.metrics().items() if name == "rmqfast_connections_active"))


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def attack(port: int, n: int, sent: int, frame: bytes) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        try:
            s.sendall(frame[:sent])
        except OSError:  # closed by the proxy (budget): that is the point
            pass
        socks.append(s)
    return socks


def closed_by_proxy(socks: list[socket.socket]) -> int:
    n = 0
    for s in socks:
        s.setblocking(False)
        try:
            if s.recv(1) == b"":
                n += 1
        except BlockingIOError:
            pass
        except OSError:
            n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=200)
    ap.add_argument("--sent", type=int, default=1 << 20, help="bytes of the big frame each connection sends")
    ap.add_argument("--budget", type=int, default=64 << 20, help="proxy.buffer_budget (0: leave it out)")
    ap.add_argument("--frame-timeout", type=float, default=3.0, help="proxy.frame_timeout (<0: leave it out)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="close,stall", help="rounds to run: close, stall (stall needs frame_timeout)")
    args = ap.parse_args()

    srv = FakeNameServer()
    proxy = ProxyProcess([srv.addr], workers=1)
    extra = f"frame_timeout = {args.frame_timeout}\n" if args.frame_timeout >= 0 else ""
    if args.budget:
        extra += f"buffer_budget = {args.budget}\n"
    text = proxy.config_path.read_text()
    proxy.config_path.write_text(text.replace("drain_timeout = 5\n", "drain_timeout = 5\n" + extra, 1))
    frame = encode(RemotingCommand(code=UPDATE_NAMESRV_CONFIG, opaque=1, body=b"k=v\n" * (15 << 18)))
    results: list[dict[str, object]] = []
    with proxy.start():
        (pid,) = proxy.worker_pids()
        port = proxy.namesrv_port
        roundtrips(port, 200)
        base = rss_kib(pid)
        print(f"worker {pid}: baseline after 200 round trips: {base / 1024:.1f} MiB")
        for r in range(args.rounds):
            for mode in args.modes.split(","):
                t0 = time.monotonic()
                socks = attack(port, args.connections, args.sent, frame)
                time.sleep(0.5)  # let the worker take in what was sent (measurement only)
                during = rss_kib(pid)
                refused = closed_by_proxy(socks)
                if mode == "close":
                    for s in socks:
                        s.close()
                wait_for(lambda: active(proxy) == 0, 60, "connections to end")
                for s in socks:
                    s.close()
                roundtrips(port, 50)
                after = rss_kib(pid)
                row = {"round": r, "mode": mode, "connections": args.connections, "sent_each": args.sent,
                       "rss_during_mib": round(during / 1024, 1), "rss_after_mib": round(after / 1024, 1),
                       "closed_by_budget_before_measure": refused, "seconds": round(time.monotonic() - t0, 1)}
                results.append(row)
                print(f"round {r} {mode:5}: during {during / 1024:6.1f} MiB, after {after / 1024:6.1f} MiB "
                      f"({refused} connections already closed by the proxy when measured)")
    srv.close()
    print(json.dumps({"baseline_mib": round(base / 1024, 1), "budget": args.budget,
                      "frame_timeout": args.frame_timeout, "rounds": results}))


if __name__ == "__main__":
    main()
