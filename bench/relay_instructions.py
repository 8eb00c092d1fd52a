"""Instructions per relayed frame: one relay session under callgrind, in front of the null broker.

A wall-clock benchmark on a loaded machine measures the machine; an instruction count does not.
This script starts ``bench/nullbroker`` (``rmqfast.bench.cbuild``), then, for each scenario, runs
one proxy process under ``valgrind --tool=callgrind`` (a gevent listener whose one connection is
a :class:`rmqfast.proxy.relay.Session` with the worker's broker filter chain), drives it from
this process with N frames (pipelined, ``--batch`` per write, every answer read), and reads the
process's total instruction count.  It does that for two frame counts; the difference divided by
the difference of frames is the cost of one frame through the relay (start-up and imports cancel
out).  Only the proxy process runs under valgrind (client and null broker do not count).

Scenarios (``--scenario``, repeatable; default all):

* ``send``: SEND_MESSAGE_V2 with no send limits: the compiled fast path (no Python per frame);
* ``send-limited``: the same with a limit rule on the topic that admits them all (the limiter
  decides in the scanner; still no Python per frame);
* ``send-busy``: every send over its limit (rule mode ``reject``): answered SYSTEM_BUSY by the
  proxy through the policy path;
* ``denied``: an admin request code answered NO_PERMISSION by the proxy.
* ``send-kept``: ``send`` with ``[failover] resend = "all"`` (every send kept until answered, for a
  resend if its broker dies: the sends take the policy path);
* ``send-kept-policy``: ``send`` with ``resend = "policy"`` (kept only if another filter takes the
  send to Python: here none does).
* ``send-delay-on``: ``send`` with proxy-held delay on for another topic (``[delay] topics``);
* ``send-delay-topic``: ``send`` to a ``[delay]`` topic, without a delivery-time property
  (relayed to the broker as it is).
* ``pull``: PULL_MESSAGE answered with the null broker's 16 x 1 KiB store records, with the
  worker's message-address filter (``policy.message_addresses = "records"``, the default): every
  record's store host is rewritten to a proxy endpoint (checked on the answers read);
* ``pull-off``: the same pulls with ``message_addresses = "off"`` (relayed untouched).
* ``send-ids``: ``send`` with the message-address filter as configured by default
  (``message_addresses = "all"``): the offset msgId of every send answer mapped to the proxy
  endpoint by the scanner, in C (checked on the answers read);
* ``send-ids-records``: the same with ``message_addresses = "records"`` (the default before: send
  answers relayed untouched).

    .venv/bin/python bench/relay_instructions.py [--frames 2000 12000] [--batch 32] [--scenario send]

``RMQFAST_NO_EXTENSIONS=1`` measures the pure-Python twins (pump and scanner) instead;
``RMQFAST_RELAY_REACTOR=0`` the compiled pumps on watchers of their own instead of the reactor.
``--batch 1`` is a client with one request in flight (every frame is a wake-up of its own);
``--conns N`` drives N connections at once (each its batch; the wake-ups then find several ready).

``--proxy haproxy`` measures HAProxy instead (``mode tcp``, one thread, the bench's config) on
the same frames: the same figure for the proxy the project compares itself with (``send`` only).
``--strace`` counts system calls per frame instead of instructions (``strace -f -c``; slower,
and what the kernel does inside a call is not counted by either tool).
Prints one line per run and one JSON line per scenario.  A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

SCENARIOS = ("send", "send-limited", "send-busy", "denied", "send-kept", "send-kept-policy", "send-delay-on",
             "send-delay-topic", "pull", "pull-off", "send-ids", "send-ids-records")
PULL = 11
STORE_HOST = "127.0.0.1:10911"  # what the null broker writes in its records
ENDPOINT = "127.0.0.1:40001"  # the proxy endpoint the pull scenario maps it to


class _Registry:
    """The part of the endpoint registry the message-address filter asks: one broker, one endpoint."""

    advertise_host = "127.0.0.1"

    def advertised(self, real: str) -> str | None:
        return ENDPOINT if real == STORE_HOST else None

    def is_proxy_address(self, addr: str) -> bool:
        return addr == ENDPOINT
TOPIC = "BenchTopic"
UPDATE_BROKER_CONFIG = 25


# The proxy side (runs under valgrind) -------------------------------------------------------


def serve(upstream_port: int, scenario: str, runtime: Path, conns: int = 1) -> None:
    import gevent
    from gevent import socket as gsocket

    from rmqfast.codec import ScanStats
    from rmqfast.codec import codes as C
    from rmqfast.config import HostPort
    from rmqfast.filters.api import FilterChain
    from rmqfast.filters.deny import DenyAdminCodes
    from rmqfast.proxy.relay import RelaySettings, Session

    limits = None
    if scenario in ("send-limited", "send-busy"):
        from rmqfast.limits import create_shared, parse_limits
        from rmqfast.limits.worker import WorkerLimits

        rule = ({"topic": TOPIC, "rate": 1e9, "burst": 1e9} if scenario == "send-limited"
                else {"topic": TOPIC, "mode": "reject"})
        limits = WorkerLimits(create_shared(runtime), parse_limits({"rule": [rule]}))

    class Events:
        def upstream_error(self, role: str) -> None:
            pass

        def upstream_ok(self, session: object, hp: object) -> None:
            pass

    filters: list = [DenyAdminCodes(C.BROKER_DATA_PLANE_CODES)]
    kwargs = {}
    if limits is not None:
        try:  # send limits are a filter of the chain (the worker's broker chain)
            from rmqfast.filters.limits import SendLimitFilter

            filters.append(SendLimitFilter(limits))
        except ImportError:  # older trees: the session took them
            kwargs["limits"] = limits
    if scenario.startswith("send-delay"):
        from rmqfast.delay.service import DelayService
        from rmqfast.delay.settings import parse_delay
        from rmqfast.spill.store import SpillStore

        topics = [TOPIC] if scenario == "send-delay-topic" else ["Delayed", "Later-*"]
        spill = SpillStore(runtime / "spill")
        delay = DelayService(parse_delay({"topics": topics}), spill.db, 0, path=str(spill.path), publish=False)
        filters.insert(0, delay.filter)  # first, as in the worker's broker chain
    if scenario.startswith("send-kept"):  # last, as in the worker's broker chain
        from rmqfast.proxy.failover import KeepSendsInFlight

        filters.append(KeepSendsInFlight(everything=scenario == "send-kept"))
    if scenario.startswith(("pull", "send-ids")):  # last but one, as in the worker's broker chain
        from rmqfast.filters.addresses import RewriteMessageAddresses

        mode = {"pull-off": "off", "pull": "records", "send-ids": "all", "send-ids-records": "records"}[scenario]
        filters.append(RewriteMessageAddresses(_Registry(), mode))  # type: ignore[arg-type]
    chain = FilterChain(filters)
    settings = RelaySettings(65536, 16 << 20, 1 << 16, 5.0, 600.0)
    listener = gsocket.socket(gsocket.AF_INET, gsocket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(conns)
    print(f"listening {listener.getsockname()[1]}", flush=True)
    stats = ScanStats()
    runs = []
    for _ in range(conns):
        sock, addr = listener.accept()
        sock.setsockopt(gsocket.IPPROTO_TCP, gsocket.TCP_NODELAY, 1)
        session = Session("broker", sock, f"{addr[0]}:{addr[1]}", [HostPort("127.0.0.1", upstream_port)], chain,
                          stats, settings, Events(), **kwargs)
        runs.append(gevent.spawn(session.run))
    gevent.joinall(runs)
    listener.close()


# The driver ---------------------------------------------------------------------------------


def frame(scenario: str, opaque: int) -> bytes:
    from rmqfast.codec.command import RemotingCommand, encode

    if scenario == "denied":
        return encode(RemotingCommand(code=UPDATE_BROKER_CONFIG, opaque=opaque, version=401, body=b"x=y"))
    if scenario.startswith("pull"):  # the Java client's PullMessageRequestHeader
        return encode(RemotingCommand(code=PULL, opaque=opaque, version=401, ext_fields={
            "consumerGroup": "PG", "topic": TOPIC, "queueId": "0", "queueOffset": str(opaque * 16),
            "maxMsgNums": "32", "sysFlag": "2", "commitOffset": "0", "suspendTimeoutMillis": "15000",
            "subscription": "*", "subVersion": "0", "expressionType": "TAG"}))
    return encode(RemotingCommand(code=310, opaque=opaque, version=401, ext_fields={
        "a": "PG", "b": TOPIC, "c": "TBW102", "d": "4", "e": "0", "f": "0", "g": "0", "h": "0",
        "i": f"TAGS\u0001TagA\u0002UNIQ_KEY\u0001U{opaque}\u0002", "j": "0", "k": "false", "m": "false"},
        body=b"m" * 256))


def drive(port: int, scenario: str, n: int, batch: int, conns: int = 1) -> dict[int, int]:
    """Send ``n`` frames, ``batch`` at a time on each of ``conns`` connections (every connection's
    batch written, then every answer read: the proxy sees their frames arrive together)."""
    from rmqfast.codec.command import decode_frame
    from rmqfast.testing.wire import read_frame

    codes: dict[int, int] = {}
    socks = [socket.create_connection(("127.0.0.1", port), timeout=600) for _ in range(conns)]
    try:
        for s in socks:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sent = 0
        while sent < n:
            round_ = []
            for s in socks:
                k = min(batch, n - sent)
                if k <= 0:
                    break
                s.sendall(b"".join(frame(scenario, sent + i) for i in range(k)))
                round_.append((s, k, sent))
                sent += k
            for s, k, first in round_:
                for _ in range(k):
                    data = read_frame(s)
                    if data is None:
                        raise RuntimeError(f"the proxy closed the connection after {first} frames")
                    cmd = decode_frame(data)
                    codes[cmd.code] = codes.get(cmd.code, 0) + 1
                    if first == 0 and scenario.startswith("pull"):
                        _check_store_hosts(cmd.body, STORE_HOST if scenario == "pull-off" else ENDPOINT)
                    if first == 0 and scenario.startswith("send-ids"):
                        _check_offset_id(cmd, ENDPOINT if scenario == "send-ids" else STORE_HOST)
    finally:
        for s in socks:
            s.close()
    return codes


def _check_store_hosts(body: bytes, want: str) -> None:
    from rmqfast.codec.store import decode_records

    hosts = {r.store_host for r in decode_records(body)}
    if hosts != {want}:
        raise RuntimeError(f"pull answers carry store hosts {sorted(hosts)}, expected {want}")


def _check_offset_id(cmd: object, want: str) -> None:
    from rmqfast.codec.msgaddr import format_host

    fields = getattr(cmd, "ext_fields", None) or {}
    got = format_host(bytes.fromhex(fields.get("msgId", "")[:16]))
    if got != want:
        raise RuntimeError(f"send answers' offset msgId names {got}, expected {want}")


def instructions(out_file: Path) -> int:
    text = out_file.read_text(errors="replace")
    m = re.search(r"^(?:summary|totals):\s+(\d+)", text, re.M)
    if m is None:
        raise RuntimeError(f"no instruction total in {out_file}")
    return int(m.group(1))


def syscalls(out_file: Path) -> int:
    """Total calls from an ``strace -c`` summary."""
    m = re.search(r"^\s*100\.00\s+[\d.]+\s+\d+\s+(\d+)", out_file.read_text(errors="replace"), re.M)
    if m is None:
        raise RuntimeError(f"no call total in {out_file}")
    return int(m.group(1))


def _wrapper(out: Path, strace: bool) -> list[str]:
    if strace:
        return ["strace", "-f", "-c", "-o", str(out)]
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]


def run_haproxy_once(upstream_port: int, n: int, batch: int, work: Path,
                     strace: bool = False, conns: int = 1) -> tuple[int, dict[int, int]]:
    """HAProxy (one thread, the bench's config) under the same tool, on the same frames."""
    import signal

    from rmqfast.bench.haproxy import HAProxyTarget, ensure_haproxy
    from rmqfast.bench.processes import free_port, wait_port

    exe = ensure_haproxy(False)
    if exe is None:
        raise RuntimeError("haproxy is not installed")
    target = HAProxyTarget(exe, upstream_port, 1, "haproxy-1t")
    target._port = free_port()
    cfg = work / "haproxy.cfg"
    cfg.write_text(target.config())
    out = work / f"{'strace' if strace else 'callgrind'}.haproxy.{n}.out"
    proc = subprocess.Popen(_wrapper(out, strace) + [exe, "-f", str(cfg), "-db"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_port(target.port, proc, timeout=300.0)  # slow to start under valgrind
        codes = drive(target.port, "send", n, batch, conns)
    finally:
        # soft stop: exits once its connections are closed (under strace: strace's child)
        kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split() if strace else []
        for pid in kids or [str(proc.pid)]:
            os.kill(int(pid), signal.SIGUSR1)
        proc.wait(timeout=600)
    return (syscalls(out) if strace else instructions(out)), codes


def run_once(upstream_port: int, scenario: str, n: int, batch: int, work: Path,
             strace: bool = False, conns: int = 1) -> tuple[int, dict[int, int]]:
    out = work / f"{'strace' if strace else 'callgrind'}.{scenario}.{n}.out"
    cmd = _wrapper(out, strace) + [sys.executable, __file__, "--serve", str(upstream_port), "--scenario", scenario,
                                   "--runtime", str(work), "--conns", str(conns)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("listening "):
        proc.kill()
        raise RuntimeError(f"proxy did not start: {line!r}")
    try:
        codes = drive(int(line.split()[1]), scenario, n, batch, conns)
    finally:
        rc = proc.wait(timeout=600)
    if rc != 0:
        raise RuntimeError(f"proxy exited {rc}")
    return (syscalls(out) if strace else instructions(out)), codes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--runtime", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--scenario", action="append", choices=SCENARIOS)
    ap.add_argument("--frames", type=int, nargs=2, default=[2000, 12000])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--conns", type=int, default=1, help="connections driven at once")
    ap.add_argument("--proxy", choices=("rmqfast", "haproxy"), default="rmqfast")
    ap.add_argument("--strace", action="store_true", help="count system calls instead of instructions")
    ap.add_argument("--keep", type=Path, help="keep the callgrind/strace outputs in this directory "
                    "(callgrind_annotate reads them)")
    args = ap.parse_args()
    if args.serve is not None:
        serve(args.serve, args.scenario[0], args.runtime, args.conns)
        return
    from rmqfast.bench.cbuild import build_tools
    from rmqfast.bench.nullbroker import NullBroker

    impl = "python" if os.environ.get("RMQFAST_NO_EXTENSIONS") else "compiled"
    if impl == "compiled" and os.environ.get("RMQFAST_RELAY_REACTOR") == "0":
        impl = "compiled-watchers"
    if args.proxy == "haproxy":
        impl = "haproxy-1t"
    unit = "system calls" if args.strace else "instructions"
    with NullBroker(build_tools()) as nb, tempfile.TemporaryDirectory() as tmp:
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            tmp = str(args.keep)
        for scenario in args.scenario or SCENARIOS:
            counts = []
            for n in args.frames:
                if args.proxy == "haproxy":
                    ins, codes = run_haproxy_once(nb.port, n, args.batch, Path(tmp), args.strace, args.conns)
                else:
                    ins, codes = run_once(nb.port, scenario, n, args.batch, Path(tmp), args.strace, args.conns)
                print(f"{scenario} {impl}: {n} frames, {ins} {unit}, answers {codes}", flush=True)
                counts.append(ins)
            (n1, n2), (i1, i2) = args.frames, counts
            print(json.dumps({"scenario": scenario, "implementation": impl, "batch": args.batch, "conns": args.conns,
                              "frames": args.frames, "unit": unit, "instructions": counts,
                              "per_frame": round((i2 - i1) / (n2 - n1), 2)}), flush=True)


if __name__ == "__main__":
    main()
