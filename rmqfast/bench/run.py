"""The null-broker bench: every scenario against every target, round after round."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from rmqfast.bench.cbuild import build_tools
from rmqfast.bench.common import BenchError, now_iso, results_file
from rmqfast.bench.floor import FloorTarget
from rmqfast.bench.haproxy import HAProxyTarget, ensure_haproxy
from rmqfast.bench.loadgen import run_loadgen
from rmqfast.bench.machine import machine_info
from rmqfast.bench.nullbroker import NullBroker
from rmqfast.bench.procfs import machine_cpu, memory_kib, wait_idle
from rmqfast.bench.report import NOISE_CORES, checks, fmt_rate, headline, render, summarize
from rmqfast.bench.scenarios import SCENARIOS, Scenario
from rmqfast.bench.targets import DirectTarget, RmqfastTarget, Target
from rmqfast.progress import Stages, stage


@contextlib.contextmanager
def started(targets: list[Target]) -> Iterator[list[Target]]:
    """Start the targets in order; stop those that started, in reverse, on the way out."""
    up: list[Target] = []
    try:
        for t in targets:
            print(f"bench: starting {t.name} ...", file=sys.stderr, flush=True)
            try:
                t.start()
            except BaseException:
                t.stop()  # whatever it got to start (temp dirs, processes)
                raise
            up.append(t)
        yield up
    finally:
        for t in reversed(up):
            t.stop()


def run(args: argparse.Namespace) -> int:
    """One whole run with the options ``rmqfast.bench.cli`` parsed; the exit status."""
    scenarios = [SCENARIOS[s] for s in args.scenario_list]
    # what stage the bench is in and for how long: a line per run, a status line every 5 s within it
    st = Stages("bench", total=3 + args.rounds * len(scenarios) * len(args.target_list), every=5.0, out=sys.stderr)
    with st.stage("building the load generator and the null broker (C)"):
        tools = build_tools(args.build_dir)
    haproxy_exe = _haproxy(args)
    with st.stage("reading the machine (and how busy it is)"):
        machine = _machine(tools, haproxy_exe)
    run_id, out_path, common = results_file(args.results, (machine["git_commit"] or "nogit")[:8],
                                            "short" if args.short else "full")
    common["machine"] = machine
    print(f"bench: {len(args.target_list)} targets x {len(scenarios)} scenarios x {args.rounds} rounds, "
          f"{args.warmup:g} s warm-up + {args.duration:g} s each; results -> {out_path}", file=sys.stderr)

    rss: dict[str, list[dict[str, int]]] = {}
    with open(out_path, "a") as out, NullBroker(tools) as broker:

        def emit(rec: dict[str, Any]) -> None:
            out.write(json.dumps({**common, "ts": now_iso(), **rec}) + "\n")
            out.flush()

        targets = _targets(args, tools, broker, haproxy_exe)
        with contextlib.ExitStack() as up:
            with st.stage(f"starting {len(targets)} target(s)"):
                up.enter_context(started(targets))
            runs, failed = _rounds(args, tools, broker, targets, scenarios, emit, st)
            for t in targets:
                if isinstance(t, RmqfastTarget):
                    rss[t.name] = [{"pid": pid, **memory_kib(pid)} for pid in t.worker_pids()]
                    for w in rss[t.name]:
                        emit({"kind": "rss", "target": t.name, **w})
    if broker.final_stats:
        with open(out_path, "a") as out:
            out.write(json.dumps({**common, "kind": "nullbroker", **broker.final_stats}) + "\n")
    _summary(args, run_id, out_path, common, machine, runs, rss)
    if failed:
        print(f"bench: {failed} run(s) failed or counted errors (see the results file)", file=sys.stderr)
        return 1
    return 0


def _haproxy(args: argparse.Namespace) -> Any:
    """The HAProxy executable when a HAProxy target was asked for (else, or not found, None:
    the HAProxy targets are dropped from ``args.target_list``)."""
    if not any(t.startswith("haproxy") for t in args.target_list):
        return None
    exe = ensure_haproxy(install=not args.no_install)
    if exe is None:
        print("bench: skipping the HAProxy targets", file=sys.stderr)
        args.target_list = [t for t in args.target_list if not t.startswith("haproxy")]
    return exe


def _machine(tools: Any, haproxy_exe: Any) -> dict[str, Any]:
    """The machine's description, with the cores other processes used in the second before."""
    machine = machine_info(tools, haproxy_exe)
    before = machine_cpu()["task"]
    time.sleep(1.0)
    machine["busy_cores_before"] = round(machine_cpu()["task"] - before, 2)
    if machine["busy_cores_before"] > 2 * NOISE_CORES:
        print(f"bench: WARNING: the machine is busy before the bench starts ({machine['busy_cores_before']} cores "
              "used by other processes); results will be disturbed", file=sys.stderr)
    return machine


def _targets(args: argparse.Namespace, tools: Any, broker: NullBroker, haproxy_exe: Any) -> list[Target]:
    targets: list[Target] = []
    for name in args.target_list:
        if name == "direct":
            targets.append(DirectTarget(broker))
        elif name == "relay-floor":
            targets.append(FloorTarget(tools, broker.port))
        elif name.startswith("haproxy"):
            assert haproxy_exe is not None
            targets.append(HAProxyTarget(haproxy_exe, broker.port, 1 if name == "haproxy-1t" else 2, name))
        else:
            workers = 1 if name == "rmqfast-1w" else args.workers
            targets.append(RmqfastTarget(broker.port, workers=workers, pure=name == "rmqfast-pure", name=name,
                                         uring=name != "rmqfast-syscalls"))
    return targets


def _rounds(args: argparse.Namespace, tools: Any, broker: NullBroker, targets: list[Target],
            scenarios: list[Scenario], emit: Any, st: Stages | None = None) -> tuple[list[dict[str, Any]], int]:
    """Every scenario against every target, round after round (the target order rotates);
    the run records and how many runs failed."""
    runs: list[dict[str, Any]] = []
    failed = 0
    step = 0
    for rnd in range(args.rounds):
        for sc in scenarios:
            order = targets[step % len(targets):] + targets[: step % len(targets)]
            step += 1
            for t in order:
                try:
                    with stage(st, f"round {rnd + 1}/{args.rounds} {sc.name} against {t.name} "
                                   f"({args.warmup:g} s warm-up + {args.duration:g} s)"):
                        wait_idle([pid for x in targets for pid in x.pids()] + broker.pids)
                        res = run_loadgen(tools, t.port, sc, warmup=args.warmup, duration=args.duration,
                                          cpu_groups={"target": t.pids(), "nullbroker": broker.pids})
                except BenchError as exc:
                    failed += 1
                    print(f"bench: {sc.name} {t.name}: {exc}", file=sys.stderr)
                    emit({"kind": "error", "round": rnd, "scenario": sc.name, "target": t.name, "error": str(exc)})
                    continue
                rec = _run_record(rnd, sc, t, res)
                if rec["loadgen"]["errors"] or not rec["loadgen"]["responses"]:
                    failed += 1
                runs.append(rec)
                emit(rec)
                _progress(rec, args.rounds)
    return runs, failed


def _summary(args: argparse.Namespace, run_id: str, out_path: Any, common: dict[str, Any], machine: dict[str, Any],
             runs: list[dict[str, Any]], rss: dict[str, list[dict[str, int]]]) -> None:
    """Summary and checks: appended to the results file and printed (a table, or JSON)."""
    cells = summarize(runs)
    found = checks(cells, rss)
    with open(out_path, "a") as out:
        for c in cells.values():
            out.write(json.dumps({**common, "kind": "summary", **asdict(c)}) + "\n")
        for ch in found:
            out.write(json.dumps({**common, "kind": "check", **asdict(ch)}) + "\n")
    if args.json:
        print(json.dumps({"run_id": run_id, "results": str(out_path), "machine": machine,
                          "cells": [asdict(c) for c in cells.values()], "checks": [asdict(c) for c in found],
                          "rss": rss}, indent=2))
        return
    print()
    print(headline(run_id, machine))
    print(f"{args.rounds} round(s), {args.warmup:g} s warm-up + {args.duration:g} s per run; medians; "
          "proxy CPU = cores used by the target's processes; CPU us/req = their CPU time per answered request; "
          "other = cores used by processes outside the bench")
    print()
    print(render(cells, args.scenario_list, args.target_list, rss, found))
    print()
    print(f"results: {out_path}")


def _run_record(rnd: int, sc: Scenario, t: Target, res: dict[str, Any]) -> dict[str, Any]:
    cpu = res.pop("cpu")
    target = cpu["target"]
    answered = res["rps"] * cpu["window_s"]
    return {
        "kind": "run", "round": rnd, "scenario": sc.name, "target": t.name, "target_info": t.info(),
        "params": asdict(sc), "loadgen": res,
        "cpu": cpu,
        "target_cpu": target,
        "target_cpu_us_per_req": round((target["user_s"] + target["sys_s"]) * 1e6 / answered, 2) if answered else None,
    }


def _progress(rec: dict[str, Any], rounds: int) -> None:
    lg = rec["loadgen"]
    lat = lg["lat_us"]
    print(f"  round {rec['round'] + 1}/{rounds}  {rec['scenario']:<11} {rec['target']:<13} "
          f"{fmt_rate(lg['rps']):>10} req/s  p50 {lat['p50'] / 1000:6.2f} ms  p99 {lat['p99'] / 1000:7.2f} ms  "
          f"target CPU {rec['target_cpu']['cores']:.2f}  other {rec['cpu']['machine']['other_cores']:.2f}  "
          f"errors {lg['errors']}", file=sys.stderr, flush=True)
