"""Proxy-held delayed messages: capacity, worker memory, accept rate and release lateness.

A measurement, not a test (no asserts)::

    .venv/bin/python bench/delay_bench.py                        # 1 M pending (a few minutes)
    .venv/bin/python bench/delay_bench.py --pending 10000000     # the goal: 10 M (about 12 GB of disk)
    .venv/bin/python bench/delay_bench.py --pending 100000 --release-seconds 3   # a quick look

Phases (``--skip`` names them: capacity, accept, release, load):

1. **Capacity.** ``--pending`` delayed 1 KiB messages (incompressible bodies, due in a day) are
   written into worker 0's store directory through the worker's own store write path
   (:class:`rmqfast.delay.store.DelayStore` ``put``: due key, cancel index entries, counters,
   synced group commits of 512), *not* through the proxy: the proxy's accept path is measured
   in phase 2, and filling 10 M through it would take its accept rate's time (printed).  Then
   the disk used (every file of the RocksDB directory) and the bytes the store counts.
2. **Accept.** ``rmqfast serve`` (1 worker) starts on that state directory in front of the null
   broker.  Worker RSS when ready; then the accept rate of plain and of delayed 1 KiB sends
   (``TIMER_DELIVER_MS`` a day out) through it, alternating in the same run, from the C load
   generator (closed loop, ``--conns`` x ``--inflight``); worker RSS sampled while accepting.
3. **Release.** With everything above still pending, ``--release-rate`` x ``--release-seconds``
   more delayed sends go through the proxy (a Python client) to a second endpoint whose broker
   is a recorder in this process, due at ``--release-rate`` per second from a moment after the
   last is accepted.  The worker releases them among the millions pending; lateness = the
   recorder's arrival time of a release minus its due time (written in the body's first 8
   bytes): p50 / p99 / max, the release rate reached, the worker's CPU per release and its RSS
   sampled while releasing.
4. **Load.** Phase 3 again while the load generator sends ``--plain-rate`` plain sends per
   second (open loop) through the same worker: the lateness with the proxy carrying traffic.

The state directory is removed at the end (``--keep`` keeps it; ``--reuse DIR`` runs phases 2-4
on a kept one).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gevent
from gevent import socket as gsocket
from gevent.server import StreamServer

from rmqfast.bench.cbuild import Tools, build_tools
from rmqfast.bench.common import wait_serving
from rmqfast.bench.nullbroker import NullBroker
from rmqfast.bench.procfs import children, cpu_seconds
from rmqfast.codec.codes import FLAG_RESPONSE, SERIALIZE_ROCKETMQ
from rmqfast.codec.command import RemotingCommand, decode_frame, encode, make_response
from rmqfast.spill.record import CopyRecord
from rmqfast.testing.ports import reserve

#: (figure, measured, goal) rows printed side by side at the end
SUMMARY: list[tuple[str, str, str]] = []
GOAL_PENDING = 10_000_000
GOAL_RSS_MB = 64
GOAL_RATE = 10_000
GOAL_P99_MS = 50
FAR_MS = 86_400_000  # the bulk is due in a day: pending for the whole run
_I32 = struct.Struct(">i")
_HEAD = struct.Struct(">iI")
_FIXED = struct.Struct(">hBhiii")
_DUE = struct.Struct(">q")


def verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def print_summary() -> None:
    if not SUMMARY:
        return
    w0 = max(len(r[0]) for r in SUMMARY)
    w1 = max(len(r[1]) for r in SUMMARY)
    print(f"\nsummary (load average {load()} at the end):")
    print(f"  {'figure':<{w0}}  {'measured':<{w1}}  goal")
    for what, got, goal in SUMMARY:
        print(f"  {what:<{w0}}  {got:<{w1}}  {goal}")


def rss_mb(pid: int | str = "self") -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def smaps_raw(pid: int | str) -> str:
    """The text of /proc/PID/smaps (read at a peak, parsed later: parsing it here would hold up the
    recorder that times the releases)."""
    try:
        with open(f"/proc/{pid}/smaps") as f:
            return f.read()
    except OSError:
        return ""


def smaps_mb(pid: int | str, raw: str | None = None) -> dict[str, float]:
    """Resident MB of a process by kind of mapping: ``heap`` (glibc's main arena: the Python
    objects and the main thread's mallocs), ``anon`` (the other anonymous mappings: the RocksDB
    threads' malloc arena, large mallocs, thread stacks), ``rocksdb`` (the rocksdict library's
    pages), ``libs`` (every other file)."""
    out = {"heap": 0.0, "anon": 0.0, "rocksdb": 0.0, "libs": 0.0}
    kind = "anon"
    for line in (smaps_raw(pid) if raw is None else raw).splitlines():
        head = line.split(maxsplit=6)
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
            name = head[5].strip() if len(head) > 5 else ""
            kind = ("heap" if name == "[heap]" else "rocksdb" if "rocksdict" in name
                    else "anon" if not name or name.startswith("[") else "libs")
        elif head and head[0] == "Rss:":
            out[kind] += int(head[1]) / 1024
    return out


def smaps_text(parts: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in parts.items()) + " MB"


class RssSampler:
    """Samples a process's RSS every ``every`` seconds in a greenlet; ``peak`` / ``last`` in MB;
    ``parts``: the resident memory by kind of mapping (:func:`smaps_mb`) at the peak."""

    def __init__(self, pid: int, every: float = 0.2) -> None:
        self.pid, self.every = pid, every
        self.peak = self.last = 0.0
        self._raw = ""
        self._g = gevent.spawn(self._run)

    @property
    def parts(self) -> dict[str, float]:
        return smaps_mb(self.pid, self._raw)

    def _run(self) -> None:
        while True:
            self.last = rss_mb(self.pid)
            if self.last > self.peak + 0.5 or not self._raw:
                self._raw = smaps_raw(self.pid)
            self.peak = max(self.peak, self.last)
            gevent.sleep(self.every)

    def stop(self) -> float:
        self._g.kill()
        self.last = rss_mb(self.pid)
        self.peak = max(self.peak, self.last)
        return self.peak


def du_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# 1. Capacity ----------------------------------------------------------------------------------

def fill(store_dir: Path, n: int, body: int, due_base: int, addr: str) -> tuple[float, int, int]:
    """Write n held messages due from ``due_base`` on (1 ms apart) through the worker's store
    write path; (seconds, store bytes, messages)."""
    from rmqfast.delay.store import DelayStore, Held
    from rmqfast.spill.store import SpillStore

    spill = SpillStore(store_dir)  # the worker's defaults: [replicate] write_buffer_bytes, block_cache_bytes
    st = DelayStore(spill.db, max_pending_bytes=1 << 50, path=str(store_dir))
    t0 = time.monotonic()
    i = 0
    pid = os.getpid()
    step = max(1, n // 10)
    while i < n:
        batch = None
        for _ in range(min(512, n - i)):
            uniq = f"{pid:08X}{i:024X}"
            props = f"KEYS\x01k{i}\x02UNIQ_KEY\x01{uniq}\x02"
            # incompressible bodies, as real payloads may be
            rec = CopyRecord(topic="Delayed", body=os.urandom(body), properties=props, queue_id=i % 4,
                             broker_name="b", producer_group="PG", created_ms=int(time.time() * 1000))
            _k, batch = st.put(Held(addr, uniq, f"k{i}", rec), due_base + i)
            i += 1
        assert batch is not None
        st.wait(batch)
        if i % step < 512 or i == n:
            el = time.monotonic() - t0
            print(f"  filled {i:,} in {el:.0f} s ({i / max(el, 1e-9):,.0f}/s, load {load()})", flush=True)
    secs = time.monotonic() - t0
    out = (secs, st.bytes, st.messages)
    st.close()
    spill.close()
    return out


def capacity(args: argparse.Namespace, wdir: Path, addr: str) -> None:
    print(f"1. capacity: {args.pending:,} pending messages of {args.body} B, filled through the worker's store "
          "write path (DelayStore.put, synced group commits of 512), not through the proxy", flush=True)
    secs, nbytes, msgs = fill(wdir, args.pending, args.body, int(time.time() * 1000) + FAR_MS, addr)
    disk = du_bytes(wdir)
    print(f"   filled at {msgs / secs:,.0f} msg/s ({secs:.0f} s); store counts {nbytes / 2**20:,.0f} MiB; "
          f"disk {disk / 2**20:,.0f} MiB ({disk / max(1, msgs):,.0f} B per message); load {load()}")
    SUMMARY.append(("pending 1 KiB messages (filled through DelayStore.put)", f"{msgs:,} in {secs:.0f} s",
                    f"{GOAL_PENDING:,} ({verdict(msgs >= GOAL_PENDING)})"))
    SUMMARY.append(("disk used", f"{disk / 2**20:,.0f} MiB ({disk / max(1, msgs):,.0f} B/msg)",
                    "disk, not memory"))


def held(wdir: Path) -> tuple[int, int]:
    """(messages, bytes) a stopped worker's delay store holds (its counters: no scan)."""
    from rmqfast.delay.store import DelayStore
    from rmqfast.spill.store import SpillStore

    spill = SpillStore(wdir)
    st = DelayStore(spill.db, max_pending_bytes=1 << 50, path=str(wdir))
    out = (st.messages, st.bytes)
    st.close()
    spill.close()
    return out


def kept(wdir: Path) -> None:
    msgs, _b = held(wdir)
    disk = du_bytes(wdir)
    print(f"1. kept store {wdir}: {msgs:,} pending; disk {disk / 2**20:,.0f} MiB "
          f"({disk / max(1, msgs):,.0f} B per message)", flush=True)
    SUMMARY.append(("pending 1 KiB messages (kept store)", f"{msgs:,}",
                    f"{GOAL_PENDING:,} ({verdict(msgs >= GOAL_PENDING)})"))
    SUMMARY.append(("disk used", f"{disk / 2**20:,.0f} MiB ({disk / max(1, msgs):,.0f} B/msg)",
                    "disk, not memory"))


# The proxy ------------------------------------------------------------------------------------

class Proxy:
    """``rmqfast serve`` with one worker on ``state``: endpoint ``ep`` to the null broker, ``ep2``
    to the recorder."""

    def __init__(self, work: Path, state: Path, nb_addr: str, rec_addr: str, queue_window: int) -> None:
        self.lease = reserve(list(range(16)))
        b = self.lease.base
        ns, self.admin, self.ep, self.ep2, lo = b, b + 1, b + 4, b + 7, b + 8  # ep - 2: VIP channels
        self.log = work / "proxy.log"
        cfg = work / "c.toml"
        cfg.write_text(f"""
[proxy]
workers = 1
state_dir = "{state}"
[namesrv]
listen = "127.0.0.1:{ns}"
upstreams = ["{nb_addr}"]
[brokers]
port_range = "{lo}-{lo + 7}"
[[brokers.static]]
listen = "127.0.0.1:{self.ep}"
upstream = "{nb_addr}"
[[brokers.static]]
listen = "127.0.0.1:{self.ep2}"
upstream = "{rec_addr}"
[admin]
listen = "127.0.0.1:{self.admin}"
[failover]
# the broker stand-ins answer from this process, which a loaded machine can hold up for a second
# while it generates the slice: not a dead broker (the failover default would cut the connections)
probe_timeout = 10.0
hang_timeout = 10.0
[delay]
topics = ["Delayed", "BenchTopic"]
max_pending_bytes = {1 << 45}
queue_window = {queue_window}
[log]
level = "warning"
""")
        t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "rmqfast", "serve", "--config", str(cfg)],
                                     stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"))  # noqa: SIM115
        try:
            wait_serving(self.proc, self.admin, [self.ep, self.ep2], f"rmqfast serve; see {self.log}", timeout=300)
            while not children(self.proc.pid):
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - t0
        self.worker = children(self.proc.pid)[0]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.lease.release()


def run_loadgen(tools: Tools, port: int, args: argparse.Namespace, *, seconds: float, deliver_ms: int = 0,
                rate: float = 0) -> subprocess.Popen[str]:
    cmd = [str(tools.loadgen), "--port", str(port), "--conns", str(args.conns), "--inflight", str(args.inflight),
           "--body", str(args.body), "--warmup", "0.5", "--duration", f"{seconds:g}", "--rate", f"{rate:g}"]
    if deliver_ms:
        cmd += ["--deliver-ms", str(deliver_ms)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def loadgen_result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    while proc.poll() is None:  # gevent keeps the recorder and the samplers running meanwhile
        gevent.sleep(0.1)
    out, err = proc.communicate()
    lines = [x for x in out.splitlines() if x.startswith("{")]
    if not lines:
        raise SystemExit(f"loadgen printed no result (exit {proc.returncode}): {err}")
    res: dict[str, Any] = json.loads(lines[-1])
    return res


def profile(args: argparse.Namespace, px: Proxy, phase: str, seconds: float) -> subprocess.Popen[bytes] | None:
    """``--py-spy``: sample the worker with py-spy for ``seconds`` (a raw collapsed-stack file per
    phase in ``--py-spy-dir``); None when not asked."""
    if not args.py_spy:
        return None
    out = Path(args.py_spy_dir) / f"{phase}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([args.py_spy, "record", "--pid", str(px.worker), "--duration", str(max(1, int(seconds))),
                             "--rate", "200", "--format", "raw", "--nonblocking", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_profile(spy: subprocess.Popen[bytes] | None) -> None:
    if spy is None:
        return
    deadline = time.monotonic() + 30
    while spy.poll() is None and time.monotonic() < deadline:  # gevent keeps the recorder running
        gevent.sleep(0.2)
    if spy.poll() is None:
        spy.kill()
        spy.wait()


# 2. Accept rates ------------------------------------------------------------------------------

def accept(args: argparse.Namespace, tools: Tools, px: Proxy) -> float:
    """Plain and delayed sends alternating; returns the best delayed accept rate."""
    time.sleep(2)
    rss0 = rss_mb(px.worker)
    parts = smaps_text(smaps_mb(px.worker))
    print(f"2. accept: worker ready in {px.ready_s:.1f} s; worker RSS {rss0:.0f} MB ({parts}; load {load()})",
          flush=True)
    rates: dict[bool, list[float]] = {False: [], True: []}
    sampler = RssSampler(px.worker)
    for r in range(args.rounds):
        for delayed in ((False, True) if r % 2 == 0 else (True, False)):
            deliver = int(time.time() * 1000) + FAR_MS if delayed else 0
            spy = profile(args, px, f"accept-delayed-{r + 1}", args.accept_seconds) if delayed else None
            res = loadgen_result(run_loadgen(tools, px.ep, args, seconds=args.accept_seconds, deliver_ms=deliver))
            stop_profile(spy)
            ok = res["resp_codes"].get("0", 0)
            rate = res["rps"] * ok / max(1, res["responses"])
            rates[delayed].append(rate)
            print(f"   round {r + 1}: {'delayed' if delayed else 'plain  '} sends {rate:,.0f}/s answered SUCCESS "
                  f"(p50 {res['lat_us']['p50'] / 1000:.1f} ms, p99 {res['lat_us']['p99'] / 1000:.1f} ms; "
                  f"{args.conns} conns x {args.inflight} in flight; codes {res['resp_codes']}; load {load()})",
                  flush=True)
    peak = sampler.stop()
    print(f"   worker RSS while accepting: peak {peak:.0f} MB ({smaps_text(sampler.parts)}), after "
          f"{sampler.last:.0f} MB", flush=True)
    SUMMARY.append(("worker RSS: ready / accepting (peak)", f"{rss0:.0f} / {peak:.0f} MB",
                    f"< {GOAL_RSS_MB} MB ({verdict(max(rss0, peak) < GOAL_RSS_MB)})"))
    plain, held = max(rates[False]), max(rates[True])
    SUMMARY.append(("accept rate plain / delayed (same run)", f"{plain:,.0f} / {held:,.0f}/s "
                    f"({held / max(plain, 1):.0%})", "reported"))
    mins = args.pending / max(held, 1) / 60
    print(f"   at that delayed rate, filling {args.pending:,} through the proxy would take {mins:,.0f} min")
    return held


# 3./4. Release --------------------------------------------------------------------------------

class Recorder:
    """A broker stand-in in this process: answers every request SUCCESS (ROCKETMQ header, as a
    broker answers the release channel) and records, per release, arrival ms - due ms (the
    body's first 8 bytes)."""

    def __init__(self) -> None:
        self.late: list[int] = []
        self.due: list[int] = []  # the due time of each sample in ``late``
        self.first = self.last = 0
        self.server = StreamServer(("127.0.0.1", 0), self._handle)
        self.server.start()
        self.addr = f"127.0.0.1:{self.server.server_port}"

    def reset(self) -> None:
        self.late = []
        self.due = []
        self.first = self.last = 0

    def _handle(self, sock: socket.socket, _addr: object) -> None:
        buf = b""
        while True:
            try:
                chunk = sock.recv(1 << 18)
            except OSError:
                return
            if not chunk:
                return
            now = int(time.time() * 1000)
            buf = buf + chunk if buf else chunk
            pos, end, out = 0, len(buf), []
            while end - pos >= 8:
                n, mark = _HEAD.unpack_from(buf, pos)
                if end - pos < 4 + n:
                    break
                if mark >> 24 != SERIALIZE_ROCKETMQ:  # not a release: the proxy's health probe (JSON)
                    cmd = decode_frame(buf[pos : pos + 4 + n])
                    out.append(encode(make_response(cmd, 0, ext_fields={"offset": "0"})))
                    pos += 4 + n
                    continue
                opaque = _I32.unpack_from(buf, pos + 13)[0]
                body_at = pos + 8 + (mark & 0xFFFFFF)
                if _I32.unpack_from(buf, pos + 8)[0] >> 16 == 310 and body_at + 8 <= pos + 4 + n:
                    due = _DUE.unpack_from(buf, body_at)[0]
                    self.late.append(now - due)
                    self.due.append(due)
                    self.first = self.first or now
                    self.last = now
                out.append(_HEAD.pack(4 + 21, (SERIALIZE_ROCKETMQ << 24) | 21)
                           + _FIXED.pack(0, 0, 0, opaque, FLAG_RESPONSE, 0) + _I32.pack(0))
                pos += 4 + n
            buf = buf[pos:]
            if out:
                sock.sendall(b"".join(out))

    def close(self) -> None:
        self.server.stop()


def slice_frame(opaque: int, due: int, body: bytes) -> bytes:
    props = f"KEYS\x01s{opaque}\x02UNIQ_KEY\x01B{due:016X}{opaque:015X}\x02TIMER_DELIVER_MS\x01{due}\x02"
    ext = {"a": "PG", "b": "Delayed", "c": "TBW102", "d": "4", "e": str(opaque % 4), "f": "0",
           "g": str(int(time.time() * 1000)), "h": "0", "i": props, "j": "0", "k": "false", "l": "16", "m": "false",
           "n": "b"}
    return encode(RemotingCommand(code=310, opaque=opaque, version=473, ext_fields=ext,
                                  body=_DUE.pack(due) + body[8:]))


def send_slice(port: int, n: int, start: int, rate: int, body: int, conns: int = 4, inflight: int = 64) -> int:
    """n delayed sends due at ``rate``/s from ``start`` (epoch ms), over ``conns`` pipelined
    connections; returns how many were answered SUCCESS."""
    ok = [0]
    payload = os.urandom(body)

    def one(c: int) -> None:
        mine = list(range(c, n, conns))
        s = gsocket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nxt = 0

        def more(k: int) -> bytes:
            nonlocal nxt
            part = mine[nxt : nxt + k]
            nxt += len(part)
            return b"".join(slice_frame(i + 1, start + i * 1000 // rate, payload) for i in part)

        s.sendall(more(inflight))
        buf, answered = b"", 0
        while answered < len(mine):
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            buf += chunk
            got = 0
            while len(buf) >= 25:
                (fl,) = _I32.unpack_from(buf, 0)
                if len(buf) < 4 + fl:
                    break
                ok[0] += decode_frame(buf[: 4 + fl]).code == 0
                buf = buf[4 + fl :]
                got += 1
            answered += got
            if got and nxt < len(mine):
                s.sendall(more(got))
        s.close()

    gevent.joinall([gevent.spawn(one, c) for c in range(conns)])
    return ok[0]


def by_second(rec: Recorder, start: int) -> str:
    """p99 / max lateness of the releases due in each second of the slice: where the tail lies."""
    secs: dict[int, list[int]] = {}
    for late, due in zip(rec.late, rec.due, strict=False):
        secs.setdefault((due - start) // 1000, []).append(late)
    out = []
    for sec in sorted(secs):
        v = sorted(secs[sec])
        out.append(f"{sec}s {v[min(len(v) - 1, int(len(v) * 0.99))]}/{v[-1]}")
    return ", ".join(out)


def release(args: argparse.Namespace, tools: Tools, px: Proxy, rec: Recorder, accept_rate: float,
            plain_rate: float) -> float:
    """One release slice (with ``plain_rate`` plain sends/s beside it); returns the rate at which
    the slice was accepted."""
    n = int(args.release_rate * args.release_seconds)
    label = "4. load" if plain_rate else "3. release"
    # due from a moment after the last is accepted (the slice goes through the proxy's accept path):
    # the accept rate right now is probed with a few delayed sends due in a day (they join the
    # pending bulk), and the slice is planned at 60% of it; a machine that gets busier meanwhile
    # can still be slower, which the output says
    probe = max(500, n // 50)
    t0 = time.monotonic()
    send_slice(px.ep2, probe, int(time.time() * 1000) + FAR_MS, args.release_rate, args.body)
    rate_now = probe / (time.monotonic() - t0)
    lead = 2000 + int(n / max(min(rate_now * 0.6, accept_rate * 3), 100) * 1000)
    start = int(time.time() * 1000) + lead
    rec.reset()
    t0 = time.monotonic()
    ok = send_slice(px.ep2, n, start, args.release_rate, args.body)
    took = time.monotonic() - t0
    margin = start - int(time.time() * 1000)
    print(f"{label}: {ok:,} of {n:,} delayed sends accepted in {took:.1f} s ({n / took:,.0f}/s), due at "
          f"{args.release_rate:,}/s over 4 queues from {margin / 1000:.1f} s on, queue_window {args.queue_window}, "
          f"with the pending above held too (load {load()})", flush=True)
    if margin < 0:
        print("   the slice took longer to accept than planned: its first messages were already due")
    lg = None
    if plain_rate:
        gevent.sleep(max(0.0, margin / 1000 - 1.5))
        lg = run_loadgen(tools, px.ep, args, seconds=args.release_seconds + 2, rate=plain_rate)
    sampler = RssSampler(px.worker)
    gevent.sleep(max(0.0, (start - time.time() * 1000) / 1000))
    c0 = sum(cpu_seconds(px.worker))
    spy = profile(args, px, label.split()[-1], args.release_seconds)
    deadline = time.monotonic() + args.release_seconds * 3 + 60
    while len(rec.late) < ok and time.monotonic() < deadline:
        gevent.sleep(0.05)
    cpu = sum(cpu_seconds(px.worker)) - c0
    peak = sampler.stop()
    stop_profile(spy)
    print(f"   lateness by second of due time (p99 / max ms): {by_second(rec, start)}", flush=True)
    late = sorted(rec.late)
    k = len(late)
    if not k:
        print(f"   nothing released within {args.release_seconds * 3 + 60:.0f} s of the first due time")
        return n / took
    span = max(args.release_seconds, (rec.last - start) / 1000)
    reached = k / span
    p50, p99, mx = late[k // 2], late[min(k - 1, int(k * 0.99))], late[-1]
    extra = ""
    if lg is not None:
        res = loadgen_result(lg)
        extra = (f"; plain sends meanwhile: {res['rps']:,.0f}/s answered (asked {plain_rate:,.0f}/s open loop, "
                 f"p99 {res['lat_us']['p99'] / 1000:.1f} ms, errors {res['errors']})")
    print(f"   released {k:,} (of {ok:,}), {reached:,.0f}/s from the first due time; lateness ms p50={p50} p99={p99} "
          f"max={mx}; worker CPU {cpu * 1e6 / k:.0f} us per release; worker RSS while releasing: peak {peak:.0f} MB"
          f" ({smaps_text(sampler.parts)})"
          f"{extra}; load {load()}", flush=True)
    what = f"with {plain_rate:,.0f} plain sends/s" if plain_rate else "alone"
    SUMMARY.append((f"release {what}: rate (due at {args.release_rate:,}/s, window {args.queue_window})",
                    f"{reached:,.0f}/s", f"{GOAL_RATE:,}/s ({verdict(reached >= GOAL_RATE * 0.98)})"))
    SUMMARY.append((f"release {what}: lateness p50 / p99 / max", f"{p50} / {p99} / {mx} ms",
                    f"p99 < {GOAL_P99_MS} ms at {GOAL_RATE:,}/s "
                    f"({verdict(p99 < GOAL_P99_MS and args.release_rate >= GOAL_RATE)})"))
    SUMMARY.append((f"worker RSS releasing {what} (peak)", f"{peak:.0f} MB",
                    f"< {GOAL_RSS_MB} MB ({verdict(peak < GOAL_RSS_MB)})"))
    return n / took


# main -----------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pending", type=int, default=1_000_000, help="messages held before the run (goal: 10000000)")
    ap.add_argument("--body", type=int, default=1024)
    ap.add_argument("--release-rate", type=int, default=10_000, help="due per second in the release slice")
    ap.add_argument("--release-seconds", type=float, default=10.0, help="length of the release slice")
    ap.add_argument("--plain-rate", type=float, default=5000,
                    help="phase 4: plain sends per second (open loop) beside the releases")
    ap.add_argument("--conns", type=int, default=8, help="load generator connections")
    ap.add_argument("--inflight", type=int, default=32, help="load generator sends in flight per connection")
    ap.add_argument("--accept-seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2, help="accept rounds (plain and delayed each)")
    ap.add_argument("--queue-window", type=int, default=64,
                    help="[delay] queue_window (releases in flight per broker queue; 1 = strict due order)")
    ap.add_argument("--keep", action="store_true", help="keep the state directory")
    ap.add_argument("--py-spy", default="", help="path of a py-spy binary: profile the worker in each phase")
    ap.add_argument("--py-spy-dir", default="py-spy", help="where --py-spy writes its collapsed stacks")
    ap.add_argument("--reuse", type=Path, default=None,
                    help="run on the state directory a --keep run filled (the capacity phase is skipped)")
    ap.add_argument("--dead-broker", type=int, default=0, metavar="N",
                    help="before the proxy starts, N messages due at once for a broker that refuses connections "
                         "(the release phases then show whether it holds up the others)")
    ap.add_argument("--skip", default="", help="comma-separated phases to skip: capacity,accept,release,load")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    skip = set(filter(None, args.skip.split(",")))
    tools = build_tools()
    work = Path(tempfile.mkdtemp(prefix="rmqfast-delaybench-"))
    print(f"machine: {os.cpu_count()} CPUs, load average {load()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
          f"; work dir {work}", flush=True)
    state = args.reuse or work / "state"
    if args.reuse is not None:
        skip.add("capacity")
        args.keep = True
    wdir = state / "spill" / "worker-0"
    rec = Recorder()
    try:
        with NullBroker(tools) as nb:
            addr = f"127.0.0.1:{nb.port}"
            if "capacity" not in skip:
                capacity(args, wdir, addr)
            elif args.reuse is not None:
                kept(wdir)
                args.pending = held(wdir)[0]
            dead = socket.socket()  # bound, never listening: connections to it are refused
            dead.bind(("127.0.0.1", 0))
            if args.dead_broker:
                dead_addr = f"127.0.0.1:{dead.getsockname()[1]}"
                print(f"   dead broker: {args.dead_broker:,} messages due from now on (1 ms apart) for {dead_addr}, "
                      "which refuses connections, written through DelayStore.put", flush=True)
                fill(wdir, args.dead_broker, args.body, int(time.time() * 1000), dead_addr)
            if not {"accept", "release", "load"} <= skip:
                px = Proxy(work, state, addr, rec.addr, args.queue_window)
                try:
                    rate = accept(args, tools, px) if "accept" not in skip else 1000.0
                    if "release" not in skip:
                        rate = release(args, tools, px, rec, rate, 0)
                    if "load" not in skip:
                        release(args, tools, px, rec, rate, args.plain_rate)
                finally:
                    px.stop()
                print(f"   after the run: {held(wdir)[0]:,} pending, disk {du_bytes(wdir) / 2**20:,.0f} MiB",
                      flush=True)
            dead.close()
    finally:
        rec.close()
        if not args.keep or args.reuse is not None:  # a reused state directory lies outside work
            shutil.rmtree(work, ignore_errors=True)
        if args.keep:
            print(f"kept {state}")
    print_summary()
    return 0


if __name__ == "__main__":
    sys.exit(main())
