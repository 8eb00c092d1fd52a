"""Proxy-held delayed messages: capacity, accept rate and release lateness.

Three measurements (a measurement, not a test: no asserts)::

    .venv/bin/python bench/delay_bench.py [--pending 1000000] [--release-rate 10000] [--release-seconds 20]

1. **Capacity.** ``--pending`` delayed 1 KiB messages (due in a day) are written into a worker's
   store directory the way the filter writes them (group commits of 512 synced puts), then the
   disk used (``du`` of the RocksDB directory) and the bytes the store counts are printed.
2. **Worker with that store.** ``rmqfast serve`` (1 worker) starts on that state directory in front
   of the null broker: the worker's RSS with all of it pending (it opens the store without a scan),
   then the accept rate of plain and delayed 1 KiB sends through it, alternating, from the same
   Python client (``--conns`` connections x ``--inflight`` pipelined sends), then the RSS again.
3. **Release lateness.** In this process (gevent, one store, one releaser, like a worker), messages
   due at ``--release-rate`` per second for ``--release-seconds`` are stored first, then released
   to the null broker as they fall due; lateness = the broker's SUCCESS for the release minus the
   due time: p50 / p99 / max, and the release rate reached.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gevent

from rmqfast.bench.cbuild import build_tools
from rmqfast.bench.nullbroker import NullBroker
from rmqfast.bench.procfs import children
from rmqfast.codec.command import RemotingCommand, decode_frame, encode
from rmqfast.spill.record import CopyRecord
from rmqfast.testing.ports import reserve

#: (figure, measured, goal) rows printed side by side at the end
SUMMARY: list[tuple[str, str, str]] = []
GOAL_PENDING = 10_000_000
GOAL_RSS_MB = 64
GOAL_RATE = 10_000
GOAL_P99_MS = 50


def verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def print_summary() -> None:
    if not SUMMARY:
        return
    w0 = max(len(r[0]) for r in SUMMARY)
    w1 = max(len(r[1]) for r in SUMMARY)
    print(f"\nsummary (load average {os.getloadavg()[0]:.1f} at the end):")
    print(f"  {'figure':<{w0}}  {'measured':<{w1}}  goal")
    for what, got, goal in SUMMARY:
        print(f"  {what:<{w0}}  {got:<{w1}}  {goal}")


def rss_mb(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0




def du_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fill(store_dir: Path, n: int, body: int, due_base: int, step_us: float, addr: str) -> tuple[float, int, int]:
    """Write n held messages (due_base + i * step_us); (seconds, store bytes, messages)."""
    from rmqfast.delay.store import DelayStore, Held
    from rmqfast.spill.store import SpillStore

    spill = SpillStore(store_dir)
    st = DelayStore(spill.db, max_pending_bytes=1 << 50, path=str(store_dir))
    t0 = time.monotonic()
    i = 0
    while i < n:
        batch = None
        for _ in range(min(512, n - i)):
            uniq = f"{os.getpid():08X}{i:024X}"
            props = f"KEYS\x01k{i}\x02UNIQ_KEY\x01{uniq}\x02"
            # incompressible bodies, as real payloads may be
            rec = CopyRecord(topic="Delayed", body=os.urandom(body), properties=props, queue_id=i % 4, broker_name="b",
                             producer_group="PG", created_ms=int(time.time() * 1000))
            _k, batch = st.put(Held(addr, uniq, f"k{i}", rec), due_base + int(i * step_us / 1000))
            i += 1
        assert batch is not None
        st.wait(batch)
        if i % 500_000 < 512:
            print(f"  filled {i:,} in {time.monotonic() - t0:.0f} s", flush=True)
    secs = time.monotonic() - t0
    out = (secs, st.bytes, st.messages)
    st.close()
    spill.close()
    return out


def send_frame(topic: str, opaque: int, uniq: str, delay_at: int | None, body: bytes) -> bytes:
    props = f"KEYS\x01k{opaque}\x02UNIQ_KEY\x01{uniq}\x02" + (f"TIMER_DELIVER_MS\x01{delay_at}\x02" if delay_at else "")
    ext = {"a": "PG", "b": topic, "c": "TBW102", "d": "4", "e": str(opaque % 4), "f": "0",
           "g": str(int(time.time() * 1000)), "h": "0", "i": props, "j": "0", "k": "false", "l": "16", "m": "false",
           "n": "b"}
    return encode(RemotingCommand(code=310, opaque=opaque, version=473, ext_fields=ext, body=body))


def client(port: int, topic: str, delayed: bool, seconds: float, inflight: int, body: int, out: list[int]) -> None:
    """One connection, ``inflight`` sends pipelined, for ``seconds``: answers counted into out."""
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = os.urandom(body)
    at = int(time.time() * 1000) + 86_400_000
    op = 0
    buf = b""
    end = time.monotonic() + seconds
    done = 0
    base = f"{id(out) & 0xFFFFFF:06X}{port:05d}{int(delayed)}"

    def one() -> bytes:
        nonlocal op
        op += 1
        return send_frame(topic, op, f"{base}{op:020X}", at if delayed else None, payload)

    s.sendall(b"".join(one() for _ in range(inflight)))
    sent, answered = inflight, 0
    while True:
        chunk = s.recv(1 << 20)
        if not chunk:
            break
        buf += chunk
        got = 0
        while len(buf) >= 4:
            (n,) = struct.unpack_from(">i", buf)
            if len(buf) < 4 + n:
                break
            cmd = decode_frame(buf[: 4 + n])
            buf = buf[4 + n :]
            done += cmd.code == 0
            got += 1
        answered += got
        if time.monotonic() < end:
            if got:
                s.sendall(b"".join(one() for _ in range(got)))
                sent += got
        elif answered >= sent:
            break
    s.close()
    out.append(done)


def accept_rate(port: int, delayed: bool, seconds: float, conns: int, inflight: int, body: int) -> float:
    out: list[int] = []
    t0 = time.monotonic()
    gs = [gevent.spawn(client, port, "Delayed", delayed, seconds, inflight, body, out) for _ in range(conns)]
    gevent.joinall(gs)
    return sum(out) / (time.monotonic() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pending", type=int, default=1_000_000)
    ap.add_argument("--body", type=int, default=1024)
    ap.add_argument("--release-rate", type=int, default=10_000)
    ap.add_argument("--release-seconds", type=float, default=20.0)
    ap.add_argument("--conns", type=int, default=8)
    ap.add_argument("--inflight", type=int, default=32)
    ap.add_argument("--accept-seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--queue-window", type=int, default=1,
                    help="release: [delay] queue_window (sends in flight per broker queue)")
    ap.add_argument("--keep", action="store_true", help="keep the state directory")
    ap.add_argument("--reuse", type=Path, default=None,
                    help="phase 2 on the state directory a --keep run filled (the capacity phase is skipped)")
    ap.add_argument("--skip", default="", help="comma-separated phases to skip: capacity,worker,release")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    tools = build_tools()
    work = Path(tempfile.mkdtemp(prefix="rmqfast-delaybench-"))
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; work dir {work}")
    with NullBroker(tools) as nb:
        addr = f"127.0.0.1:{nb.port}"
        state = args.reuse or work / "state"
        wdir = state / "spill" / "worker-0"
        if args.reuse is not None:
            skip.add("capacity")
            args.keep = True
        if "capacity" not in skip:
            print(f"1. capacity: {args.pending:,} pending messages of {args.body} B")
            secs, nbytes, msgs = fill(wdir, args.pending, args.body, int(time.time() * 1000) + 86_400_000,
                                      1.0, addr)
            disk = du_bytes(wdir)
            print(f"   filled at {msgs / secs:,.0f} msg/s ({secs:.0f} s); store counts {nbytes / 2**20:,.0f} MiB; "
                  f"disk {disk / 2**20:,.0f} MiB ({disk / max(1, msgs):,.0f} B per message)")
            print(f"   bench process RSS after the fill: {rss_mb():.0f} MB")
            SUMMARY.append(("pending 1 KiB messages", f"{msgs:,}",
                            f"{GOAL_PENDING:,} ({verdict(msgs >= GOAL_PENDING)})"))
            SUMMARY.append(("disk used", f"{disk / 2**20:,.0f} MiB ({disk / max(1, msgs):,.0f} B/msg)",
                            "disk, not memory"))
        if "worker" not in skip:
            lease = reserve(list(range(16)))
            ns, admin, ep, lo = lease.base, lease.base + 1, lease.base + 4, lease.base + 5  # ep - 2: its VIP channel
            cfg = work / "c.toml"
            cfg.write_text(f"""
[proxy]
workers = 1
state_dir = "{state}"
[namesrv]
listen = "127.0.0.1:{ns}"
upstreams = ["{addr}"]
[brokers]
port_range = "{lo}-{lo + 9}"
[[brokers.static]]
listen = "127.0.0.1:{ep}"
upstream = "{addr}"
[admin]
listen = "127.0.0.1:{admin}"
[delay]
topics = ["Delayed"]
max_pending_bytes = {1 << 45}
[log]
level = "warning"
""")
            t0 = time.monotonic()
            proc = subprocess.Popen([sys.executable, "-m", "rmqfast", "serve", "--config", str(cfg)],
                                    stdout=subprocess.DEVNULL, stderr=open(work / "proxy.log", "wb"))  # noqa: SIM115
            try:
                import urllib.request
                while True:
                    if proc.poll() is not None:
                        raise SystemExit(f"rmqfast serve exited: {(work / 'proxy.log').read_text()[-2000:]}")
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/readyz", timeout=2) as r:
                            if r.status == 200:
                                break
                    except OSError:
                        pass
                    time.sleep(0.1)
                ready = time.monotonic() - t0
                worker = children(proc.pid)[0]
                time.sleep(2)
                rss0 = rss_mb(worker)
                print(f"2. worker with the store: ready in {ready:.1f} s; worker RSS {rss0:.0f} MB")
                rates: dict[bool, list[float]] = {False: [], True: []}
                for r in range(args.rounds):
                    for delayed in ((False, True) if r % 2 == 0 else (True, False)):
                        rate = accept_rate(ep, delayed, args.accept_seconds, args.conns, args.inflight, args.body)
                        rates[delayed].append(rate)
                        print(f"   round {r + 1}: {'delayed' if delayed else 'plain  '} sends {rate:,.0f}/s "
                              f"({args.conns} conns x {args.inflight} in flight)", flush=True)
                rss1 = rss_mb(worker)
                print(f"   worker RSS after the sends: {rss1:.0f} MB")
                SUMMARY.append(("worker RSS, ready / after sends", f"{rss0:.0f} / {rss1:.0f} MB",
                                f"< {GOAL_RSS_MB} MB ({verdict(max(rss0, rss1) < GOAL_RSS_MB)})"))
                SUMMARY.append(("accept rate plain / delayed", f"{max(rates[False]):,.0f} / {max(rates[True]):,.0f}/s",
                                "reported (same run)"))
            finally:
                proc.terminate()
                proc.wait(30)
                lease.release()
            print(f"   disk after: {du_bytes(wdir) / 2**20:,.0f} MiB")
        if not args.keep:
            shutil.rmtree(state, ignore_errors=True)
        if "release" not in skip:
            release(args, addr, work)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print_summary()
    return 0


def release(args: argparse.Namespace, addr: str, work: Path) -> None:
    from rmqfast.delay.service import DelayService
    from rmqfast.delay.settings import parse_delay
    from rmqfast.spill.store import SpillStore

    n = int(args.release_rate * args.release_seconds)
    d = work / "release"
    start = int(time.time() * 1000) + 5000 + int(n / 20)  # after the fill (~20k/s or better)
    secs, _b, _m = fill(d, n, args.body, start, 1e6 / args.release_rate, addr)
    lead = start - int(time.time() * 1000)
    print(f"3. release: {n:,} messages due at {args.release_rate:,}/s over 4 queues, queue_window "
          f"{args.queue_window}, from {lead / 1000:.1f} s on "
          f"(stored at {n / secs:,.0f}/s)")
    if lead < 500:
        print("   the fill took longer than planned: the first messages are already due (lateness includes it)")
    spill = SpillStore(d)
    svc = DelayService(parse_delay({"topics": ["Delayed"], "queue_window": args.queue_window}), spill.db, 0,
                       path=str(d), publish=False)
    svc.start()
    t0 = time.monotonic()
    t0_wall = time.time() * 1000
    c0 = time.process_time()
    while svc.releaser.released + svc.releaser.dropped < n:
        gevent.sleep(0.05)
    end_ms = int(time.time() * 1000)
    took = time.monotonic() - t0
    cpu = time.process_time() - c0
    late = sorted(svc.releaser.lateness_ms)
    k = len(late)
    print(f"   released {svc.releaser.released:,} ({svc.releaser.dropped} dropped) in {took:.1f} s; "
          f"lateness ms p50={late[k // 2]} p99={late[int(k * 0.99)]} max={late[-1]} (of the last {k:,}); "
          f"process RSS {rss_mb():.0f} MB")
    print(f"   CPU of the releasing process: {cpu * 1e6 / max(1, n):.0f} us per release "
          f"(one core: {n / max(cpu, 1e-9):,.0f} releases/s); load average {os.getloadavg()[0]:.1f}")
    # from the first due time to the last release (at least the span the due times cover; the
    # end is polled every 50 ms and the last message is due ~(n-1)/rate after the first: 2% slack)
    reached = n / max(args.release_seconds, (end_ms - max(start, int(t0_wall))) / 1000)
    p99 = late[int(k * 0.99)]
    SUMMARY.append((f"release rate (due at {args.release_rate:,}/s, window {args.queue_window})",
                    f"{reached:,.0f}/s", f"{GOAL_RATE:,}/s ({verdict(reached >= GOAL_RATE * 0.98)})"))
    SUMMARY.append(("lateness p50 / p99 / max", f"{late[k // 2]} / {p99} / {late[-1]} ms",
                    f"p99 < {GOAL_P99_MS} ms at {GOAL_RATE:,}/s "
                    f"({verdict(p99 < GOAL_P99_MS and args.release_rate >= GOAL_RATE)})"))
    svc.close()
    spill.close()


if __name__ == "__main__":
    sys.exit(main())
