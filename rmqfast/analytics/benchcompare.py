"""Benchmark results (``rmqfast bench`` JSON lines): the runs side by side (rmqfast, direct,
HAProxy) and each run against the earlier ones of the same mode, scenario and target, flagged
when its throughput drops or its p99 latency rises past the thresholds below.
"""

from __future__ import annotations

import math
from typing import Any

from rmqfast.analytics.results import Result, Rows
from rmqfast.analytics.results import rows_of as _rows

#: A run is flagged when its throughput is this much below the median of earlier runs of
#: the same mode, scenario and target (or its p99 latency this much above).
RPS_DROP = 0.10
P99_RISE = 0.25


def bench_jobs(spark: Any, paths: list[str], res: Result) -> None:
    """Benchmark JSON lines (small: thousands of lines): read once (one schema-inference job and
    one collect) and split on the driver."""
    from pyspark.sql import functions as F

    raw = (spark.read.option("mode", "PERMISSIVE").option("columnNameOfCorruptRecord", "_corrupt_record")
           .json(paths).withColumn("_file", F.input_file_name()))
    cols = set(raw.columns)
    want = ["run_id", "mode", "scenario", "target", "rps", "p50_us", "p99_us", "p999_us", "cpu_us_per_req",
            "cores", "errors", "runs"]
    check_cols = ["name", "value", "goal", "met"]
    sel = [F.col(c) if c in cols else F.lit(None).alias(c) for c in ["kind", *want, *check_cols, "_corrupt_record"]]
    sel.append(F.col("machine.git_commit").alias("git_commit") if "machine" in cols
               else F.lit(None).alias("git_commit"))
    lines = _rows(raw.select(*sel, "_file"))
    bad: dict[str, int] = {}
    for r in lines:
        if r["_corrupt_record"] is not None:
            bad[r["_file"]] = bad.get(r["_file"], 0) + 1
    for f, n in sorted(bad.items()):
        res.problems.append((f, f"{n} corrupt benchmark line(s) skipped"))
    lines = [r for r in lines if r["_corrupt_record"] is None]
    if "kind" not in cols or not any(r["kind"] for r in lines):
        res.notes.append("benchmark files: no readable lines")
        return
    summaries = [r for r in lines if r["kind"] == "summary"]
    commits: dict[Any, Any] = {}
    for r in summaries:
        if r["git_commit"] is not None:
            commits.setdefault(r["run_id"], r["git_commit"])
    rows = [{**{c: r[c] for c in want}, **({"git_commit": commits.get(r["run_id"])} if "machine" in cols else {})}
            for r in summaries]
    res.counts["bench_runs"] = len({r["run_id"] for r in rows})
    checks = [{"run_id": r["run_id"], **{c: r[c] for c in check_cols}} for r in lines if r["kind"] == "check"] \
        if {"name", "goal", "met"} <= cols else []
    res.tables["bench_checks"] = sorted(checks, key=lambda r: (r["run_id"], r["name"]))
    res.tables.update(compare_bench(rows))


def compare_bench(rows: Rows) -> dict[str, Rows]:
    """Side by side per run (ratios to direct and to the best HAProxy) and against earlier runs."""
    by_run: dict[str, dict[tuple[str, str], dict[str, Any]]] = {}
    for r in rows:
        by_run.setdefault(r["run_id"], {})[(r["scenario"], r["target"])] = r
    side = []
    for run_id in sorted(by_run):
        cells = by_run[run_id]
        for (sc, tg), r in sorted(cells.items()):
            direct = cells.get((sc, "direct"))
            hap = [c for (s2, t2), c in cells.items() if s2 == sc and t2.startswith("haproxy") and c.get("rps")]
            best = max(hap, key=lambda c: c["rps"]) if hap else None
            side.append({
                "run_id": run_id, "mode": r.get("mode"), "git_commit": r.get("git_commit"), "scenario": sc,
                "target": tg, "rps": r.get("rps"), "p50_us": r.get("p50_us"), "p99_us": r.get("p99_us"),
                "p999_us": r.get("p999_us"), "cpu_us_per_req": r.get("cpu_us_per_req"),
                "vs_direct": _ratio(r.get("rps"), direct.get("rps") if direct else None),
                "vs_best_haproxy": _ratio(r.get("rps"), best["rps"] if best else None),
                "best_haproxy": best["target"] if best else None,
            })
    hist = []
    series: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for s in side:
        series.setdefault((s["mode"] or "", s["scenario"], s["target"]), []).append(s)
    for (mode, sc, tg), runs in sorted(series.items()):
        for i, s in enumerate(runs):
            earlier = [x for x in runs[:i] if x["rps"]]
            med_rps = _median([x["rps"] for x in earlier])
            med_p99 = _median([x["p99_us"] for x in earlier if x["p99_us"]])
            prev = runs[i - 1] if i else None
            flags = []
            if med_rps and s["rps"] is not None and s["rps"] < (1 - RPS_DROP) * med_rps:
                flags.append(f"throughput {s['rps'] / med_rps - 1:+.0%} vs median of {len(earlier)} earlier")
            if med_p99 and s["p99_us"] and s["p99_us"] > (1 + P99_RISE) * med_p99:
                flags.append(f"p99 {s['p99_us'] / med_p99 - 1:+.0%} vs median of {len(earlier)} earlier")
            hist.append({
                "mode": mode, "scenario": sc, "target": tg, "run_id": s["run_id"], "rps": s["rps"],
                "p99_us": s["p99_us"], "prev_rps": prev["rps"] if prev else None,
                "vs_prev": _ratio(s["rps"], prev["rps"] if prev else None), "median_earlier_rps": med_rps,
                "vs_median_earlier": _ratio(s["rps"], med_rps), "regression": "; ".join(flags),
            })
    return {"bench_side_by_side": side, "bench_history": hist}


def _ratio(a: Any, b: Any) -> float | None:
    if a is None or not b:
        return None
    return float(a) / float(b)


def _median(xs: list[float]) -> float | None:
    xs = sorted(float(x) for x in xs if x is not None and not math.isnan(float(x)))
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


# All of it -----------------------------------------------------------------------------------

