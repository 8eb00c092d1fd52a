"""Many mostly idle client connections through one proxy worker: memory per connection and setup rate.

``rmqfast bench --idle`` (or ``python -m rmqfast.bench --idle``) starts the null broker, HAProxy
(``mode tcp``, one thread) and rmqfast with ONE worker in front of it, raises this process's
open-files limit (two descriptors per relayed connection in the proxy, one in the client and the
null broker: the children inherit it), and per target:

1. **setup**: opens ``--conns`` connections (default 10,000), at most ``--concurrency`` being set
   up at once; a connection counts as set up when its first request (HEART_BEAT) is answered, so
   the proxy's accept, its upstream connect and one relayed round trip are all in it.  Reports
   connects/s and the setup latency percentiles;
2. **idle**: holds them all open for ``--hold`` seconds, each sending one HEART_BEAT every
   ``--interval`` seconds (spread evenly), and reports the answers' latency;
3. **memory and CPU**: the proxy's CPU per connection set up and the cores it uses while the
   connections idle; the worker's RSS before the connections and while they are all open (the
   proxy's process for HAProxy), and the bytes per connection that makes.

The client is this Python process (epoll, non-blocking sockets); the ``direct`` target (straight to
the null broker) shows what the client itself can set up, the ceiling of the setup rate.
"""

from __future__ import annotations

import argparse
import errno
import json
import resource
import select
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rmqfast.bench.cbuild import build_tools
from rmqfast.bench.common import DEFAULT_RESULTS_DIR, guarded, now_iso, results_file
from rmqfast.bench.haproxy import HAProxyTarget, ensure_haproxy
from rmqfast.bench.nullbroker import NullBroker
from rmqfast.bench.procfs import memory_kib, total_cpu, wait_idle
from rmqfast.bench.targets import DirectTarget, RmqfastTarget, Target
from rmqfast.codec.command import RemotingCommand, encode

HEART_BEAT = 34
GOAL_RSS_MIB = 64
LABEL = "bench --idle"


def raise_nofile(need: int) -> tuple[int, int]:
    """Raises this process's RLIMIT_NOFILE to at least ``need`` (the hard limit too, when privileged);
    returns the (soft, hard) limit in force afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = resource.RLIM_INFINITY
    if hard != inf and hard < need:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, need))
            return need, need
        except (ValueError, OSError):
            pass  # unprivileged: up to the hard limit only
    new_soft = need if hard == inf else min(max(soft, need), hard)
    if new_soft != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


class _Conn:
    __slots__ = ("buf", "due", "sent_at", "sock", "state")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.state = 0  # 0 connecting, 1 awaiting the first answer, 2 idle, 3 awaiting an answer
        self.sent_at = 0.0
        self.due = 0.0


def _frame(opaque: int) -> bytes:
    return encode(RemotingCommand(code=HEART_BEAT, version=435, opaque=opaque, body=b"{}"))


def _answered(c: _Conn) -> bool:
    """Reads what is there; True once a whole frame arrived (the connection expects just one)."""
    while True:
        try:
            data = c.sock.recv(65536)
        except BlockingIOError:
            break
        if not data:
            raise ConnectionError("closed by the peer")
        c.buf += data
    if len(c.buf) >= 4 and len(c.buf) >= 4 + int.from_bytes(c.buf[:4], "big"):
        c.buf = c.buf[4 + int.from_bytes(c.buf[:4], "big"):]
        return True
    return False


def _pct(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    xs = sorted(xs)
    return {k: round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 3) for k, q in (("p50", 0.5), ("p99", 0.99))} | \
        {"max": round(xs[-1] * 1000, 3)}


class _Client:
    """The epoll client of :func:`open_idle`: its connections, latencies and errors."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.ep = select.epoll()
        self.conns: dict[int, _Conn] = {}
        self.frame = _frame(1)
        self.setup_lat: list[float] = []
        self.idle_lat: list[float] = []
        self.errors: list[str] = []

    def fail(self, c: _Conn, why: str) -> None:
        self.errors.append(why)
        self.ep.unregister(c.sock.fileno())
        self.conns.pop(c.sock.fileno(), None)
        c.sock.close()

    def connect(self) -> bool:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        err = s.connect_ex(("127.0.0.1", self.port))
        if err not in (0, errno.EINPROGRESS):
            s.close()
            self.errors.append(f"connect: {errno.errorcode.get(err, err)}")
            return False
        c = _Conn(s)
        c.sent_at = time.monotonic()
        self.conns[s.fileno()] = c
        self.ep.register(s.fileno(), select.EPOLLOUT)
        return True

    def setup_event(self, c: _Conn, ev: int) -> bool:
        """Moves a connection being set up on; True when it is done (set up or failed)."""
        try:
            if c.state == 0:
                if ev & (select.EPOLLERR | select.EPOLLHUP):
                    code = c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    raise ConnectionError(errno.errorcode.get(code, "refused"))
                c.sock.send(self.frame)
                c.state = 1
                self.ep.modify(c.sock.fileno(), select.EPOLLIN)
                return False
            if _answered(c):
                self.setup_lat.append(time.monotonic() - c.sent_at)
                c.state = 2
                return True
            return False
        except OSError as exc:
            self.fail(c, f"setup: {exc}")
            return True

    def setup(self, n: int, concurrency: int) -> float:
        """Sets up ``n`` connections, ``concurrency`` at a time; the seconds it took."""
        started = pending = 0
        t0 = time.monotonic()
        while len(self.setup_lat) + len(self.errors) < n:
            while started < n and pending < concurrency:
                started += 1
                pending += self.connect()
            for fd, ev in self.ep.poll(1.0):
                pending -= self.setup_event(self.conns[fd], ev)
            if time.monotonic() - t0 > 600:
                raise RuntimeError(f"setup of {n} connections did not finish in 600 s ({len(self.setup_lat)} set up)")
        return time.monotonic() - t0

    def send_due(self, order: list[_Conn], nxt: int, now: float, interval: float) -> int:
        while order[nxt % len(order)].due <= now:
            c = order[nxt % len(order)]
            nxt += 1
            c.due += interval
            if c.state != 2:
                continue
            try:
                c.sock.send(self.frame)
                c.sent_at = now
                c.state = 3
            except OSError as exc:
                self.fail(c, f"idle send: {exc}")
        return nxt

    def hold(self, interval: float, hold: float) -> None:
        """One HEART_BEAT per connection every ``interval`` s, spread over the interval, for ``hold`` s."""
        t1 = time.monotonic()
        order = list(self.conns.values())
        if not order:
            return
        for i, c in enumerate(order):
            c.due = t1 + interval * i / len(order)
        nxt = 0
        end = t1 + hold
        while (now := time.monotonic()) < end:
            nxt = self.send_due(order, nxt, now, interval)
            wait = max(0.0, min(end, order[nxt % len(order)].due) - time.monotonic())
            for fd, _ev in self.ep.poll(wait):
                c = self.conns.get(fd)
                if c is None:
                    continue
                try:
                    if _answered(c) and c.state == 3:
                        self.idle_lat.append(time.monotonic() - c.sent_at)
                        c.state = 2
                except OSError as exc:
                    self.fail(c, f"idle: {exc}")

    def close(self) -> None:
        for c in list(self.conns.values()):
            c.sock.close()
        self.ep.close()


def open_idle(port: int, n: int, *, concurrency: int, interval: float, hold: float,
              at_peak: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Sets up ``n`` connections to 127.0.0.1:``port`` and holds them (see the module doc);
    ``at_peak`` is called once all are set up and again at the end of the hold (memory samples)."""
    cl = _Client(port)
    try:
        setup_s = cl.setup(n, concurrency)
        peak = at_peak()
        cl.hold(interval, hold)
        end_sample = at_peak()
    finally:
        cl.close()
    return {
        "conns": n, "set_up": len(cl.setup_lat), "errors": len(cl.errors), "error_samples": cl.errors[:5],
        "setup_s": round(setup_s, 3), "connects_per_s": round(len(cl.setup_lat) / setup_s, 1) if setup_s else 0.0,
        "setup_lat_ms": _pct(cl.setup_lat), "idle_requests": len(cl.idle_lat), "idle_lat_ms": _pct(cl.idle_lat),
        "idle_req_per_s": round(len(cl.idle_lat) / hold, 1), "peak": peak, "end": end_sample,
    }


class _IdleHAProxy(HAProxyTarget):
    """HAProxy allowed as many connections as the run opens (the shared target caps it at 10,000)."""

    conns = 10000

    def maxconn(self) -> int:  # type: ignore[override]
        return self.conns + 100


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="rmqfast bench --idle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--conns", type=int, default=10000, help="connections (default 10000)")
    ap.add_argument("--concurrency", type=int, default=256, help="connections being set up at once (default 256)")
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between a connection's requests (10)")
    ap.add_argument("--hold", type=float, default=20.0, help="seconds the connections are held open (default 20)")
    ap.add_argument("--targets", default="direct,haproxy-1t,rmqfast", help="comma-separated (default: all three)")
    ap.add_argument("--short", action="store_true", help="2,000 connections held 5 s")
    ap.add_argument("--no-install", action="store_true", help="do not apt-get install haproxy when it is missing")
    ap.add_argument("--results", type=Path, default=DEFAULT_RESULTS_DIR, help="results folder (default results/bench)")
    args = ap.parse_args(argv)
    if args.short:
        args.conns, args.hold = 2000, 5.0
    if args.conns < 1 or args.concurrency < 1 or args.interval <= 0 or args.hold <= 0:
        ap.error("--conns and --concurrency must be >= 1, --interval and --hold > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    return guarded(LABEL, lambda: _run(args))


def _targets(args: argparse.Namespace, broker: NullBroker) -> list[Target]:
    out: list[Target] = []
    for name in args.targets.split(","):
        if name == "direct":
            out.append(DirectTarget(broker))
        elif name == "rmqfast":
            # its worker takes every connection the open-files limit fits (the default cap keeps a
            # tenth of the limit in reserve, and would refuse some of them)
            out.append(RmqfastTarget(broker.port, workers=1, pure=False, name="rmqfast",
                                     max_connections=args.conns + 16))
        elif name.startswith("haproxy"):
            exe = ensure_haproxy(install=not args.no_install)
            if exe is None:
                print(f"{LABEL}: no HAProxy, skipping it", file=sys.stderr)
                continue
            t = _IdleHAProxy(exe, broker.port, 1, name)
            t.conns = args.conns
            out.append(t)
        else:
            raise SystemExit(f"{LABEL}: unknown target {name!r}")
    return out


def _memory(t: Target) -> dict[str, Any]:
    pids = t.worker_pids() if isinstance(t, RmqfastTarget) else t.pids()
    mem = [memory_kib(p) for p in pids]
    return {"rss_kib": sum(m.get("VmRSS", 0) for m in mem), "pids": pids}


def _run(args: argparse.Namespace) -> int:
    soft, hard = raise_nofile(2 * args.conns + 1024)
    fit = (soft - 300) // 2  # a relaying proxy holds two descriptors per connection (HAProxy: maxconn + 100)
    if args.conns > fit:
        print(f"{LABEL}: WARNING: the open-files limit ({soft}, hard {hard}; raising it is not allowed here) "
              f"lets a proxy relay {fit:,} connections, not {args.conns:,}: running with {fit:,}", file=sys.stderr)
        args.conns = fit
    print(f"{LABEL}: open-files limit {soft} (hard {hard}); {args.conns:,} connections per target", file=sys.stderr)
    tools = build_tools(None)
    run_id, path, common = results_file(args.results, "idle", "idle-conns")
    rows = []
    with open(path, "a") as out, NullBroker(tools) as broker:
        for t in _targets(args, broker):
            print(f"{LABEL}: {t.name} ...", file=sys.stderr, flush=True)
            t.start()
            try:
                wait_idle(t.pids() + broker.pids)
                before = _memory(t)
                cpu = [sum(total_cpu(t.pids()))]  # at the start, all set up, end of the hold

                def sample(t: Target = t, cpu: list[float] = cpu) -> dict[str, Any]:
                    cpu.append(sum(total_cpu(t.pids())))
                    return _memory(t)

                res = open_idle(t.port, args.conns, concurrency=args.concurrency, interval=args.interval,
                                hold=args.hold, at_peak=sample)
                res["proxy_cpu_s"] = round(cpu[-1] - cpu[0], 3)
                res["setup_cpu_us_per_conn"] = round((cpu[1] - cpu[0]) * 1e6 / res["set_up"], 1) \
                    if res["set_up"] and t.pids() else None
                res["idle_cpu_cores"] = round((cpu[2] - cpu[1]) / args.hold, 3) if t.pids() else None
            finally:
                t.stop()
            peak = max(res["peak"]["rss_kib"], res["end"]["rss_kib"])
            row = {**common, "ts": now_iso(), "kind": "idle", "target": t.name, **res,
                   "rss_before_kib": before["rss_kib"], "rss_peak_kib": peak,
                   "bytes_per_conn": round((peak - before["rss_kib"]) * 1024 / res["set_up"])
                   if res["set_up"] else None}
            out.write(json.dumps(row) + "\n")
            out.flush()
            rows.append(row)
            print(f"  {t.name:<11} {res['connects_per_s']:>8,.0f} connects/s  set up {res['set_up']:,} "
                  f"errors {res['errors']}  RSS {peak / 1024:,.1f} MiB", file=sys.stderr, flush=True)
    print()
    print(render(rows, args))
    print(f"\nresults: {path}")
    return 1 if any(r["errors"] or r["set_up"] < args.conns for r in rows) else 0


def render(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"{args.conns:,} connections to one proxy worker (rmqfast: 1 worker; HAProxy: 1 thread), set up "
             f"{args.concurrency} at a time (connect + first HEART_BEAT answered), then held {args.hold:g} s with one "
             f"HEART_BEAT per connection every {args.interval:g} s; RSS: rmqfast's worker, HAProxy's process", ""]
    head = (f"{'target':<11} {'connects/s':>10} {'setup p99 ms':>12} {'CPU us/conn':>11} {'idle p99 ms':>11} "
            f"{'idle cores':>10} {'RSS MiB':>8} {'bytes/conn':>10} {'errors':>6}")
    lines += [head, "-" * len(head)]
    for r in rows:
        rss = "-" if r["target"] == "direct" else f"{r['rss_peak_kib'] / 1024:,.1f}"
        bpc = "-" if r["target"] == "direct" or r["bytes_per_conn"] is None else f"{r['bytes_per_conn']:,}"
        cpu = "-" if r.get("setup_cpu_us_per_conn") is None else f"{r['setup_cpu_us_per_conn']:,.0f}"
        idle = "-" if r.get("idle_cpu_cores") is None else f"{r['idle_cpu_cores']:.3f}"
        lines.append(f"{r['target']:<11} {r['connects_per_s']:>10,.0f} {r['setup_lat_ms'].get('p99', 0):>12.2f} "
                     f"{cpu:>11} {r['idle_lat_ms'].get('p99', 0):>11.2f} {idle:>10} {rss:>8} {bpc:>10} "
                     f"{r['errors']:>6}")
    by = {r["target"]: r for r in rows}
    rq, hp = by.get("rmqfast"), next((r for r in rows if r["target"].startswith("haproxy")), None)
    lines.append("")
    if rq and hp and hp["connects_per_s"]:
        lines.append(f"rmqfast / HAProxy: connection setup rate {rq['connects_per_s'] / hp['connects_per_s']:.3f}")
        if rq.get("setup_cpu_us_per_conn") and hp.get("setup_cpu_us_per_conn"):
            lines.append(f"rmqfast / HAProxy: connections set up per proxy core "
                         f"{hp['setup_cpu_us_per_conn'] / rq['setup_cpu_us_per_conn']:.3f} (CPU per connection "
                         f"{rq['setup_cpu_us_per_conn']:,.0f} us vs {hp['setup_cpu_us_per_conn']:,.0f} us)")
    if rq:
        mib = rq["rss_peak_kib"] / 1024
        verdict = "meets" if mib <= GOAL_RSS_MIB else "misses"
        lines.append(f"rmqfast worker RSS with {rq['set_up']:,} connections: {mib:,.1f} MiB ({verdict} the "
                     f"{GOAL_RSS_MIB} MiB goal), {rq['bytes_per_conn'] or 0:,} bytes per connection")
    return "\n".join(lines)
