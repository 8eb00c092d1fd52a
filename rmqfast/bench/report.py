"""The null-broker bench's summary: medians per cell, the issue's targets, the table."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rmqfast.bench.common import BenchError
from rmqfast.bench.scenarios import ALL_TARGETS, SCENARIOS


@dataclass
class Cell:
    """Medians of one (scenario, target) over the rounds."""

    scenario: str
    target: str
    runs: int
    rps: float
    p50_us: float
    p99_us: float
    p999_us: float
    send_rate: float
    cores: float
    cpu_us_per_req: float
    other_cores: float
    errors: int
    rounds_rps: list[float] = field(default_factory=list)


def summarize(runs: list[dict[str, Any]]) -> dict[tuple[str, str], Cell]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["scenario"], r["target"]), []).append(r)
    cells = {}
    for (sc, tg), rs in groups.items():
        def med(get: Any, rs: list[dict[str, Any]] = rs) -> float:
            return float(statistics.median(get(r) for r in rs))

        cells[(sc, tg)] = Cell(
            scenario=sc, target=tg, runs=len(rs),
            rps=med(lambda r: r["loadgen"]["rps"]),
            p50_us=med(lambda r: r["loadgen"]["lat_us"]["p50"]),
            p99_us=med(lambda r: r["loadgen"]["lat_us"]["p99"]),
            p999_us=med(lambda r: r["loadgen"]["lat_us"]["p999"]),
            send_rate=med(lambda r: r["loadgen"]["send_rate"]),
            cores=med(lambda r: r["target_cpu"]["cores"]),
            cpu_us_per_req=med(lambda r: r["target_cpu_us_per_req"] or 0.0),
            other_cores=med(lambda r: r["cpu"]["machine"]["other_cores"]),
            errors=sum(int(r["loadgen"]["errors"]) for r in rs),
            rounds_rps=[float(r["loadgen"]["rps"]) for r in rs],
        )
    return cells


#: A run during which other processes used more CPU than this is "disturbed".
NOISE_CORES = 0.1


@dataclass
class Check:
    name: str
    value: float | None
    goal: str
    met: bool | None
    unit: str = ""
    #: Other processes used > NOISE_CORES during a run this value comes from.
    disturbed: bool = False


def _noisy(*cs: Cell | None) -> bool:
    """Other processes used more than NOISE_CORES during one of these runs."""
    return any(c is not None and c.other_cores > NOISE_CORES for c in cs)


def _open_loop_checks(cells: dict[tuple[str, str], Cell]) -> list[Check]:
    """Added p99 over direct in the open-loop scenarios (the goal on ``rmqfast``; the others, for
    scale, info: ``relay-floor`` is what any user-space relay adds on this machine)."""
    out = []
    for sc, goal_ms in (("open-60k", 0.5), ("open-120k", None)):
        for tg in ("rmqfast", "rmqfast-1w", "haproxy", "haproxy-1t", "relay-floor"):
            d, p = cells.get((sc, "direct")), cells.get((sc, tg))
            if tg != "rmqfast" and p is None:
                continue
            added = (p.p99_us - d.p99_us) / 1000 if d and p else None
            kept_up = p is not None and p.send_rate >= 0.98 * SCENARIOS[sc].rate and p.rps >= 0.98 * p.send_rate
            g = goal_ms if tg == "rmqfast" else None
            met = None if added is None or g is None else added < g and kept_up
            goal = f"< {g} ms (at the full rate)" if g is not None else "info"
            if added is not None or g is not None:
                out.append(Check(f"{sc} {tg} added p99 over direct", added, goal, met, "ms", _noisy(d, p)))
    return out


def checks(cells: dict[tuple[str, str], Cell], rss: dict[str, list[dict[str, int]]]) -> list[Check]:
    """The issue's targets, evaluated on the medians (``None`` when not measured)."""

    def cell(sc: str, tg: str) -> Cell | None:
        return cells.get((sc, tg))

    noisy = _noisy

    def best_haproxy(sc: str) -> Cell | None:
        hs = [c for c in (cell(sc, "haproxy"), cell(sc, "haproxy-1t")) if c is not None]
        return max(hs, key=lambda c: c.rps) if hs else None

    def best_rmqfast(sc: str) -> Cell | None:
        rs = [c for c in (cell(sc, "rmqfast"), cell(sc, "rmqfast-1w")) if c is not None]
        return max(rs, key=lambda c: c.rps) if rs else None

    def vs(sc: str, a: Cell | None, b: Cell | None, name: str, goal: float | None) -> Check:
        r = a.rps / b.rps if a is not None and b is not None and b.rps else None
        met = None if r is None or goal is None else r >= goal
        return Check(f"{sc} {name}", r, f">= {goal}" if goal is not None else "info", met, disturbed=noisy(a, b))

    out: list[Check] = []
    c = cell("send-16x32", "rmqfast")
    out.append(Check("send-16x32 rmqfast msg/s", c.rps if c else None, ">= 60000",
                     None if c is None else c.rps >= 60000, "msg/s", noisy(c)))
    out.append(vs("send-16x32", c, best_haproxy("send-16x32"), "rmqfast / best HAProxy", 1.0))
    out.append(vs("send-64x1", cell("send-64x1", "rmqfast"), best_haproxy("send-64x1"), "rmqfast / best HAProxy", 1.0))
    for sc in ("send-16x32", "send-64x1"):  # one worker, as HAProxy's best of 1 and 2 threads
        if cell(sc, "rmqfast-1w") is not None:
            out.append(vs(sc, cell(sc, "rmqfast-1w"), best_haproxy(sc), "rmqfast-1w / best HAProxy", None))
            # each proxy in its better configuration for this machine (the goal stays on 2 workers)
            out.append(vs(sc, best_rmqfast(sc), best_haproxy(sc), "best rmqfast / best HAProxy", None))
    out.extend(_open_loop_checks(cells))
    # the proxy's own CPU per answered request: steadier than throughput on a shared machine
    for sc in ("send-16x32", "send-64x1", "open-60k", "open-120k", "pull-16x4"):
        for tg in ("rmqfast", "rmqfast-1w", "rmqfast-syscalls", "haproxy", "haproxy-1t", "relay-floor"):
            ce = cell(sc, tg)
            if ce is not None:
                out.append(Check(f"{sc} {tg} CPU per request", ce.cpu_us_per_req, "info", None, "us", noisy(ce)))
    workers = rss.get("rmqfast", [])
    worst = max((w.get("VmRSS", 0) for w in workers), default=None)
    out.append(Check("rmqfast worker RSS after the run (max)", None if worst is None else worst / 1024,
                     "< 64 MB", None if worst is None else worst < 64 * 1024, "MiB"))
    for sc in ("send-16x32", "send-64x1", "pull-16x4"):
        for a, b in (("rmqfast", "haproxy"), ("rmqfast", "haproxy-1t"), ("rmqfast", "direct"),
                     ("rmqfast-pure", "rmqfast"), ("rmqfast", "rmqfast-syscalls"), ("haproxy", "direct"),
                     ("haproxy-1t", "haproxy"), ("rmqfast", "relay-floor"), ("rmqfast-1w", "relay-floor"),
                     ("haproxy-1t", "relay-floor")):
            ca, cb = cell(sc, a), cell(sc, b)
            if ca is not None and cb is not None:
                out.append(vs(sc, ca, cb, f"{a} / {b}", None))
    return out


def fmt_rate(x: float) -> str:
    """A rate with thousands separators and no decimals."""
    return f"{x:,.0f}"


def render(cells: dict[tuple[str, str], Cell], scenarios: Sequence[str], targets: Sequence[str],
           rss: dict[str, list[dict[str, int]]], found: list[Check]) -> str:
    lines = []
    head = f"{'scenario':<12} {'target':<13} {'req/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'p99.9 ms':>9} " \
           f"{'proxy CPU':>9} {'CPU us/req':>10} {'other':>5} {'errors':>6}  rounds (req/s)"
    lines.append(head)
    lines.append("-" * len(head))
    for sc in scenarios:
        for tg in targets:
            c = cells.get((sc, tg))
            if c is None:
                continue
            rounds = ", ".join(fmt_rate(x) for x in c.rounds_rps)
            cpu = f"{c.cores:.2f}" if tg != "direct" else "-"
            per = f"{c.cpu_us_per_req:.1f}" if tg != "direct" else "-"
            lines.append(f"{sc:<12} {tg:<13} {fmt_rate(c.rps):>10} {c.p50_us / 1000:>8.2f} {c.p99_us / 1000:>8.2f} "
                         f"{c.p999_us / 1000:>9.2f} {cpu:>9} {per:>10} {c.other_cores:>5.2f} {c.errors:>6}  {rounds}")
        d = cells.get((sc, "direct"))
        if sc in SCENARIOS and SCENARIOS[sc].open_loop and d is not None:
            for tg in targets:
                c = cells.get((sc, tg))
                if c is None or tg == "direct":
                    continue
                note = "" if c.send_rate >= 0.98 * SCENARIOS[sc].rate and c.rps >= 0.98 * c.send_rate else \
                    f"  (did not keep up: answered {fmt_rate(c.rps)}/s)"
                lines.append(f"{'':<12} {tg:<13} added over direct: p50 {(c.p50_us - d.p50_us) / 1000:+.2f} ms, "
                             f"p99 {(c.p99_us - d.p99_us) / 1000:+.2f} ms, "
                             f"p99.9 {(c.p999_us - d.p999_us) / 1000:+.2f} ms{note}")
        lines.append("")
    for tg, workers in rss.items():
        desc = ", ".join(f"pid {w['pid']}: {w.get('VmRSS', 0) / 1024:.1f} MiB (peak {w.get('VmHWM', 0) / 1024:.1f})"
                         for w in workers)
        lines.append(f"RSS {tg} workers after the run: {desc}")
    noisy = sorted({c.scenario for c in cells.values() if c.other_cores > NOISE_CORES})
    if noisy:
        lines.append(f"WARNING: other processes used > {NOISE_CORES} core during {', '.join(noisy)} (column 'other'): "
                     "those numbers are disturbed; rerun on a quiet machine.")
    lines.append("")
    lines.append("Targets and ratios, on medians:")
    for ch in found:
        if ch.value is None:
            val = "not measured"
        elif ch.unit in ("msg/s",):
            val = fmt_rate(ch.value)
        else:
            val = f"{ch.value:.3f}" + (f" {ch.unit}" if ch.unit else "")
        mark = {True: "MET ", False: "MISS", None: "    "}[ch.met]
        note = "   (disturbed: other processes were busy)" if ch.disturbed else ""
        lines.append(f"  {mark} {ch.name:<44} {val:>14}   goal {ch.goal}{note}")
    return "\n".join(lines)


def headline(run_id: str, m: dict[str, Any]) -> str:
    """The first line of a summary: which run, on what machine."""
    return (f"rmqfast bench {run_id} on {m['cpu_model']} ({m['cores']} cores), kernel {m['kernel']}, "
            f"Python {m['python']}, {m.get('haproxy') or 'no HAProxy'}")


def report(path: Path) -> str:
    """The summary table of an earlier results file."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    runs = [r for r in records if r.get("kind") == "run"]
    if not runs:
        raise BenchError(f"{path}: no run records")
    rss: dict[str, list[dict[str, int]]] = {}
    for r in records:
        if r.get("kind") == "rss":
            rss.setdefault(r["target"], []).append({k: r[k] for k in ("pid", "VmRSS", "VmHWM") if k in r})
    scenarios = list(dict.fromkeys(r["scenario"] for r in runs))
    targets = [t for t in ALL_TARGETS if any(r["target"] == t for r in runs)]
    cells = summarize(runs)
    head = f"{headline(runs[0]['run_id'], runs[0]['machine'])}; {max(r['round'] for r in runs) + 1} round(s); medians"
    return head + "\n\n" + render(cells, scenarios, targets, rss, checks(cells, rss))


