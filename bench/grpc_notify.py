"""False-empty receives of a RocketMQ 5 SimpleConsumer through rmqfast's gRPC front, with and
without pop with notify.

Two real RocketMQ 5.3.3 masters (one name server) hold the topic.  Two ``rmqfast serve`` (1 worker
each) run the gRPC front: ``notify`` (pop with notify) and ``single`` (``[grpc] notify = false``:
one pop long-polling on the broker the receive names, as Apache's proxy does); ``apache`` is
Apache's ``rocketmq-proxy`` 5.3.3 (cluster mode, its gRPC port) in front of the same brokers.
One real Python 5.x SimpleConsumer per proxy (``--consumers N``: N of them sharing the proxy's
group; each proxy has its own group, so each sees every message) receives in a loop with a 20 s
long poll (the client names its assignments' brokers in turn) and acks.  A producer sends one
message every ``--interval`` seconds straight to a random broker (Remoting).

Printed per mode: receives, empty receives, false empties (an empty answer while a message sent
before the receive started was not yet received by a consumer of the group), send-to-receive latency p50/p90/p99
and max, and the same from the broker's send answer (``stored_*``: the part the proxy and the broker's
wake-up and pop can influence; the time the broker takes to store the message is left out).  A
measurement, not a test::

    .venv/bin/python bench/grpc_notify.py [--messages 20] [--interval 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import threading
import time
import uuid

import grpc

from rmqfast.bench.failover import TOPIC, two_masters
from rmqfast.codec import codes as C
from rmqfast.grpcfront.convert import send_header
from rmqfast.grpcfront.upstream import Pool
from rmqfast.testing import ensure_jars
from rmqfast.testing.apacheproxy import ApacheProxy
from rmqfast.testing.ports import reserve
from rmqfast.testing.proxy import ProxyProcess

LONG_POLL = 20


class Consumer(threading.Thread):
    """The real Python 5.x SimpleConsumer (``rocketmq-python-client``): receive with a 20 s long poll, ack."""

    def __init__(self, addr: str, group: str, sent: dict[str, float], got: dict[str, float]) -> None:
        super().__init__(daemon=True)
        self.addr, self.group, self.sent = addr, group, sent
        self.got = got  # shared by the consumers of the group
        self.receives = self.empty = self.false_empty = self.errors = 0
        self.error_kinds: dict[str, int] = {}
        self.stop = False
        self.ready = threading.Event()

    def run(self) -> None:
        from rocketmq import ClientConfiguration, Credentials, FilterExpression, SimpleConsumer

        consumer = SimpleConsumer(ClientConfiguration(self.addr, Credentials()), self.group,
                                  {TOPIC: FilterExpression()}, await_duration=LONG_POLL)
        consumer.startup()
        self.ready.set()
        try:
            while not self.stop:
                started = time.time()
                waiting_before = {b for b, t in self.sent.items() if t < started} - set(self.got)
                try:
                    msgs = consumer.receive(16, 30) or []
                except Exception as exc:  # counted, by kind (e.g. the client's deadline passed)
                    self.errors += 1
                    kind = f"{type(exc).__name__}: {str(exc)[:80]}"
                    self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1
                    continue
                now = time.time()
                self.receives += 1
                if not msgs:
                    self.empty += 1
                    if waiting_before - set(self.got):
                        self.false_empty += 1
                    continue
                for m in msgs:
                    self.got.setdefault(m.body.decode(), now)
                    consumer.ack(m)
        finally:
            consumer.shutdown()


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


async def produce(addrs: dict[str, str], n: int, interval: float, sent: dict[str, float], run: str,
                  stored: dict[str, float]) -> None:
    pool = Pool()
    rng = random.Random(7)
    try:
        for i in range(n):
            broker = rng.choice(sorted(addrs))
            body = f"{run}-{i}"
            ext = send_header(TOPIC, broker, rng.randrange(4), {"UNIQ_KEY": uuid.uuid4().hex.upper()}, 0,
                              int(time.time() * 1000), "bench", 0)
            sent[body] = time.time()
            r = await pool.request(addrs[broker], C.SEND_MESSAGE_V2, ext, body.encode(), timeout=10)
            assert r.code == 0, (r.code, r.remark)
            stored[body] = time.time()
            await asyncio.sleep(interval * rng.uniform(0.5, 1.5))
    finally:
        await pool.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=20)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--no-apache", action="store_true", help="without Apache's proxy (rocketmq-proxy 5.3.3)")
    ap.add_argument("--consumers", type=int, default=1, help="consumers per group (each its own client)")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        a, b = two_masters(ensure_jars(), stack)
        addrs = {a.broker_name: a.broker_addr, b.broker_name: b.broker_addr}
        fronts = {}
        proxies: dict[str, ProxyProcess] = {}
        for mode, notify in (("notify", "true"), ("single", "false")):
            lease = reserve([0])
            stack.callback(lease.release)
            extra = f'\n[grpc]\nenabled = true\nnotify = {notify}\nlisten = "127.0.0.1:{lease.base}"\n'
            proxies[mode] = stack.enter_context(ProxyProcess([a.namesrv_addr], workers=1, extra_config=extra))
            ch = grpc.insecure_channel(f"127.0.0.1:{lease.base}")
            grpc.channel_ready_future(ch).result(timeout=60)
            ch.close()
            fronts[mode] = f"127.0.0.1:{lease.base}"
        if not args.no_apache:
            apx = stack.enter_context(ApacheProxy(a.namesrv_addr, cluster_name=a.cluster_name))
            fronts["apache"] = apx.grpc_addr
        run = uuid.uuid4().hex[:8]
        sent: dict[str, float] = {}
        stored: dict[str, float] = {}
        got: dict[str, dict[str, float]] = {m: {} for m in fronts}
        consumers = {m: [Consumer(addr, f"bench_{m}_{run}", sent, got[m]) for _ in range(args.consumers)]
                     for m, addr in fronts.items()}
        for c in (c for cs in consumers.values() for c in cs):
            c.start()
        for c in (c for cs in consumers.values() for c in cs):
            c.ready.wait(120)
        time.sleep(3)  # the groups' first receives (subscriptions made) before the first message
        asyncio.run(produce(addrs, args.messages, args.interval, sent, run, stored))
        deadline = time.time() + LONG_POLL + 10
        while time.time() < deadline and any(len(g) < len(sent) for g in got.values()):
            time.sleep(0.2)
        out = {}
        for m, cs in consumers.items():
            for c in cs:
                c.stop = True
            kinds: dict[str, int] = {}
            for c in cs:
                for k, v in c.error_kinds.items():
                    kinds[k] = kinds.get(k, 0) + v
            g = got[m]
            lat = [(g[k] - sent[k]) * 1000 for k in sent if k in g]
            from_stored = [(g[k] - stored[k]) * 1000 for k in sent if k in g]
            out[m] = {"messages": len(sent), "consumers": len(cs), "received": len(g),
                      "receives": sum(c.receives for c in cs), "empty": sum(c.empty for c in cs),
                      "errors": sum(c.errors for c in cs), "error_kinds": kinds,
                      "false_empty": sum(c.false_empty for c in cs), "latency_ms_p50": round(pct(lat, 50), 1),
                      "latency_ms_p90": round(pct(lat, 90), 1), "latency_ms_p99": round(pct(lat, 99), 1),
                      "latency_ms_max": round(max(lat, default=0), 1),
                      "stored_ms_p50": round(pct(from_stored, 50), 1), "stored_ms_p90": round(pct(from_stored, 90), 1),
                      "stored_ms_p99": round(pct(from_stored, 99), 1), "load_average": os.getloadavg()[0]}
            print(f"{m:7s} {json.dumps(out[m])}", flush=True)
        for m, p in proxies.items():  # the fronts' counters, logged when they stop
            p.stop()
            for line in p.log_path.read_text(errors="replace").splitlines():
                if "gRPC front stats" in line:
                    print(f"{m:7s} {line.strip()[:400]}", flush=True)


if __name__ == "__main__":
    main()
