"""Failover mode of the bench: a broker killed under load, through rmqfast and direct, same run.

``rmqfast bench --failover`` (or ``python -m rmqfast.bench --failover``) starts one name server and
two RocketMQ masters (``broker-a``, ``broker-b``, each registering on its own) that both hold the
topic, one rmqfast proxy in front of the name server, and real Java producers (rocketmq-client
5.3.3 and 4.9.4, default retry settings, synchronous sends one after the other with a short pause,
``--interval-ms``, so that both paths offer the same load; ``io.rmqfast.driver.FailoverProducer``):
one of each through rmqfast, one of each straight to the name server, all at once.  Once every
producer has acknowledged sends, ``broker-a`` is killed with ``kill -9``; it stays down until every
producer made progress without it (and at least ``--down`` seconds), then restarts; once every
producer has sent again the producers stop.  Then every message of the topic is read from both
brokers (PULL from offset 0 of every queue).

Per producer: sends attempted, acknowledged, failed (as the producer saw them), success ratio,
the longest gap between two acknowledged sends, acknowledged sends missing from the brokers
(lost: must be 0) and copies beyond the first (duplicates).  Phases are paced by the producers'
progress, each bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rmqfast.codec import codes as C
from rmqfast.codec.store import decode_records
from rmqfast.testing import RocketMQCluster, ensure_jars, remoting_request
from rmqfast.testing.jvm import kill_group
from rmqfast.testing.maven import JarPaths
from rmqfast.testing.proxy import ProxyProcess
from rmqfast.testing.tools import java_executable

TOPIC = "RmqfastFailover"
QUEUES = 4
MAIN = "io.rmqfast.driver.FailoverProducer"
PROXY_CONFIG = """
[failover]
probe_interval = 0.5
probe_interval_down = 0.1
"""


@dataclass
class Producer:
    """One FailoverProducer JVM and what it printed so far."""

    name: str  # e.g. "rmqfast/5"
    client: str
    namesrv: str
    run: str
    out_path: Path
    stop_file: Path
    proc: subprocess.Popen[bytes] | None = None
    ok: list[tuple[int, int, str]] = field(default_factory=list)  # (idx, epoch ms, broker name)
    failed: list[tuple[int, int, str]] = field(default_factory=list)  # (idx, epoch ms, error)
    ended: bool = False
    _pos: int = 0

    def start(self, jars: JarPaths, log_dir: Path, interval_ms: int = 0) -> None:
        cmd = [java_executable(), "-Xms32m", "-Xmx128m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
               f"-Drocketmq.client.logRoot={log_dir}", "-Drocketmq.client.logUseSlf4j=false",
               "-cp", jars.driver_classpath(self.client), MAIN, "failover", "--namesrv", self.namesrv,
               "--topic", TOPIC, "--run", self.run, "--stop-file", str(self.stop_file), "--max-ms", "900000",
               "--interval-ms", str(interval_ms)]
        err = (log_dir / f"{self.run}.err").open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self.out_path.open("wb"), stderr=err, start_new_session=True)

    def poll(self) -> None:
        """Read the lines printed since the last call."""
        try:
            with self.out_path.open("rb") as f:
                f.seek(self._pos)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n")
        if end < 0:
            return
        self._pos += end + 1
        for line in data[: end + 1].decode("utf-8", "replace").splitlines():
            parts = line.split(" ", 6)
            if parts[0] == "OK" and len(parts) >= 4:
                self.ok.append((int(parts[1]), int(parts[2]), parts[3]))
            elif parts[0] == "FAIL" and len(parts) >= 3:
                self.failed.append((int(parts[1]), int(parts[2]), parts[4] if len(parts) > 4 else ""))
            elif parts[0] == "END":
                self.ended = True

    def stop(self, timeout: float = 60.0) -> None:
        self.stop_file.touch()
        deadline = time.monotonic() + timeout
        while self.proc is not None and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.proc is not None and self.proc.poll() is None:
            kill_group(self.proc)
        self.poll()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            kill_group(self.proc)


def longest_gap_ms(acks: list[int], start: int | None = None, end: int | None = None) -> int:
    """The longest time (ms) without an acknowledged send between ``start`` and ``end`` (epoch ms)."""
    ts = sorted(acks)
    if start is not None:
        ts = [start, *[t for t in ts if t >= start]]
    if end is not None:
        ts = [*[t for t in ts if t <= end], end]
    return max((b - a for a, b in zip(ts, ts[1:], strict=False)), default=0)


def gap_across(acks: list[int], at: int) -> int:
    """ms from the last acknowledged send before ``at`` to the first one after it (0: none on a side)."""
    before = [t for t in acks if t <= at]
    after = [t for t in acks if t > at]
    return min(after) - max(before) if before and after else 0


def read_topic(broker_addrs: list[str], topic: str = TOPIC, queues: int = QUEUES,
               timeout: float = 30.0) -> Counter[str]:
    """Copies of every message body prefix ``fo|RUN|IDX`` stored in ``topic`` on these brokers."""
    seen: Counter[str] = Counter()
    for addr in broker_addrs:
        for qid in range(queues):
            r = remoting_request(addr, C.GET_MAX_OFFSET, {"topic": topic, "queueId": qid}, timeout=timeout)
            if r.code != C.SUCCESS:
                raise RuntimeError(f"GET_MAX_OFFSET {topic}/{qid} at {addr}: {r.code} {r.remark}")
            top = int((r.ext_fields or {}).get("offset", "0"))
            off = 0
            while off < top:
                pull = {"consumerGroup": "rmqfast_failover_check", "topic": topic, "queueId": qid,
                        "queueOffset": off, "maxMsgNums": 32, "sysFlag": 4, "commitOffset": 0,
                        "suspendTimeoutMillis": 0, "subscription": "*", "subVersion": 0, "expressionType": "TAG"}
                r = remoting_request(addr, C.PULL_MESSAGE, pull, timeout=timeout)
                nxt = int((r.ext_fields or {}).get("nextBeginOffset", off))
                if r.code == C.SUCCESS:
                    for rec in decode_records(r.body):
                        parts = bytes(rec.body).split(b"|")
                        if len(parts) >= 3 and parts[0] == b"fo":
                            seen[f"{parts[1].decode()}|{parts[2].decode()}"] += 1
                if nxt <= off:
                    raise RuntimeError(f"pull of {topic}/{qid} at {addr} made no progress at offset {off}: "
                                       f"code {r.code} {r.remark}")
                off = nxt
    return seen


def _wait(cond: Any, timeout: float, what: str, producers: list[Producer]) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for p in producers:
            p.poll()
        if cond():
            return
        dead = [p.name for p in producers if p.proc is not None and p.proc.poll() is not None]
        if dead:
            raise RuntimeError(f"producer(s) {dead} exited while waiting until {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout:.0f} s: {what}; "
                               + ", ".join(f"{p.name}: {len(p.ok)} ok {len(p.failed)} failed" for p in producers))
        time.sleep(0.1)


def _row(p: Producer, seen: Counter[str], windows: list[dict[str, Any]]) -> dict[str, Any]:
    acked = {idx for idx, _, _ in p.ok}
    lost = sorted(i for i in acked if seen[f"{p.run}|{i}"] == 0)
    dups = sum(max(0, seen[f"{p.run}|{i}"] - 1) for i in range(max(acked | {-1}) + 1 + len(p.failed)))
    attempts = len(p.ok) + len(p.failed)
    acks = [t for _, t, _ in p.ok]
    per = []
    for w in windows:
        lo, hi = w["kill_ms"], w["restart_ms"]
        failed = sum(1 for _, t, _ in p.failed if lo <= t <= hi)
        ok = sum(1 for t in acks if lo <= t <= hi)
        per.append({"fault": w["fault"], "acknowledged": ok, "failed": failed,
                    "success_ratio": ok / (ok + failed) if ok + failed else 0.0,
                    "longest_gap_ms": longest_gap_ms(acks, lo, hi),
                    # from the last acknowledged send before the fault to the first one after it: the recovery
                    "gap_across_fault_ms": gap_across(acks, lo)})
    fault_acked = sum(w["acknowledged"] for w in per)
    fault_failed = sum(w["failed"] for w in per)
    return {
        "producer": p.name, "attempted": attempts, "acknowledged": len(p.ok), "failed": len(p.failed),
        "success_ratio": len(p.ok) / attempts if attempts else 0.0,
        # the fault windows: from each fault to the broker's return (the producers' first sends at
        # start-up, which time out now and then on a loaded machine, are outside them)
        "failed_in_fault": fault_failed, "acknowledged_in_fault": fault_acked,
        "fault_success_ratio": fault_acked / (fault_acked + fault_failed) if fault_acked + fault_failed else 0.0,
        "longest_gap_ms": longest_gap_ms(acks),
        "longest_gap_after_kill_ms": max((w["longest_gap_ms"] for w in per), default=0),
        "gap_across_fault_ms": max((w["gap_across_fault_ms"] for w in per), default=0),
        "windows": per,
        "lost": len(lost), "lost_idx": lost[:20], "duplicates": dups,
        "failed_examples": sorted({e for _, _, e in p.failed})[:5],
    }


def _metric_sum(proxy: ProxyProcess, name: str) -> float:
    try:
        m = proxy.metrics()
    except OSError:
        return 0.0
    return sum(v for (n, _), v in m.items() if n == name)


def two_masters(jars: JarPaths, stack: contextlib.ExitStack) -> tuple[RocketMQCluster, RocketMQCluster]:
    """One name server, ``broker-a`` and ``broker-b`` both holding :data:`TOPIC` (entered on ``stack``)."""
    a = stack.enter_context(RocketMQCluster(jars=jars, broker_name="broker-a"))
    b = stack.enter_context(RocketMQCluster(jars=jars, broker_name="broker-b", join=a))
    a.create_topic(TOPIC, QUEUES)
    b.create_topic(TOPIC, QUEUES)
    deadline = time.monotonic() + 60
    while True:
        route = a.topic_route(TOPIC) or {}
        names = {q.get("brokerName") for q in route.get("queueDatas", []) if isinstance(q, dict)}
        if {"broker-a", "broker-b"} <= names:
            return a, b
        if time.monotonic() > deadline:
            raise RuntimeError(f"route of {TOPIC} does not name both brokers: {route}")
        time.sleep(0.2)


def run_scenario(*, jars: JarPaths | None = None, clients: tuple[str, ...] = ("5", "4"),
                 before: int = 100, during: int = 200, after: int = 100, down_min: float = 10.0,
                 phase_timeout: float = 240.0, workers: int = 2, interval_ms: int = 5,
                 fault: str | Sequence[str] = "kill", probe_timeout: float | None = None,
                 during_direct: int | None = None, pair: tuple[RocketMQCluster, RocketMQCluster] | None = None,
                 resend: str | None = None, log: Any = print) -> dict[str, Any]:
    """One run: both paths, every client, one or more faults of broker-a in turn, each ended before
    the next.  Returns the figures.

    ``fault``: ``"kill"`` (``kill -9``, then a restart on the same store) or ``"stop"`` (``SIGSTOP``:
    a hung broker keeps its connections, so the name server keeps it in routes for two minutes;
    then ``SIGCONT``), or a sequence of them.  A fault lasts until every producer has ``during``
    more acknowledged sends (direct producers ``during_direct``), the proxy has seen broker-a dead,
    and ``down_min`` seconds have passed.  ``pair``: clusters from :func:`two_masters` to reuse
    (else started and stopped here).  ``probe_timeout``: rmqfast's ``failover.probe_timeout``
    (None: its default); ``resend``: its ``failover.resend`` (None: its default).
    """
    faults = [fault] if isinstance(fault, str) else list(fault)
    if not faults or any(f not in ("kill", "stop") for f in faults):
        raise ValueError(f"fault must be 'kill' or 'stop' (or a sequence of them), not {fault!r}")
    jars = jars or ensure_jars(rocketmq4="4" in clients)
    during_direct = during if during_direct is None else during_direct
    work = Path(tempfile.mkdtemp(prefix="rmqfast-failover-"))
    windows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        a, b = pair if pair is not None else two_masters(jars, stack)
        cfg = PROXY_CONFIG + ("" if probe_timeout is None else f"probe_timeout = {probe_timeout}\n") + (
            "" if resend is None else f"resend = \"{resend}\"\n")
        proxy = stack.enter_context(ProxyProcess([a.namesrv_addr], workers=workers, extra_config=cfg))
        producers: list[Producer] = []
        for path, ns in (("rmqfast", proxy.namesrv_addr), ("direct", a.namesrv_addr)):
            for client in clients:
                run = f"{path}{client}x{int(time.time() * 1000) % 10**8}"
                p = Producer(f"{path}/{client}", client, ns, run, work / f"{run}.out", work / f"{run}.stop")
                producers.append(p)
        stack.callback(lambda: [p.kill() for p in producers])
        for p in producers:
            p.start(jars, work, interval_ms)
        log(f"producers started: {', '.join(p.name for p in producers)}")
        _wait(lambda: all(len(p.ok) >= before for p in producers), phase_timeout,
              f"every producer has {before} acknowledged sends", producers)
        for f in faults:
            windows.append(_one_fault(f, a, proxy, producers, during, during_direct, after, down_min,
                                      phase_timeout, stack, log))
        for p in producers:
            p.stop()
        seen = read_topic([a.broker_addr, b.broker_addr])
        m = proxy.metrics()
        fo = {name: sum(v for (n, _), v in m.items() if n == name) for name in (
            "rmqfast_failovers_total", "rmqfast_failover_refused_total", "rmqfast_failover_possible_duplicates_total",
            "rmqfast_failover_resent_total",
            "rmqfast_route_heals_total", "rmqfast_broker_down_total")}
    rows = [_row(p, seen, windows) for p in producers]
    return {"rows": rows, "fault": faults[0] if len(faults) == 1 else "+".join(faults), "windows": windows,
            "probe_timeout": probe_timeout, "resend": resend,
            "kill_ms": windows[0]["kill_ms"], "restart_ms": windows[-1]["restart_ms"],
            "interval_ms": interval_ms, "proxy_metrics": fo}


def _one_fault(fault: str, a: RocketMQCluster, proxy: ProxyProcess, producers: list[Producer], during: int,
               during_direct: int, after: int, down_min: float, phase_timeout: float,
               stack: contextlib.ExitStack, log: Any) -> dict[str, Any]:
    """One fault of broker-a under the running producers, and its end; (fault, kill_ms, restart_ms)."""
    marks = {p.name: len(p.ok) for p in producers}
    downs = _metric_sum(proxy, "rmqfast_broker_down_total")
    kill_ms = int(time.time() * 1000)
    pgid = os.getpgid(a.broker_pid or 0)
    stopped = [False]

    def cont() -> None:  # also on the way out of a failed run: a stopped broker would never exit
        if stopped[0]:
            stopped[0] = False
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGCONT)

    if fault == "kill":
        a.stop_broker()  # kill -9 (process group)
    else:
        os.killpg(pgid, signal.SIGSTOP)
        stopped[0] = True
        stack.callback(cont)
    log(f"broker-a {'killed (kill -9)' if fault == 'kill' else 'stopped (SIGSTOP)'} at {kill_ms}")
    t_kill = time.monotonic()
    seen_dead = [False]
    last_scrape = [0.0]

    def done() -> bool:  # acknowledged sends counted by the producers' own clock: from the fault on
        want = {p.name: during if p.name.startswith("rmqfast") else during_direct for p in producers}
        if not all(_acked_since(p, marks[p.name], kill_ms) >= want[p.name] for p in producers) \
                or time.monotonic() - t_kill < down_min:
            return False
        if not seen_dead[0] and time.monotonic() - last_scrape[0] >= 0.5:  # scrapes cost the proxy: not too often
            last_scrape[0] = time.monotonic()
            seen_dead[0] = _metric_sum(proxy, "rmqfast_broker_down_total") > downs
        return seen_dead[0]

    _wait(done, phase_timeout + down_min,
          f"every producer has {during} acknowledged sends with broker-a down and rmqfast saw it dead", producers)
    if fault == "kill":
        a.start_broker()
    else:
        cont()
    restart_ms = int(time.time() * 1000)
    log(f"broker-a {'restarted and registered' if fault == 'kill' else 'continued (SIGCONT)'} at {restart_ms}")
    marks = {p.name: len(p.ok) for p in producers}
    _wait(lambda: all(_acked_since(p, marks[p.name], restart_ms) >= after for p in producers), phase_timeout,
          f"every producer has {after} acknowledged sends after broker-a's return", producers)
    return {"fault": fault, "kill_ms": kill_ms, "restart_ms": restart_ms}


def _acked_since(p: Producer, mark: int, ms: int) -> int:
    """Sends of ``p`` acknowledged at or after ``ms`` (epoch ms), looking from index ``mark`` on."""
    return sum(1 for _, t, _ in p.ok[mark:] if t >= ms)


def render(result: dict[str, Any]) -> str:
    windows = result.get("windows") or [{"fault": result.get("fault", "kill"), "kill_ms": result["kill_ms"],
                                         "restart_ms": result["restart_ms"]}]
    down = ", ".join(f"{w['fault']} {(w['restart_ms'] - w['kill_ms']) / 1000:.1f} s" for w in windows)
    pt = result.get("probe_timeout")
    head = (f"faults (broker-a down): {down}; probe_timeout {'default' if pt is None else f'{pt} s'}; "
            f"resend {result.get('resend') or 'default'}\n"
            f"{'producer':<12} {'sent':>6} {'acked':>6} {'failed':>6} {'success':>9} {'in fault':>9} {'gap ms':>7} "
            f"{'recovery':>8} {'lost':>5} {'dups':>5}")
    lines = [head]
    for r in result["rows"]:
        lines.append(f"{r['producer']:<12} {r['attempted']:>6} {r['acknowledged']:>6} {r['failed']:>6} "
                     f"{100 * r['success_ratio']:>8.3f}% {100 * r['fault_success_ratio']:>8.3f}% "
                     f"{r['longest_gap_ms']:>7} {r['gap_across_fault_ms']:>8} "
                     f"{r['lost']:>5} {r['duplicates']:>5}")
        for w in r.get("windows", []) if len(windows) > 1 else []:
            lines.append(f"  {w['fault']:<10} {'':>6} {w['acknowledged']:>6} {w['failed']:>6} {'':>9} "
                         f"{100 * w['success_ratio']:>8.3f}% {w['longest_gap_ms']:>7} {w['gap_across_fault_ms']:>8}")
    fo = result["proxy_metrics"]
    lines.append("rmqfast: " + ", ".join(f"{k.removeprefix('rmqfast_')}={v:g}" for k, v in fo.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rmqfast bench --failover", description=__doc__.split("\n\n")[0])
    ap.add_argument("--failover", action="store_true", help="this mode")
    ap.add_argument("--clients", default="5,4", help="rocketmq-client builds: 5 (5.3.3), 4 (4.9.4); default 5,4")
    ap.add_argument("--runs", type=int, default=1, help="kill/restart runs (default 1)")
    ap.add_argument("--down", type=float, default=40.0,
                    help="at least this many seconds broker-a stays down (default 40: longer than the clients' 30 s "
                         "route refresh)")
    ap.add_argument("--during", type=int, default=300, help="acknowledged sends per producer while broker-a is down")
    ap.add_argument("--interval-ms", type=int, default=5,
                    help="pause after each send (default 5: both paths offer the same load; 0: as fast as possible)")
    ap.add_argument("--fault", default="kill",
                    help="kill: kill -9 then restart (default); stop: SIGSTOP (a hung broker) then SIGCONT; "
                         "several, comma-separated, one after the other in the same run (e.g. stop,kill)")
    ap.add_argument("--probe-timeout", type=float, default=None,
                    help="rmqfast's failover.probe_timeout (default: rmqfast's default)")
    ap.add_argument("--resend", choices=("policy", "all", "off"), default=None,
                    help="rmqfast's failover.resend (default: rmqfast's default)")
    ap.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    ap.add_argument("--results", type=Path, default=Path("results/bench"), help="folder for failover.jsonl")
    args = ap.parse_args(argv)
    clients = tuple(c.strip() for c in args.clients.split(",") if c.strip())
    args.results.mkdir(parents=True, exist_ok=True)
    code = 0
    faults = tuple(f.strip() for f in args.fault.split(",") if f.strip())
    for k in range(args.runs):
        res = run_scenario(clients=clients, during=args.during, down_min=args.down, interval_ms=args.interval_ms,
                           fault=faults, probe_timeout=args.probe_timeout, resend=args.resend,
                           log=lambda s, k=k: print(f"[failover run {k + 1}] {s}", file=sys.stderr))
        res["run"] = k + 1
        with (args.results / "failover.jsonl").open("a") as f:
            f.write(json.dumps(res) + "\n")
        print(json.dumps(res) if args.json else render(res))
        if any(r["lost"] for r in res["rows"]):
            code = 1
    return code
