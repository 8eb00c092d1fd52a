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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rmqfast.analytics.inputs import find_inputs, is_local
from rmqfast.analytics.jobs import ACCURACY, EXPECTED_ANSWERS, HIST_REL_ERROR, Result, Rows, run_all
from rmqfast.analytics.names import request_label, response_label
from rmqfast.analytics.spark import SMALL_INPUT_BYTES
from rmqfast.progress import Stages, spark_status, stage
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


#: How every time chart treats a time bucket without a record (one rule, said in the report):
#: a rate is 0 there (nothing passed), so its line drops to 0 and never bridges the gap; a level
#: (spill backlog, delivery lag) is unknown there, so its line is broken.
GAP_NOTE = ("Time charts: a time bucket without records counts as 0 for rates (nothing passed), so lines "
            "drop to 0 rather than bridging the gap; for levels (spill backlog, delivery lag) it is left "
            "empty and the line is broken there. Series that are 0 throughout are not drawn and are named "
            "under the chart instead of in its legend.")


@dataclass
class Chart:
    path: str  # relative to the report
    caption: str


def chart_series(rows: Rows, series_key: Any, value: str, bucket_s: int, top: int = 8,
                 level: bool = False) -> tuple[list[int], dict[str, list[float]], list[str]]:
    """What a time chart draws: the time axis (every bucket from the first to the last, gaps
    included), the series to draw (values per bucket: 0 where a rate has no record, NaN where a
    level has none), and the names of the series that are 0 throughout (not drawn)."""
    if not rows:
        return [], {}, []
    totals: dict[str, float] = {}
    for r in rows:
        k = series_key(r)
        totals[k] = totals.get(k, 0.0) + abs(float(r[value] or 0))
    keep = sorted(totals, key=lambda k: -totals[k])[:top]
    series: dict[str, dict[int, float]] = {}
    for r in rows:
        k = series_key(r)
        k = k if k in keep else "other"
        d = series.setdefault(k, {})
        d[r["bucket"]] = d.get(r["bucket"], 0.0) + float(r[value] or 0)
    silent = sorted(k for k, d in series.items() if not any(d.values()))
    lo = min(r["bucket"] for r in rows)
    hi = max(r["bucket"] for r in rows)
    axis = list(range(lo, hi + 1, bucket_s))
    drawn = {k: [d.get(x, math.nan if level else 0.0) for x in axis]
             for k, d in sorted(series.items(), key=lambda kv: -sum(kv[1].values())) if k not in silent}
    return axis, drawn, silent


def _time_chart(path: Path, title: str, rows: Rows, series_key: Any, value: str, ylabel: str, bucket_s: int,
                top: int = 8, level: bool = False) -> str | None:
    """A line per series over time buckets; returns the caption, or None when no series has a
    non-zero value (then there is no chart)."""
    axis, drawn, silent = chart_series(rows, series_key, value, bucket_s, top, level)
    if not drawn:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=90)
    times = [dt.datetime.fromtimestamp(x, dt.UTC) for x in axis]
    marker = "o" if len(axis) <= 120 or level else None  # single points (between gaps) stay visible
    for k, ys in drawn.items():
        ax.plot(times, ys, label=k, linewidth=1.2, marker=marker, markersize=2.5)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.set_xlabel(f"time (UTC), buckets of {bucket_s} s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    cap = f"{title}; {len(drawn)} series"
    if silent:
        cap += f"; 0 throughout, not drawn: {', '.join(silent)}"
    return cap


def _bar_chart(path: Path, title: str, labels: list[str], groups: dict[str, list[float | None]], ylabel: str,
               log: bool = False) -> str | None:
    """Grouped bars; groups without a value (None or 0 everywhere) get no bar and no legend entry."""
    shown = {k: v for k, v in groups.items() if any(x for x in v)}
    if not labels or not shown:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=90)
    n = len(shown)
    width = 0.8 / n
    for i, (name, vals) in enumerate(shown.items()):
        xs = [j + i * width for j, v in enumerate(vals) if v]
        ax.bar(xs, [v for v in vals if v], width, label=name)
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
    cap = title
    missing = sorted(set(groups) - set(shown))
    if missing:
        cap += f"; no value, not drawn: {', '.join(missing)}"
    return cap


def charts(res: Result, out: Path) -> dict[str, Chart]:
    out.mkdir(parents=True, exist_ok=True)
    made: dict[str, Chart] = {}
    t = res.tables
    ab = res.bucket_s.get("agg", 1)
    sb = res.bucket_s.get("sample", 1)

    def add(name: str, caption: str | None) -> None:
        if caption:
            made[name] = Chart(f"charts/{name}.png", caption)

    def tc(name: str, title: str, rows: Rows, key: Any, value: str, ylabel: str, b: int, **kw: Any) -> None:
        add(name, _time_chart(out / f"{name}.png", title, rows, key, value, ylabel, b, **kw))

    tc("agg_topic_msgs", "Messages/s per topic (aggregates)", t.get("agg_throughput_topic", []),
       lambda r: r["topic"] or "(none)", "messages_per_s", "messages/s", ab)
    tc("agg_worker_frames", "Frames/s per worker (aggregates)", t.get("agg_throughput_worker", []),
       lambda r: f"{r['host']}/w{r['worker']}/{r['role']}", "count_per_s", "frames/s", ab)
    tc("agg_errors", "Error responses/s (aggregates; expected answers excluded)", t.get("agg_errors_over_time", []),
       lambda r: r["role"], "errors_per_s", "errors/s", ab)
    tc("agg_expected", "Expected non-success answers/s (aggregates; not errors)",
       t.get("agg_expected_over_time", []), lambda r: f"{r['role']}: {response_label(r['code'])}",
       "expected_per_s", "answers/s", ab)
    lim = t.get("agg_limiter_over_time", [])
    rows = [{"bucket": r["bucket"], "k": k, "v": r[f"limiter_{k}_per_s"]} for r in lim for k in ("rejected", "shaped")]
    tc("agg_limiter", "Rate limiter: rejected and shaped per s", rows, lambda r: r["k"], "v", "requests/s", ab)
    sp = t.get("agg_spill_over_time", [])
    rows = [{"bucket": r["bucket"], "k": k, "v": r[k]} for r in sp for k in ("spill_backlog", "delivery_lag_ms")]
    tc("agg_spill", "Spill backlog (messages) and delivery lag (ms)", rows, lambda r: r["k"], "v", "level", ab,
       level=True)
    tc("sample_topic", "Requests/s per topic (sampled records, weighted)", t.get("sample_throughput_topic", []),
       lambda r: r["topic"] or "(none)", "req_per_s", "requests/s", sb)
    tc("sample_worker", "Requests/s per worker (sampled records, weighted)", t.get("sample_throughput_worker", []),
       lambda r: f"{r['host']}/w{r['worker']}", "req_per_s", "requests/s", sb)
    # without "ok", which would flatten every other series against the axis
    tc("sample_results", "Requests/s not answered SUCCESS, by result (sampled records)",
       [r for r in t.get("sample_results_over_time", []) if r["result"] != "ok"], lambda r: r["result"],
       "req_per_s", "requests/s", sb)
    qs = {"p50": "p50_us", "p90": "p90_us", "p99": "p99_us", "p99.9": "p999_us"}
    lt = t.get("latency_by_topic", [])[:12]
    add("latency_topic", _bar_chart(out / "latency_topic.png", "Latency per topic (sampled records)",
                                    [r["topic"] or "(none)" for r in lt],
                                    {k: [r.get(c) for r in lt] for k, c in qs.items()}, "µs (log scale)", log=True))
    lc = t.get("latency_by_code", [])
    add("latency_code", _bar_chart(out / "latency_code.png", "Latency per request code (sampled records)",
                                   [request_label(r["code"]) for r in lc],
                                   {k: [r.get(c) for r in lc] for k, c in qs.items()}, "µs (log scale)", log=True))
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


def _table(rows: Rows, caption: str, limit: int = 40, cols: list[str] | None = None, flag: str | None = None,
           codes: str | None = None) -> str:
    """An HTML table with its caption; ``codes="request"|"response"`` names the ``code`` column's
    values ("SEND_MESSAGE_V2 (310)")."""
    cap = f"<caption>{html.escape(caption)}</caption>"
    if not rows:
        return f"<table>{cap}<tr><td class=none>no data</td></tr></table>"
    keys = cols or list(rows[0].keys())
    label = {"request": request_label, "response": response_label}.get(codes or "")
    h = [f"<table>{cap}<tr>" + "".join(f"<th>{html.escape(k)}</th>" for k in keys) + "</tr>"]
    for r in rows[:limit]:
        cls = " class=flag" if flag and r.get(flag) else ""
        cells = []
        for k in keys:
            v = r.get(k)
            text = html.escape(label(v)) if (label and k == "code") else _fmt(v)
            cells.append(f"<td class=l>{text}</td>" if isinstance(v, str) or (label and k == "code")
                         else f"<td>{text}</td>")
        h.append(f"<tr{cls}>" + "".join(cells) + "</tr>")
    h.append("</table>")
    if len(rows) > limit:
        h.append(f"<p class=none>{len(rows) - limit} more rows in the table files</p>")
    return "".join(h)


CSS = """body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;font-size:12px;
margin:.8em 0}caption{caption-side:top;text-align:left;font-weight:bold;padding:.3em 0;font-size:13px}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}td.l{text-align:left}th{background:#eee}
tr.flag td{background:#fdd}.none{color:#888}img{max-width:100%}.problem{color:#a00}
figure{margin:1em 0}figcaption{font-size:12px;color:#444}"""


def render_html(res: Result, made: dict[str, Chart], meta: dict[str, Any]) -> str:
    t = res.tables
    p: list[str] = [f"<!doctype html><meta charset=utf-8><title>rmqfast traffic report</title><style>{CSS}</style>",
                    "<h1>rmqfast traffic and benchmark report</h1>"]
    p.append(f"<p>Inputs: {html.escape(', '.join(meta['inputs']))}. Generated {meta['generated']} in "
             f"{meta['seconds']:.1f} s with Spark {html.escape(meta['spark'])} (master "
             f"{html.escape(meta['master'])}; {meta.get('spark_jobs', '?')} Spark jobs).</p>")
    p.append(_table([{"what": k, "value": v} for k, v in sorted(res.counts.items())], "Inputs read and rows counted"))
    if meta.get("timings"):
        p.append(_table([{"step": k, "seconds": round(v, 2)} for k, v in meta["timings"].items()],
                        "Where this report's time went (seconds)"))
    p.append("<h2>Input problems</h2>")
    if res.problems:
        p.append("<ul>" + "".join(f"<li class=problem>{html.escape(f)}: {html.escape(w)}</li>"
                                  for f, w in res.problems) + "</ul>")
    else:
        p.append("<p class=none>none: every file was read</p>")
    for n in res.notes:
        p.append(f"<p class=none>{html.escape(n)}</p>")

    def img(name: str, absent: str | None = None) -> None:
        if name in made:
            c = made[name]
            p.append(f"<figure><img src='{c.path}' alt='{html.escape(c.caption, quote=True)}'>"
                     f"<figcaption>{html.escape(c.caption)}</figcaption></figure>")
        elif absent:
            p.append(f"<p class=none>{html.escape(absent)}</p>")

    p.append("<h2>Throughput over time</h2>")
    p.append(f"<p class=none>{html.escape(GAP_NOTE)} Time buckets: "
             + ", ".join(f"{k} {v} s" for k, v in res.bucket_s.items()) + ".</p>")
    img("agg_topic_msgs", "no per-topic message counts in the aggregates")
    img("agg_worker_frames")
    img("sample_topic")
    img("sample_worker")
    p.append("<h2>Top topics</h2>")
    p.append(_table(t.get("agg_top_topics", []), "Top topics by messages (aggregates: every request counted)", 20))
    p.append(_table(t.get("sample_top_topics", []), "Top topics by estimated requests (sampled records, weighted)",
                    20, ["topic", "records", "est_requests", "est_req_bytes", "p50_us", "p90_us", "p99_us",
                         "p999_us", "error_rate"]))
    p.append("<h2>Top clients (sampled records)</h2>")
    p.append(_table(t.get("sample_top_clients", []), "Top clients by estimated requests (sampled records, weighted)",
                    20, ["client", "records", "est_requests", "est_req_bytes", "est_errors"]))
    p.append("<h2>Latency</h2>")
    if meta.get("percentiles") == "approx":
        p.append(f"<p>From sampled records: <code>percentile_approx(latency_us, ..., {ACCURACY})</code>; the rank "
                 f"of each reported value is within N/{ACCURACY} of the exact rank (N = records in the group).")
    else:
        p.append(f"<p>From sampled records: exact counts in logarithmic bins; each reported value is within "
                 f"{HIST_REL_ERROR:.2%} of the exact quantile (order statistic of rank ceil(q&middot;N)).")
    p.append(" From aggregates: interpolated inside the histogram bucket; error at most the bucket's width. "
             "Latency is measured by rmqfast from a request passing the proxy to its response passing back "
             "(it includes the broker's or name server's time).</p>")
    img("latency_code")
    img("latency_topic")
    p.append(_table(t.get("latency_by_code", []), "Latency per request code (sampled records), µs", 40,
                    codes="request"))
    p.append(_table(t.get("latency_by_code_topic", []), "Latency per request code and topic (sampled records), µs",
                    60, codes="request"))
    p.append(_table(t.get("agg_latency_hist", []), "Latency per role, request code and topic (aggregates' "
                    "histograms, every request), µs", 40, codes="request"))
    p.append("<h2>Requests and responses by code (aggregates)</h2>")
    p.append(_table(t.get("agg_requests_by_code", []), "Requests by role and request code", 60, codes="request"))
    p.append(_table(t.get("agg_responses_by_code", []), "Responses by role and response code (errors: non-success "
                    "answers that are not expected; expected: see below)", 60, codes="response"))
    p.append("<h2>Errors and expected answers</h2>")
    p.append("<p>Some non-success answers are a normal part of the protocol and are counted and plotted apart "
             "from errors:</p><ul>" + "".join(
                 f"<li>{html.escape(response_label(c))} from the {html.escape(role)}: {html.escape(why)}</li>"
                 for (role, c), why in EXPECTED_ANSWERS.items()) + "</ul>")
    img("agg_errors", "no error responses in the aggregates")
    img("agg_expected", "no expected non-success answers in the aggregates")
    img("sample_results", "no sampled request was answered with anything but SUCCESS")
    p.append(_table(t.get("sample_results_by_code", []), "Sampled requests by request code and result", 60,
                    codes="request"))
    p.append("<h2>Rate limiting and shaping</h2>")
    img("agg_limiter", "no limiter rejections or shaping recorded")
    p.append("<h2>Spill backlog and delivery lag</h2>")
    img("agg_spill", "no spill backlog or delivery lag recorded")
    p.append("<h2>Benchmarks</h2>")
    side = t.get("bench_side_by_side", [])
    if side:
        p.append("<p>Each run side by side with its baselines (<code>vs_direct</code>, <code>vs_best_haproxy</code> "
                 "are throughput ratios), then against earlier runs of the same mode, scenario and target "
                 "(flagged: throughput 10% below, or p99 25% above, the median of the earlier runs).</p>")
        for name in sorted(made):
            if name.startswith("bench_"):
                img(name)
        p.append(_table(side, "Benchmark runs side by side with their baselines", 200,
                        ["run_id", "mode", "scenario", "target", "rps", "p50_us", "p99_us", "p999_us",
                         "cpu_us_per_req", "vs_direct", "vs_best_haproxy", "best_haproxy"]))
        hist = t.get("bench_history", [])
        flagged = [r for r in hist if r["regression"]]
        p.append(f"<h3>Against earlier runs ({len(flagged)} flagged)</h3>")
        p.append(_table(hist, "Each run against earlier runs of the same mode, scenario and target (flagged rows "
                        "in red)", 300, flag="regression"))
        p.append("<h3>Issue targets per run</h3>")
        p.append(_table(t.get("bench_checks", []), "Goals checked by each benchmark run", 200))
    else:
        p.append("<p class=none>no benchmark results found</p>")
    p.append("<h2>Tables</h2><p>Every table above, complete, as Parquet and CSV in <code>tables/</code>.</p>")
    return "\n".join(p)


# Entry point -------------------------------------------------------------------------------


def analyze(records: list[str], out_dir: str | os.PathLike[str], *, master: str | None = None,
            spark: Any = None, driver_memory: str = "2g", quiet: bool = False,
            percentiles: str = "hist", progress: Stages | None = None) -> dict[str, Any]:
    """Run the jobs and write the report; returns a summary (also written as summary.json).
    ``progress``: each step (JVM start, Spark jobs, tables, charts) reported as a stage, with a
    status line every few seconds while it runs (the Spark jobs' tasks included)."""
    t0 = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    own = spark is None
    timings: dict[str, float] = {}
    inputs = None
    small = False
    if own and all(is_local(r) for r in records):
        # local inputs are listed before the JVM starts, so that its settings can fit their size
        inputs = find_inputs(records)
        small = inputs.total_bytes <= SMALL_INPUT_BYTES
    if own:
        from rmqfast.analytics.spark import get_spark

        with stage(progress, f"starting Spark ({master or 'local mode'})"):
            spark = get_spark(master, driver_memory=driver_memory, small=small)
        timings["spark_start"] = time.monotonic() - t0
    try:
        if inputs is None:
            inputs = find_inputs(records, spark)
        tracker = spark.sparkContext.statusTracker()
        jobs_before = len(tracker.getJobIdsForGroup())
        t1 = time.monotonic()
        with stage(progress, "Spark jobs over the records", lambda: spark_status(spark)):
            res = run_all(spark, inputs, percentiles)
        timings["spark_jobs"] = time.monotonic() - t1
        spark_jobs = len(tracker.getJobIdsForGroup()) - jobs_before
        jobs_s = time.monotonic() - t0
        with stage(progress, "tables (Parquet, CSV)"):
            counts = write_tables(res.tables, out / "tables")
        t1 = time.monotonic()
        with stage(progress, "charts"):
            made = charts(res, out / "charts")
        timings["charts"] = time.monotonic() - t1
        meta = {
            "inputs": records,
            "generated": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "seconds": time.monotonic() - t0,
            "spark": spark.version,
            "master": spark.sparkContext.master,
            "percentiles": percentiles,
            "timings": timings,
            "spark_jobs": spark_jobs,
        }
        (out / "report.html").write_text(render_html(res, made, meta), encoding="utf-8")
        summary = {
            "report": str(out / "report.html"), "seconds": round(time.monotonic() - t0, 2),
            "jobs_seconds": round(jobs_s, 2), "timings": {k: round(v, 2) for k, v in timings.items()},
            "spark_jobs": spark_jobs, "small_input_settings": small, "counts": res.counts, "tables": counts,
            "charts": sorted(made),
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
                    percentiles=args.percentiles, progress=Stages("analyze", every=5.0))
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
