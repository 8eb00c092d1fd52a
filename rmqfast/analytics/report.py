"""``rmqfast analyze RECORDS_DIR -o REPORT_DIR`` (also ``spark-submit spark/analyze.py``).

Reads traffic records and benchmark results with Spark, writes ``REPORT_DIR/report.html``
with PNG charts in ``REPORT_DIR/charts/`` and every result table as Parquet and CSV in
``REPORT_DIR/tables/``.  RECORDS_DIR may be any Hadoop URI (hdfs://, s3a://...) when a
cluster is used; REPORT_DIR is a local directory on the driver (the tables are small).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import html
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from rmqfast.analytics.inputs import find_inputs
from rmqfast.analytics.jobs import ACCURACY, HIST_REL_ERROR, Result, Rows, run_all
from rmqfast.records.parquet import Column, write_table


def _kind(values: list[Any]) -> tuple[str, bool]:
    nullable = any(v is None for v in values)
    vs = [v for v in values if v is not None]
    if vs and all(isinstance(v, bool | int) for v in vs):
        return "int64", nullable
    if vs and all(isinstance(v, int | float) for v in vs):
        return "double", nullable
    return "string", nullable


def write_tables(tables: dict[str, Rows], out: Path) -> dict[str, int]:
    """Each table as ``NAME.parquet`` and ``NAME.csv``; returns row counts."""
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, rows in tables.items():
        keys: list[str] = []
        for r in rows:
            for k in r:
                if k not in keys:
                    keys.append(k)
        with open(out / f"{name}.csv", "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        if keys:
            cols = []
            data: dict[str, list[Any]] = {}
            for k in keys:
                vals = [r.get(k) for r in rows]
                kind, nullable = _kind(vals)
                if kind == "double":
                    vals = [None if v is None else float(v) for v in vals]
                elif kind == "string":
                    vals = [None if v is None else str(v) for v in vals]
                cols.append(Column(k, kind, nullable))
                data[k] = vals
            write_table(out / f"{name}.parquet", cols, data, codec="gzip",
                        metadata={"rmqfast.table": name})
        counts[name] = len(rows)
    return counts


# Charts ----------------------------------------------------------------------------------


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _time_chart(path: Path, title: str, rows: Rows, series_key: Any, value: str, ylabel: str,
                top: int = 8) -> bool:
    if not rows:
        return False
    plt = _plt()
    totals: dict[str, float] = {}
    for r in rows:
        k = series_key(r)
        totals[k] = totals.get(k, 0.0) + float(r[value] or 0)
    keep = sorted(totals, key=lambda k: -totals[k])[:top]
    series: dict[str, dict[int, float]] = {}
    for r in rows:
        k = series_key(r)
        k = k if k in keep else "other"
        d = series.setdefault(k, {})
        d[r["bucket"]] = d.get(r["bucket"], 0.0) + float(r[value] or 0)
    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=90)
    for k, d in sorted(series.items(), key=lambda kv: -sum(kv[1].values())):
        xs = sorted(d)
        ax.plot([dt.datetime.fromtimestamp(x, dt.UTC) for x in xs], [d[x] for x in xs], label=k, linewidth=1.2)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _bar_chart(path: Path, title: str, labels: list[str], groups: dict[str, list[float | None]], ylabel: str,
               log: bool = False) -> bool:
    if not labels:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=90)
    n = max(1, len(groups))
    width = 0.8 / n
    for i, (name, vals) in enumerate(groups.items()):
        ax.bar([j + i * width for j in range(len(labels))], [v or 0 for v in vals], width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    if log:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def charts(res: Result, out: Path) -> dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    made: dict[str, str] = {}
    t = res.tables

    def add(name: str, ok: bool) -> None:
        if ok:
            made[name] = f"charts/{name}.png"

    add("agg_topic_msgs", _time_chart(out / "agg_topic_msgs.png", "Messages/s per topic (aggregates)",
                                      t.get("agg_throughput_topic", []), lambda r: r["topic"], "messages_per_s",
                                      "messages/s"))
    add("agg_worker_frames", _time_chart(out / "agg_worker_frames.png", "Frames/s per worker (aggregates)",
                                         t.get("agg_throughput_worker", []),
                                         lambda r: f"{r['host']}/w{r['worker']}/{r['role']}", "count_per_s",
                                         "frames/s"))
    add("agg_errors", _time_chart(out / "agg_errors.png", "Error responses/s (aggregates)",
                                  t.get("agg_errors_over_time", []), lambda r: r["role"], "errors_per_s", "errors/s"))
    lim = t.get("agg_limiter_over_time", [])
    if lim:
        rows = [{"bucket": r["bucket"], "k": k, "v": r[f"limiter_{k}_per_s"]} for r in lim
                for k in ("rejected", "shaped")]
        add("agg_limiter", _time_chart(out / "agg_limiter.png", "Rate limiter: rejected and shaped per s", rows,
                                       lambda r: r["k"], "v", "requests/s"))
    sp = t.get("agg_spill_over_time", [])
    if sp:
        rows = [{"bucket": r["bucket"], "k": k, "v": r[k]} for r in sp for k in ("spill_backlog", "delivery_lag_ms")]
        add("agg_spill", _time_chart(out / "agg_spill.png", "Spill backlog (messages) and delivery lag (ms)", rows,
                                     lambda r: r["k"], "v", "level"))
    add("sample_topic", _time_chart(out / "sample_topic.png", "Requests/s per topic (sampled records, weighted)",
                                    t.get("sample_throughput_topic", []), lambda r: r["topic"] or "(none)",
                                    "req_per_s", "requests/s"))
    add("sample_worker", _time_chart(out / "sample_worker.png", "Requests/s per worker (sampled records, weighted)",
                                     t.get("sample_throughput_worker", []), lambda r: f"{r['host']}/w{r['worker']}",
                                     "req_per_s", "requests/s"))
    add("sample_results", _time_chart(out / "sample_results.png", "Requests/s by result (sampled records)",
                                      t.get("sample_results_over_time", []), lambda r: r["result"], "req_per_s",
                                      "requests/s"))
    lt = t.get("latency_by_topic", [])[:12]
    add("latency_topic", _bar_chart(out / "latency_topic.png", "Latency per topic (sampled records)",
                                    [r["topic"] or "(none)" for r in lt],
                                    {"p50": [r["p50_us"] for r in lt], "p99": [r["p99_us"] for r in lt],
                                     "p99.9": [r["p999_us"] for r in lt]}, "µs", log=True))
    lc = t.get("latency_by_code", [])
    add("latency_code", _bar_chart(out / "latency_code.png", "Latency per request code (sampled records)",
                                   [str(r["code"]) for r in lc],
                                   {"p50": [r["p50_us"] for r in lc], "p99": [r["p99_us"] for r in lc],
                                    "p99.9": [r["p999_us"] for r in lc]}, "µs", log=True))
    side = t.get("bench_side_by_side", [])
    runs = sorted({r["run_id"] for r in side})
    for sc in sorted({r["scenario"] for r in side if r["scenario"] is not None}):
        targets = sorted({r["target"] for r in side if r["scenario"] == sc})
        groups = {tg: [next((r["rps"] for r in side if r["run_id"] == ru and r["scenario"] == sc
                             and r["target"] == tg), None) for ru in runs] for tg in targets}
        name = "bench_" + "".join(ch if ch.isalnum() else "_" for ch in sc)
        add(name, _bar_chart(out / f"{name}.png", f"Benchmark {sc}: requests/s per run and target", runs, groups,
                             "requests/s"))
    return made


# HTML --------------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10000:
        return f"{v:,}"
    return html.escape(str(v))


def _table(rows: Rows, limit: int = 40, cols: list[str] | None = None, flag: str | None = None) -> str:
    if not rows:
        return "<p class=none>no data</p>"
    keys = cols or list(rows[0].keys())
    h = ["<table><tr>" + "".join(f"<th>{html.escape(k)}</th>" for k in keys) + "</tr>"]
    for r in rows[:limit]:
        cls = " class=flag" if flag and r.get(flag) else ""
        h.append(f"<tr{cls}>" + "".join(f"<td>{_fmt(r.get(k))}</td>" for k in keys) + "</tr>")
    h.append("</table>")
    if len(rows) > limit:
        h.append(f"<p class=none>{len(rows) - limit} more rows in the table files</p>")
    return "".join(h)


CSS = """body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;font-size:12px;
margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}th{background:#eee}
tr.flag td{background:#fdd}.none{color:#888}img{max-width:100%}.problem{color:#a00}"""


def render_html(res: Result, made: dict[str, str], meta: dict[str, Any]) -> str:
    t = res.tables
    p: list[str] = [f"<!doctype html><meta charset=utf-8><title>rmqfast traffic report</title><style>{CSS}</style>",
                    "<h1>rmqfast traffic and benchmark report</h1>"]
    p.append(f"<p>Inputs: {html.escape(', '.join(meta['inputs']))}. Generated {meta['generated']} in "
             f"{meta['seconds']:.1f} s with Spark {html.escape(meta['spark'])} (master "
             f"{html.escape(meta['master'])}).</p>")
    p.append(_table([{"what": k, "value": v} for k, v in sorted(res.counts.items())]))
    p.append("<h2>Input problems</h2>")
    if res.problems:
        p.append("<ul>" + "".join(f"<li class=problem>{html.escape(f)}: {html.escape(w)}</li>"
                                  for f, w in res.problems) + "</ul>")
    else:
        p.append("<p class=none>none: every file was read</p>")
    for n in res.notes:
        p.append(f"<p class=none>{html.escape(n)}</p>")

    def img(name: str) -> None:
        if name in made:
            p.append(f"<p><img src='{made[name]}' alt='{name}'></p>")

    p.append("<h2>Throughput over time</h2>")
    for k, v in res.bucket_s.items():
        p.append(f"<p class=none>{k}: time buckets of {v} s</p>")
    for name in ("agg_topic_msgs", "agg_worker_frames", "sample_topic", "sample_worker"):
        img(name)
    p.append("<h2>Top topics</h2>")
    p.append(_table(t.get("agg_top_topics", []), 20))
    p.append(_table(t.get("sample_top_topics", []), 20,
                    ["topic", "records", "est_requests", "est_req_bytes", "p50_us", "p99_us", "p999_us", "error_rate"]))
    p.append("<h2>Top clients (sampled records)</h2>")
    p.append(_table(t.get("sample_top_clients", []), 20, ["client", "records", "est_requests", "est_req_bytes",
                                                          "est_errors"]))
    p.append("<h2>Latency</h2>")
    if meta.get("percentiles") == "approx":
        p.append(f"<p>From sampled records: <code>percentile_approx(latency_us, ..., {ACCURACY})</code>; the rank "
                 f"of each reported value is within N/{ACCURACY} of the exact rank (N = records in the group).")
    else:
        p.append(f"<p>From sampled records: exact counts in logarithmic bins; each reported value is within "
                 f"{HIST_REL_ERROR:.2%} of the exact quantile (order statistic of rank ceil(q&middot;N)).")
    p.append(" From aggregates: interpolated inside the histogram bucket; error at most the bucket's width.</p>")
    img("latency_code")
    img("latency_topic")
    p.append(_table(t.get("latency_by_code", []), 40))
    p.append(_table(t.get("latency_by_code_topic", []), 60))
    p.append(_table(t.get("agg_latency_hist", []), 40))
    p.append("<h2>Requests and responses by code (aggregates)</h2>")
    p.append(_table(t.get("agg_requests_by_code", []), 60))
    p.append(_table(t.get("agg_responses_by_code", []), 60))
    p.append("<h2>Errors</h2>")
    img("agg_errors")
    img("sample_results")
    p.append(_table(t.get("sample_results_by_code", []), 60))
    p.append("<h2>Rate limiting and shaping</h2>")
    img("agg_limiter")
    if not t.get("agg_limiter_over_time"):
        p.append("<p class=none>no limiter decisions recorded</p>")
    p.append("<h2>Spill backlog and delivery lag</h2>")
    img("agg_spill")
    if not t.get("agg_spill_over_time"):
        p.append("<p class=none>no spill figures recorded</p>")
    p.append("<h2>Benchmarks</h2>")
    side = t.get("bench_side_by_side", [])
    if side:
        p.append("<p>Each run side by side with its baselines (<code>vs_direct</code>, <code>vs_best_haproxy</code> "
                 "are throughput ratios), then against earlier runs of the same mode, scenario and target "
                 "(flagged: throughput 10% below, or p99 25% above, the median of the earlier runs).</p>")
        for name in sorted(made):
            if name.startswith("bench_"):
                img(name)
        p.append(_table(side, 200, ["run_id", "mode", "scenario", "target", "rps", "p50_us", "p99_us", "p999_us",
                                    "cpu_us_per_req", "vs_direct", "vs_best_haproxy", "best_haproxy"]))
        hist = t.get("bench_history", [])
        flagged = [r for r in hist if r["regression"]]
        p.append(f"<h3>Against earlier runs ({len(flagged)} flagged)</h3>")
        p.append(_table(hist, 300, flag="regression"))
        p.append("<h3>Issue targets per run</h3>")
        p.append(_table(t.get("bench_checks", []), 200))
    else:
        p.append("<p class=none>no benchmark results found</p>")
    p.append("<h2>Tables</h2><p>Every table above, complete, as Parquet and CSV in <code>tables/</code>.</p>")
    return "\n".join(p)


# Entry point -------------------------------------------------------------------------------


def analyze(records: list[str], out_dir: str | os.PathLike[str], *, master: str | None = None,
            spark: Any = None, driver_memory: str = "2g", quiet: bool = False,
            percentiles: str = "hist") -> dict[str, Any]:
    """Run the jobs and write the report; returns a summary (also written as summary.json)."""
    t0 = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    own = spark is None
    if own:
        from rmqfast.analytics.spark import get_spark

        spark = get_spark(master, driver_memory=driver_memory)
    try:
        inputs = find_inputs(records, spark)
        res = run_all(spark, inputs, percentiles)
        jobs_s = time.monotonic() - t0
        counts = write_tables(res.tables, out / "tables")
        made = charts(res, out / "charts")
        meta = {
            "inputs": records,
            "generated": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "seconds": time.monotonic() - t0,
            "spark": spark.version,
            "master": spark.sparkContext.master,
            "percentiles": percentiles,
        }
        (out / "report.html").write_text(render_html(res, made, meta), encoding="utf-8")
        summary = {
            "report": str(out / "report.html"), "seconds": round(time.monotonic() - t0, 2),
            "jobs_seconds": round(jobs_s, 2), "counts": res.counts, "tables": counts, "charts": sorted(made),
            "problems": [{"file": f, "problem": w} for f, w in res.problems],
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
        if not quiet:
            for f, w in res.problems:
                print(f"rmqfast analyze: {f}: {w}", file=sys.stderr)
        return summary
    finally:
        if own:
            spark.stop()


def build_parser(prog: str = "rmqfast analyze") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="Traffic records and benchmark results -> HTML report, "
                                 "PNG charts, Parquet/CSV tables (PySpark).")
    add_arguments(ap)
    return ap


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("records", nargs="+", metavar="RECORDS_DIR",
                    help="records.dir of the proxy (agg/, sample/), results/bench, or any Hadoop URI")
    ap.add_argument("-o", "--out", required=True, metavar="REPORT_DIR", help="local directory for the report")
    ap.add_argument("--master", help="Spark master (default: what spark-submit set, else local[*])")
    ap.add_argument("--driver-memory", default="2g", help="driver memory in local mode (default 2g)")
    ap.add_argument("--percentiles", choices=("hist", "approx"), default="hist",
                    help="latency percentiles of sampled records: hist = exact log-bin counts, value within "
                         "0.5%% (default, fast); approx = Spark percentile_approx, rank within N/10000")


def main(argv: list[str] | None = None, prog: str = "rmqfast analyze") -> int:
    args = build_parser(prog).parse_args(argv)
    return run_cli(args)


def run_cli(args: argparse.Namespace) -> int:
    try:
        s = analyze(args.records, args.out, master=args.master, driver_memory=args.driver_memory,
                    percentiles=args.percentiles)
    except FileNotFoundError as exc:
        print(f"rmqfast analyze: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"rmqfast analyze: {exc}; install the analytics extra: pip install 'rmqfast[analytics]'",
              file=sys.stderr)
        return 2
    print(f"report: {s['report']} ({s['seconds']} s; {len(s['problems'])} input problem(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
