"""``rmqfast bench --hostile``: a steady client while the proxy is attacked, against the same client quiet.

Starts the null broker and ``rmqfast serve`` (one worker by default, ``[grpc]`` on) in front of
it, then:

1. **quiet**: the steady client (``bench/loadgen.c``, open loop, ``--rate`` msg/s over
   ``--steady-conns`` connections from 127.0.0.1) for ``--duration`` s;
2. **attacked**: the same client again while, all at once (each attacker a process of its own,
   :mod:`rmqfast.bench.hostile_attack`): ``--idle-conns`` idle connections to the broker endpoint (one
   HEART_BEAT each, spread over 127.0.0.10-49, ``--idle-per-process`` per process), a
   descriptor-exhaustion attempt of ``--exhaust`` connections from 127.0.0.3 alone,
   ``--slowloris`` clients trickling a Remoting frame (broker endpoint and name-server listener)
   and as many trickling an HTTP head to the admin port, ``--half-prefaces`` gRPC connections
   that send 10 bytes of the HTTP/2 preface, and an admin flood (``--admin-clients`` connections,
   at most ``--admin-rate`` requests/s);
3. **recovery**: ``--recovery`` s after every attacker closed its connections, then the steady
   client quiet once more (the attacked p99 is held against the lower of the two quiet p99s: a
   neighbour's burst on a shared machine spoils one quiet run now and then).

All along, :mod:`rmqfast.bench.hostile_probe` opens a fresh connection to each listener (broker
endpoint, name server, gRPC, admin ``/healthz``) every ``--probe-period`` s from an address of its
own, and asks ``/readyz`` every 0.2 s; the worker's RSS and descriptors are read from /proc every
0.5 s.  Reported (:mod:`rmqfast.bench.hostile_report`): the steady client's success and p99
attacked against quiet, each listener's longest silence per phase and how soon it answered
after the attack, ``/healthz`` and ``/readyz`` against the truth, worker RSS against 64 MB plus
the documented bytes per held connection, and the goals met or missed.  Everything is on
loopback and bounded in count and time; results are appended to
``results/bench/bench-<time>-hostile.jsonl``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rmqfast.bench import hostile_report as rep
from rmqfast.bench.cbuild import build_tools
from rmqfast.bench.common import DEFAULT_RESULTS_DIR, BenchError, guarded, now_iso, results_file
from rmqfast.bench.hostile_attack import Plan, plan_json
from rmqfast.bench.idleconns import raise_nofile
from rmqfast.bench.loadgen import run_loadgen
from rmqfast.bench.nullbroker import NullBroker
from rmqfast.bench.processes import stop_process, wait_port
from rmqfast.bench.procfs import children, memory_kib, wait_idle
from rmqfast.bench.scenarios import Scenario
from rmqfast.bench.targets import BenchProxy
from rmqfast.testing.ports import PortLease, reserve

LABEL = "bench --hostile"
SRC_EXHAUST = "127.0.0.3"
SRC_IDLE = [f"127.0.0.{i}" for i in range(10, 50)]
SRC_SLOW = [f"127.0.0.{i}" for i in range(60, 70)]
SRC_SLOW_HTTP = [f"127.0.0.{i}" for i in range(70, 80)]
SRC_HALF = [f"127.0.0.{i}" for i in range(80, 100)]
SRC_FLOOD = [f"127.0.0.{i}" for i in range(100, 110)]
SRC_PROBE = {"broker": "127.0.0.201", "namesrv": "127.0.0.202", "grpc": "127.0.0.203", "admin": "127.0.0.204",
             "readyz": "127.0.0.205"}
ATTACK_LEAD = 5.0  # s from the steady client's start to its measured window while attacked
SLOW_BYTE_EVERY = 2.0  # s between the bytes a slowloris client trickles


class HostileProxy(BenchProxy):
    """The bench's proxy (one static endpoint to the null broker) with the gRPC front on ``grpc_port``
    and every setting at its default."""

    def __init__(self, broker_port: int, *, workers: int, grpc_port: int | None) -> None:
        super().__init__(broker_port, workers=workers, pure=False)
        self.grpc_port = grpc_port
        # the proxy's own defaults for its caps and deadlines: they are what is measured (the
        # other benches lift the per-address cap, every client of theirs being 127.0.0.1)
        self.proxy_settings = ""
        if grpc_port:
            self.extra_config = f'\n[grpc]\nenabled = true\nlisten = "127.0.0.1:{grpc_port}"\n'
        self._write_config()


def grpc_available() -> bool:
    try:
        import grpc  # noqa: F401

        import rmqfast.grpcfront._h2  # noqa: F401
    except ImportError:
        return False
    return True


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="rmqfast bench --hostile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hostile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=float, default=20000, help="steady client msg/s (default 20000)")
    ap.add_argument("--steady-conns", type=int, default=16, help="steady client connections (default 16)")
    ap.add_argument("--duration", type=float, default=30, help="measured s, quiet and attacked each (default 30)")
    ap.add_argument("--warmup", type=float, default=1.0, help="s before each measured window (default 1)")
    ap.add_argument("--idle-conns", type=int, default=20000, help="idle connections (default 20000)")
    ap.add_argument("--idle-per-process", type=int, default=5000, help="idle connections per attacker process")
    ap.add_argument("--exhaust", type=int, default=15000,
                    help="connections the descriptor-exhaustion attacker (one address) holds at most (15000)")
    ap.add_argument("--slowloris", type=int, default=200,
                    help="slow Remoting clients, and as many slow HTTP clients on the admin port (default 200)")
    ap.add_argument("--half-prefaces", type=int, default=500, help="gRPC half-preface connections (default 500)")
    ap.add_argument("--admin-clients", type=int, default=16, help="admin flood connections at once (default 16)")
    ap.add_argument("--admin-rate", type=float, default=1000,
                    help="admin flood requests/s at most, 0 = as fast as answered (default 1000)")
    ap.add_argument("--recovery", type=float, default=5.0, help="s probed after the attackers closed (default 5)")
    ap.add_argument("--probe-period", type=float, default=0.05, help="s between probes of a listener (0.05)")
    ap.add_argument("--workers", type=int, default=1, help="rmqfast workers (default 1)")
    ap.add_argument("--no-grpc", action="store_true", help="no gRPC front (and no half-prefaces)")
    ap.add_argument("--short", action="store_true",
                    help="2,000 idle, 1,000 exhaust, 50 slow, 100 half-prefaces, 10 s windows")
    ap.add_argument("--results", type=Path, default=DEFAULT_RESULTS_DIR, help="results folder (default results/bench)")
    ap.add_argument("--keep-log", type=Path, metavar="FILE", help="copy the proxy's log there at the end")
    args = ap.parse_args(argv)
    if args.short:
        args.idle_conns, args.exhaust, args.slowloris, args.half_prefaces, args.duration = 2000, 1000, 50, 100, 10.0
    counts = (args.idle_conns, args.exhaust, args.slowloris, args.half_prefaces, args.admin_clients)
    if min(counts) < 0 or args.idle_per_process < 1 or args.steady_conns < 1 or args.workers < 1:
        ap.error("connection counts must be >= 0; --idle-per-process, --steady-conns and --workers >= 1")
    if args.rate <= 0 or args.duration <= 0 or args.warmup < 0 or args.recovery <= 0 or args.probe_period <= 0:
        ap.error("--rate, --duration, --recovery and --probe-period must be > 0, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    return guarded(LABEL, lambda: _run(args))


class _Proc:
    """A child process of the bench (attacker or prober) whose JSON lines a thread reads."""

    def __init__(self, module: str, arg: str) -> None:
        self.module = module
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", module, arg], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.last: dict[str, Any] = {}
        self.final: dict[str, Any] | None = None
        self.running = threading.Event()  # set at its first line (it has started what it does)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if obj.get("final") or "probes" in obj:
                self.final = obj
            else:
                self.last = obj
            self.running.set()
        self.running.set()  # ended: nobody waits for it any more

    def finish(self, timeout: float = 30.0) -> dict[str, Any]:
        """SIGTERM (it ends what it does and prints its last line), wait, and that line."""
        stop_process(self.proc, timeout)
        self.thread.join(timeout)
        if self.final is None:
            err = self.proc.stderr.read()[-2000:] if self.proc.stderr else ""
            raise BenchError(f"{self.module} ended (exit {self.proc.returncode}) without its result: {err}")
        return self.final

    def finish_attacker(self, plan: Plan) -> dict[str, Any]:
        """:meth:`finish`, or for an attacker that died, what it last said and why it ended."""
        try:
            return self.finish()
        except BenchError as exc:
            print(f"{LABEL}: attacker {plan.label or plan.kind}: {exc}", file=sys.stderr)
            return {**self.last, "label": plan.label or plan.kind, "kind": plan.kind, "final": True,
                    "opened": self.last.get("opened", 0), "peer_closed": self.last.get("peer_closed", 0),
                    "connect_failed": self.last.get("connect_failed", 0), "closed_after_s": {"p50": None},
                    "died": str(exc)[:500]}


class _Sampler(threading.Thread):
    """Worker RSS and descriptors, the gRPC process's RSS and whether the proxy lives, every 0.5 s."""

    def __init__(self, sup_pid: int, worker: int, grpc_pids: list[int]) -> None:
        super().__init__(daemon=True)
        self.sup_pid, self.worker, self.grpc_pids = sup_pid, worker, grpc_pids
        self.samples: list[dict[str, Any]] = []
        self.alive: list[tuple[float, bool]] = []
        self.stop = threading.Event()

    def sample(self) -> dict[str, Any]:
        try:
            fds = len(os.listdir(f"/proc/{self.worker}/fd"))
        except OSError:
            fds = 0
        return {"t": time.monotonic(), "rss_kib": memory_kib(self.worker).get("VmRSS", 0), "fds": fds,
                "grpc_rss_kib": sum(memory_kib(p).get("VmRSS", 0) for p in self.grpc_pids)}

    def run(self) -> None:
        while not self.stop.wait(0.5):
            self.samples.append(self.sample())
            alive = os.path.exists(f"/proc/{self.sup_pid}") and bool(children(self.sup_pid))
            self.alive.append((time.monotonic(), alive))


def _grpc_pids(worker: int) -> list[int]:
    out = []
    for pid in children(worker):
        with contextlib.suppress(OSError):
            if b"grpcfront" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
    return out


def _attackers(args: argparse.Namespace, proxy: HostileProxy, seconds: float) -> list[Plan]:
    broker, ns, admin = proxy.endpoint_port, proxy.namesrv_port, proxy.admin_port
    plans: list[Plan] = []
    left, k = args.idle_conns, 0
    while left > 0:
        n = min(left, args.idle_per_process)
        plans.append(Plan("idle", [broker], n, SRC_IDLE, seconds, label=f"idle-{k}"))
        left, k = left - n, k + 1
    if args.exhaust:
        plans.append(Plan("exhaust", [broker], args.exhaust, [SRC_EXHAUST], seconds, concurrency=512, retry=0.2))
    if args.slowloris:
        plans.append(Plan("slowloris", [broker, ns], args.slowloris, SRC_SLOW, seconds, interval=SLOW_BYTE_EVERY,
                          retry=0.5))
        plans.append(Plan("http-slowloris", [admin], args.slowloris, SRC_SLOW_HTTP, seconds,
                          interval=SLOW_BYTE_EVERY, retry=0.5))
    if args.half_prefaces and proxy.grpc_port:
        plans.append(Plan("half-preface", [proxy.grpc_port], args.half_prefaces, SRC_HALF, seconds, retry=0.5))
    if args.admin_clients:
        plans.append(Plan("admin-flood", [admin], args.admin_clients, SRC_FLOOD, seconds, rate=args.admin_rate,
                          retry=0.0))
    return plans


@contextlib.contextmanager
def _grpc_lease(want: bool) -> Iterator[PortLease | None]:
    lease = reserve([0]) if want else None
    try:
        yield lease
    finally:
        if lease is not None:
            lease.release()


def _run(args: argparse.Namespace) -> int:
    soft, hard = raise_nofile(1 << 20)  # the proxy and the null broker inherit it
    print(f"{LABEL}: open-files limit {soft} (hard {hard})", file=sys.stderr)
    tools = build_tools(None)
    run_id, path, common = results_file(args.results, "hostile", "hostile")
    want_grpc = not args.no_grpc and grpc_available()
    if not args.no_grpc and not want_grpc:
        print(f"{LABEL}: the gRPC front cannot run here (rmqfast[grpc] or its nghttp2 binding missing): "
              "no gRPC listener, no half-prefaces", file=sys.stderr)
    procs: list[_Proc] = []
    with NullBroker(tools) as broker, _grpc_lease(want_grpc) as lease:
        proxy = HostileProxy(broker.port, workers=args.workers, grpc_port=lease.base if lease else None)
        done = False
        try:
            proxy.start()
            assert proxy.proc is not None
            if proxy.grpc_port:
                wait_port(proxy.grpc_port, proxy.proc, timeout=60)
            summary = _phases(args, tools, broker, proxy, procs)
            done = True
        finally:
            for p in procs:
                if p.proc.poll() is None:
                    stop_process(p.proc)
            proxy.stop()
            if args.keep_log:
                shutil.copyfile(proxy.log_path, args.keep_log)
            if done:
                shutil.rmtree(proxy.workdir, ignore_errors=True)
            else:
                print(f"{LABEL}: the proxy's log is kept at {proxy.log_path}", file=sys.stderr)
    summary = {**common, "ts": now_iso(), "kind": "hostile-summary", **summary}
    with open(path, "a") as out:
        out.write(json.dumps(summary) + "\n")
        for g in summary["goals"]:
            out.write(json.dumps({**common, "ts": now_iso(), "kind": "hostile-goal", **g}) + "\n")
    print()
    print(rep.render(summary))
    print(f"\nresults: {path}")
    return 0 if all(g["met"] is not False for g in summary["goals"]) else 1


def _phases(args: argparse.Namespace, tools: Any, broker: NullBroker, proxy: HostileProxy,
            procs: list[_Proc]) -> dict[str, Any]:
    assert proxy.proc is not None
    workers = proxy.worker_pids()
    worker = workers[0]
    grpc_pids = _grpc_pids(worker) if proxy.grpc_port else []
    wait_idle([proxy.proc.pid, *workers, *broker.pids])
    sampler = _Sampler(proxy.proc.pid, worker, grpc_pids)
    base = sampler.sample()
    sampler.start()
    sc = Scenario("hostile-steady", args.steady_conns, rate=args.rate)
    attack_s = args.warmup + args.duration + 120  # the attackers stop themselves past this at the latest
    targets = [{"name": "broker", "port": proxy.endpoint_port, "proto": "remoting", "source": SRC_PROBE["broker"]},
               {"name": "namesrv", "port": proxy.namesrv_port, "proto": "remoting", "source": SRC_PROBE["namesrv"],
                "code": 105},
               {"name": "admin", "port": proxy.admin_port, "proto": "http", "source": SRC_PROBE["admin"],
                "path": "/healthz"},
               {"name": "readyz", "port": proxy.admin_port, "proto": "http", "source": SRC_PROBE["readyz"],
                "path": "/readyz"}]
    if proxy.grpc_port:
        targets.insert(2, {"name": "grpc", "port": proxy.grpc_port, "proto": "h2", "source": SRC_PROBE["grpc"]})
    probe_plan = {"targets": targets, "period": args.probe_period,
                  "duration": 4 * (args.warmup + args.duration) + args.recovery + 300,  # stopped before
                  "periods": {"readyz": 0.2}}
    prober = _Proc("rmqfast.bench.hostile_probe", json.dumps(probe_plan))
    procs.append(prober)
    print(f"{LABEL}: quiet: {args.rate:,.0f} msg/s for {args.duration:g} s ...", file=sys.stderr, flush=True)
    groups = {"worker": workers, "supervisor": [proxy.proc.pid], "grpc": grpc_pids, "nullbroker": broker.pids}

    def steady(warmup: float = args.warmup) -> dict[str, Any]:
        return run_loadgen(tools, proxy.endpoint_port, sc, warmup=warmup, duration=args.duration, cpu_groups=groups)

    loadavg = [os.getloadavg()[0]]
    q0 = time.monotonic()
    quiet = steady()
    q1 = time.monotonic()
    rss_quiet = sampler.sample()
    plans = _attackers(args, proxy, attack_s)
    sizes = {p.label or p.kind: p.conns for p in plans}
    print(f"{LABEL}: attacked: " + ", ".join(f"{k} {v:,}" for k, v in sizes.items()), file=sys.stderr, flush=True)
    # The steady client connects first (an application already running; newcomers are the prober's
    # part), then the attackers start; its measured window opens ATTACK_LEAD s later, when they are at work.
    box: dict[str, Any] = {}

    def attacked_run() -> None:
        try:
            box["res"] = steady(args.warmup + ATTACK_LEAD)
        except BenchError as exc:  # it could not even connect: every send failed
            print(f"{LABEL}: the steady client failed while attacked: {exc}", file=sys.stderr)
            box["res"] = _failed_run(args)

    loadavg.append(os.getloadavg()[0])
    a0 = time.monotonic()
    runner = threading.Thread(target=attacked_run, daemon=True)
    runner.start()
    time.sleep(0.3)  # its connections are made at its start
    attackers = [_Proc("rmqfast.bench.hostile_attack", plan_json(p)) for p in plans]
    procs.extend(attackers)
    deadline = time.monotonic() + 30
    for a in attackers:
        a.running.wait(max(0.0, deadline - time.monotonic()))
    at_work = time.monotonic() - a0
    if at_work > args.warmup + ATTACK_LEAD:
        print(f"{LABEL}: WARNING: the attackers were at work only {at_work:.1f} s after the steady client started, "
              f"after its measured window opened", file=sys.stderr)
    runner.join(args.warmup + ATTACK_LEAD + args.duration + 90)
    attacked = box.get("res") or _failed_run(args)
    open_before = [dict(a.last) for a in attackers]
    a1 = time.monotonic()
    finals = [a.finish_attacker(p) for a, p in zip(attackers, plans, strict=True)]
    r0 = time.monotonic()
    print(f"{LABEL}: attackers closed; recovery {args.recovery:g} s ...", file=sys.stderr, flush=True)
    time.sleep(args.recovery)  # the prober keeps probing: this is the time it is given
    r1 = time.monotonic()
    counters = _counters(proxy)
    print(f"{LABEL}: quiet again: {args.rate:,.0f} msg/s for {args.duration:g} s ...", file=sys.stderr, flush=True)
    loadavg.append(os.getloadavg()[0])
    quiet_after = steady()
    probes = prober.finish()
    sampler.stop.set()
    sampler.join(5)
    out = _summary(args, probes, sampler, base, rss_quiet, (quiet, attacked, quiet_after), finals, open_before,
                   sizes, (q0, q1, a0, a1, r0, r1))
    out["attackers_at_work_s"] = round(at_work, 3)
    out["proxy_counters"] = counters
    out["loadavg"] = [round(x, 2) for x in loadavg]
    return out


#: The proxy's counters of what it refused or closed, scraped from /metrics after the attack.
COUNTERS = ("rmqfast_connections_refused_total", "rmqfast_accept_errors_total",
            "rmqfast_connections_evicted_total", "rmqfast_deadline_closes_total",
            "rmqfast_grpc_connections_closed_total")


def _counters(proxy: HostileProxy) -> dict[str, Any]:
    """COUNTERS as ``name{label=value,...}: value``, over HTTP like any scraper (an error is said)."""
    try:
        found = proxy.metrics()
    except (OSError, RuntimeError, ValueError) as exc:
        return {"error": str(exc)[:300]}
    return {name + "{" + ",".join(f"{k}={v}" for k, v in labels) + "}": value
            for (name, labels), value in sorted(found.items()) if name in COUNTERS and value}


def _failed_run(args: argparse.Namespace) -> dict[str, Any]:
    sent = int(args.rate * args.duration)
    zero = {"min": 0, "mean": 0, "p50": 0, "p90": 0, "p99": 0, "p999": 0, "p9999": 0, "max": 0}
    return {"sent": 0, "skipped": sent, "rate": args.rate, "responses": 0, "rps": 0.0, "errors": sent,
            "outstanding_at_end": 0, "resp_codes": {},
            "error_detail": {"bad_code": 0, "conn_closed": 0, "protocol": 0, "unmatched": 0, "lost": 0},
            "lat_us": zero, "could_not_connect": True}


def _summary(args: argparse.Namespace, probes: dict[str, Any], sampler: _Sampler, base: dict[str, Any],
             rss_quiet: dict[str, Any], runs: tuple[dict[str, Any], ...], finals: list[dict[str, Any]],
             open_before: list[dict[str, Any]], sizes: dict[str, int],
             marks: tuple[float, ...]) -> dict[str, Any]:
    q0, q1, a0, a1, r0, r1 = marks
    recs: dict[str, list[list[Any]]] = probes["probes"]
    listeners = {k: v for k, v in recs.items() if k != "readyz"}
    phases = {"quiet": (q0, q1), "attacked": (a0, a1), "recovery": (r0, r1)}
    gaps = {n: {ph: rep.silent_gap(r, a, b) for ph, (a, b) in phases.items()} for n, r in listeners.items()}
    accept_listeners = {k: v for k, v in listeners.items() if k != "admin"}
    health = rep.healthz_truth(listeners["admin"], sampler.alive, a0, a1)
    ready = rep.readyz_truth(recs["readyz"], accept_listeners, a0, a1)
    quiet, attacked, quiet_after = runs
    sq, sa, sq2 = rep.steady(quiet), rep.steady(attacked), rep.steady(quiet_after)
    attack_samples = [s for s in sampler.samples if a0 <= s["t"] <= a1]
    # while attacked, and once more at the end of the recovery (what the worker keeps after the
    # attack), not while the closes are being handled
    after = [s for s in sampler.samples if r1 - 1.0 <= s["t"] <= r1][-1:]
    rss = rep.rss_verdict(attack_samples + after, base["fds"])
    # a worker that died (and was restarted under another pid) is not measured: said, not hidden
    rss["worker_gone_samples"] = sum(1 for s in sampler.samples if s["rss_kib"] == 0)
    rss["after_recovery"] = {"rss_mib": round(after[0]["rss_kib"] / 1024, 1), "fds": after[0]["fds"]} if after \
        else None
    worst_gaps = {n: {"longest_silent_s": max(g["attacked"]["longest_silent_s"], g["recovery"]["longest_silent_s"])}
                  for n, g in gaps.items()}
    found = rep.goals(rep.quiet_reference(sq, sq2), sa, worst_gaps, health, ready, rss)
    for f, last in zip(finals, open_before, strict=True):
        f["open_before_stop"] = last.get("open", 0)
        f["connecting_before_stop"] = last.get("connecting", 0)
    return {
        "hostile_params": {k: v for k, v in vars(args).items() if k not in ("results", "hostile", "keep_log")},
        "attack_sizes": sizes, "steady": {"quiet": sq, "attack": sa, "quiet_after": sq2},
        "steady_runs": {"quiet": quiet, "attack": attacked, "quiet_after": quiet_after},  # loadgen's JSON
        "listeners": gaps, "recovery_s": {n: rep.recovery_s(r, r0) for n, r in listeners.items()},
        "prober_late_s": probes["max_timer_late_s"], "healthz": health, "readyz": ready,
        "rss": rss, "rss_quiet_mib": round(rss_quiet["rss_kib"] / 1024, 1),
        "rss_base_mib": round(base["rss_kib"] / 1024, 1),
        "grpc_rss_mib": round(max((s["grpc_rss_kib"] for s in attack_samples), default=0) / 1024, 1),
        "attack_t0": a0, "attackers": finals, "phases_s": {ph: round(b - a, 3) for ph, (a, b) in phases.items()},
        "goals": rep.goal_rows(found),
    }
