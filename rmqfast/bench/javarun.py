"""What the Java-producer bench modes share (``--real``, ``--clouds``).

Both run the Java driver's ``perf-produce`` scenario (rocketmq-client 5.3.3, synchronous
sends, every send's latency recorded) against several name-server addresses in turn, round
after round, and write one ``run`` line per run and one ``summary`` line per target.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from rmqfast.bench.common import DEFAULT_RESULTS_DIR, now_iso, results_file
from rmqfast.testing.javaclient import run_driver


def java_args(argv: list[str] | None, *, prog: str, description: str, flag: str,
              short_s: float) -> argparse.Namespace:
    """The options every Java-producer mode takes, parsed and checked.

    ``flag`` (``--real``, ``--clouds``) is accepted and hidden: it is how ``rmqfast bench`` got
    here.  ``--short`` is one round of ``short_s`` seconds.
    """
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--duration", type=float, default=8.0, help="measured seconds per run (default 8)")
    ap.add_argument("--warmup", type=float, default=3.0, help="warm-up seconds per run (default 3)")
    ap.add_argument("--threads", type=int, default=16, help="sending threads in the producer (default 16)")
    ap.add_argument("--body-size", type=int, default=1024, help="message body bytes (default 1024)")
    ap.add_argument("--workers", type=int, default=2, help="rmqfast worker processes per proxy (default 2)")
    ap.add_argument("--short", action="store_true", help=f"1 round of {short_s:g} s runs")
    ap.add_argument("--results", type=Path, default=DEFAULT_RESULTS_DIR, help="results folder (default results/bench)")
    args = ap.parse_args(argv)
    if args.short:
        args.rounds, args.duration, args.warmup = 1, short_s, 2.0
    if args.rounds < 1 or args.duration <= 0 or args.warmup < 0 or args.threads < 1 or args.body_size < 1 \
            or args.workers < 1:
        ap.error("--rounds, --threads, --body-size and --workers must be >= 1, --duration > 0, --warmup >= 0")
    return args


class JavaRuns:
    """One Java-producer bench run: its results file, its ``run`` records and failures.

    ``with JavaRuns(args, "real", "real-broker") as jr: res = jr.produce(...); jr.record(...)``.
    """

    def __init__(self, args: argparse.Namespace, suffix: str, mode: str) -> None:
        self.args = args
        self.run_id, self.path, self.common = results_file(args.results, suffix, mode)
        self.runs: list[dict[str, Any]] = []
        self.failed = 0
        self._out: IO[str] | None = None

    def __enter__(self) -> JavaRuns:
        self._out = open(self.path, "a")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None

    def write(self, rec: dict[str, Any]) -> None:
        assert self._out is not None, "use JavaRuns as a context manager"
        self._out.write(json.dumps(rec) + "\n")
        self._out.flush()

    def produce(self, namesrv: str, topic: str, *, grace: float) -> dict[str, Any]:
        """One ``perf-produce`` run against ``namesrv``; ``grace`` seconds beyond warm-up and run."""
        a = self.args
        return run_driver(
            "perf-produce", namesrv, "5",
            topic=topic, threads=a.threads, body_size=a.body_size,
            warmup_ms=int(a.warmup * 1000), duration_ms=int(a.duration * 1000),
            timeout=a.warmup + a.duration + grace, check=False, heap_mb=512, allow_failures=True,
        )

    def record(self, rnd: int, scenario: str, target: str, res: dict[str, Any], *, note: str = "",
               **extra: Any) -> dict[str, Any]:
        """The ``run`` line of one driver result (``extra`` added to it): written, kept, shown."""
        a = self.args
        rec = {
            **self.common, "ts": now_iso(), "kind": "run", "round": rnd, "scenario": scenario, "target": target,
            "params": {"threads": a.threads, "body_size": a.body_size, "duration_s": a.duration},
            "loadgen": {"rps": res.get("msg_per_s", 0.0), "responses": res.get("sent_count", 0),
                        "errors": res.get("failed_count", 0), "lat_us": res.get("lat_us", {})},
            **extra,
            "driver_ok": bool(res.get("ok")),
        }
        if not res.get("ok") or not res.get("sent_count"):
            self.failed += 1
            rec["error"] = res.get("error") or f"exit {res.get('exit_code')}"
        self.runs.append(rec)
        self.write(rec)
        lat = rec["loadgen"]["lat_us"]
        print(f"  round {rnd + 1}/{a.rounds}  {target:<8} {rec['loadgen']['rps']:>9,.0f} msg/s  "
              f"p50 {lat.get('p50', 0) / 1000:6.2f} ms  p99 {lat.get('p99', 0) / 1000:7.2f} ms  "
              f"failed {rec['loadgen']['errors']}{note}", file=sys.stderr, flush=True)
        return rec

    def summary(self, targets: Sequence[str], **sums: str) -> list[dict[str, Any]]:
        """Medians per target over the rounds that sent something, written as ``summary``
        lines; ``sums`` adds totals (row key = run-record key)."""
        rows = []
        for target in targets:
            rs = [r for r in self.runs if r["target"] == target and r["loadgen"]["responses"]]
            if not rs:
                continue
            lat = [r["loadgen"]["lat_us"] for r in rs]
            rows.append({
                "scenario": rs[0]["scenario"], "target": target, "rounds": len(rs),
                "rps": statistics.median(r["loadgen"]["rps"] for r in rs),
                "rounds_rps": [r["loadgen"]["rps"] for r in rs],
                "p50_us": statistics.median(x.get("p50", 0) for x in lat),
                "p99_us": statistics.median(x.get("p99", 0) for x in lat),
                "p999_us": statistics.median(x.get("p999", 0) for x in lat),
                "errors": sum(r["loadgen"]["errors"] for r in rs),
                **{k: sum(r[v] for r in rs) for k, v in sums.items()},
            })
        for row in rows:
            self.write({**self.common, "kind": "summary", **row})
        return rows


def rounds_text(row: dict[str, Any]) -> str:
    """A summary row's per-round rates, ``12,345, 12,001``."""
    return ", ".join(f"{x:,.0f}" for x in row["rounds_rps"])
