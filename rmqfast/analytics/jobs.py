"""The Spark jobs: traffic records and benchmark results -> small result tables.

Only the DataFrame API is used (no Python UDFs), so executors need nothing but Spark: the
rmqfast package is needed on the driver only.  Every table collected to the driver is
small (bounded by time buckets x topics, or codes x topics).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rmqfast.analytics.inputs import Inputs
from rmqfast.analytics.spark import struct_type
from rmqfast.records.schema import AGG_COLUMNS, LAT_BOUNDS_US, LAT_COLUMNS, SAMPLE_COLUMNS

#: percentile_approx accuracy: the returned value's rank is within N / ACCURACY of the exact
#: rank (Spark's documented guarantee: relative error 1 / accuracy).
ACCURACY = 10000
QUANTILES = (0.5, 0.99, 0.999)
BUCKETS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400)
MAX_POINTS = 240
TOP_N = 20

Rows = list[dict[str, Any]]


@dataclass
class Result:
    tables: dict[str, Rows] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    bucket_s: dict[str, int] = field(default_factory=dict)


def _rows(df: Any) -> Rows:
    return [r.asDict() for r in df.collect()]


def bucket_for(span_s: float) -> int:
    for b in BUCKETS_S:
        if span_s / b <= MAX_POINTS:
            return b
    return BUCKETS_S[-1]


def _read(spark: Any, paths: list[str], columns: Any, result: Result, what: str) -> Any:
    """Parquet and JSON-lines files of one record kind as one DataFrame (None if none)."""
    from pyspark.sql import functions as F

    schema = struct_type(columns)
    pq = [p for p in paths if p.endswith(".parquet")]
    js = [p for p in paths if p.endswith(".jsonl")]
    dfs = []
    if pq:
        dfs.append(spark.read.schema(schema).parquet(*pq))
    if js:
        jschema = struct_type(columns).add("_corrupt_record", "string")
        raw = (spark.read.schema(jschema).option("mode", "PERMISSIVE")
               .option("columnNameOfCorruptRecord", "_corrupt_record").json(js))
        raw = raw.withColumn("_file", F.input_file_name()).cache()
        bad = _rows(raw.where(F.col("_corrupt_record").isNotNull()).groupBy("_file").count())
        for b in bad:
            result.problems.append((b["_file"], f"{b['count']} corrupt {what} line(s) skipped"))
        dfs.append(raw.where(F.col("_corrupt_record").isNull()).drop("_corrupt_record", "_file"))
    if not dfs:
        return None
    df = dfs[0]
    for d in dfs[1:]:
        df = df.unionByName(d)
    return df


def _bucket_col(ts: Any, b: int) -> Any:
    from pyspark.sql import functions as F

    return (F.floor(ts / b) * b).cast("long")


# Sampled per-request records -------------------------------------------------------------


def sample_jobs(spark: Any, df: Any, res: Result, method: str = "hist") -> None:
    from pyspark.sql import functions as F

    df = df.withColumn("w", F.when(F.col("sample_rate") > 0, 1.0 / F.col("sample_rate")).otherwise(1.0))
    st = df.agg(F.count(F.lit(1)).alias("n"), F.min("ts").alias("t0"), F.max("ts").alias("t1"),
                F.sum("w").alias("est")).collect()[0]
    n = int(st["n"])
    res.counts["sample_records"] = n
    if n == 0:
        res.notes.append("sampled records: none")
        return
    b = bucket_for(float(st["t1"]) - float(st["t0"]))
    res.bucket_s["sample"] = b
    res.counts["sample_estimated_requests"] = int(round(st["est"] or 0))
    df = df.withColumn("bucket", _bucket_col(F.col("ts"), b)).withColumn(
        "is_error", (F.col("result") != "ok").cast("int"))
    # scan 1: everything keyed by time, into one compact table (cached), re-aggregated below
    keys = ["bucket", "topic", "host", "worker", "result", "code"]
    base = (df.groupBy(*keys).agg(F.count(F.lit(1)).alias("records"), F.sum("w").alias("est_requests"),
                                  F.sum(F.col("w") * F.col("req_size")).alias("est_req_bytes"),
                                  F.sum(F.col("w") * F.col("resp_size")).alias("est_resp_bytes"),
                                  F.sum(F.col("w") * F.col("is_error")).alias("est_errors"))
            .cache())
    sums = ["records", "est_requests", "est_req_bytes", "est_resp_bytes", "est_errors"]

    def regroup(*ks: str) -> Rows:
        rows = _rows(base.groupBy(*ks).agg(*(F.sum(c).alias(c) for c in sums)))
        for r in rows:
            if "bucket" in ks:
                r["req_per_s"] = r["est_requests"] / b
        return sorted(rows, key=lambda r: tuple(str(r[k]) for k in ks))

    res.tables["sample_throughput_topic"] = regroup("bucket", "topic")
    res.tables["sample_throughput_worker"] = regroup("bucket", "host", "worker")
    res.tables["sample_results_over_time"] = regroup("bucket", "result")
    res.tables["sample_results_by_code"] = regroup("code", "result")
    base.unpersist()
    # scan 2: clients
    clients = _rows(df.groupBy("client").agg(F.count(F.lit(1)).alias("records"), F.sum("w").alias("est_requests"),
                                             F.sum(F.col("w") * F.col("req_size")).alias("est_req_bytes"),
                                             F.sum(F.col("w") * F.col("is_error")).alias("est_errors")))
    clients.sort(key=lambda r: -r["est_requests"])
    res.counts["clients"] = len(clients)
    res.tables["sample_top_clients"] = clients[:TOP_N]
    # scan 3: latency
    if method == "approx":
        groups = _latency_approx(spark, df)
    else:
        groups = _latency_hist(df)
    res.tables["latency_by_code_topic"] = sorted(groups["code_topic"], key=lambda r: (r["code"], r["topic"]))
    res.tables["latency_by_code"] = sorted(groups["code"], key=lambda r: r["code"])
    topics = sorted(groups["topic"], key=lambda r: -r["est_requests"])
    res.tables["latency_by_topic"] = topics
    res.tables["sample_top_topics"] = topics[:TOP_N]
    res.tables["latency_overall"] = groups["all"]


#: ``--percentiles hist`` (default): latencies are counted in logarithmic bins LOG_BINS per
#: factor e (bin i holds [e^(i/LOG_BINS), e^((i+1)/LOG_BINS))), exactly, by one hash
#: aggregation; quantiles are interpolated inside the bin that holds the exact quantile, so
#: the reported value is within a factor e^(1/LOG_BINS) (1.005%) of the exact one.
LOG_BINS = 200
HIST_REL_ERROR = math.exp(1 / LOG_BINS) - 1


def _latency_hist(df: Any) -> dict[str, Rows]:
    from pyspark.sql import functions as F

    lat = df.where(F.col("latency_us") >= 0).withColumn(
        "lbin", F.floor(F.log(F.greatest(F.col("latency_us"), F.lit(1)).cast("double")) * LOG_BINS).cast("int"))
    rows = _rows(lat.groupBy("code", "topic", "lbin").agg(
        F.count(F.lit(1)).alias("n"), F.sum("w").alias("w"), F.sum(F.col("w") * F.col("is_error")).alias("e"),
        F.sum(F.col("w") * F.col("req_size")).alias("rb"), F.sum("latency_us").alias("ls"),
        F.max("latency_us").alias("mx"), F.min("latency_us").alias("mn")))
    groups: dict[str, dict[Any, dict[str, Any]]] = {"code_topic": {}, "code": {}, "topic": {}, "all": {}}
    for r in rows:
        for g, key in (("code_topic", (r["code"], r["topic"])), ("code", r["code"]), ("topic", r["topic"]),
                       ("all", None)):
            acc = groups[g].setdefault(key, {"bins": {}, "n": 0, "w": 0.0, "e": 0.0, "rb": 0.0, "ls": 0,
                                             "mx": -1, "mn": None})
            bn = acc["bins"].setdefault(r["lbin"], [0, None, None])
            bn[0] += r["n"]
            bn[1] = r["mn"] if bn[1] is None else min(bn[1], r["mn"])
            bn[2] = r["mx"] if bn[2] is None else max(bn[2], r["mx"])
            acc["n"] += r["n"]
            acc["w"] += r["w"]
            acc["e"] += r["e"]
            acc["rb"] += r["rb"]
            acc["ls"] += r["ls"]
            acc["mx"] = max(acc["mx"], r["mx"])
    out: dict[str, Rows] = {}
    for g, accs in groups.items():
        lst = []
        for key, a in accs.items():
            d: dict[str, Any] = {}
            if g == "code_topic":
                d.update(code=key[0], topic=key[1])
            elif g == "code":
                d["code"] = key
            elif g == "topic":
                d["topic"] = key
            qv = [_bin_quantile(a["bins"], a["n"], q) for q in QUANTILES]
            d.update(records=a["n"], est_requests=a["w"], est_errors=a["e"], est_req_bytes=a["rb"],
                     p50_us=qv[0], p99_us=qv[1], p999_us=qv[2], mean_us=a["ls"] / a["n"] if a["n"] else None,
                     max_us=a["mx"], error_rate=a["e"] / a["w"] if a["w"] else 0.0)
            lst.append(d)
        out[g] = lst
    return out


def _bin_quantile(bins: dict[int, list[Any]], n: int, q: float) -> float | None:
    """The q-quantile (order statistic of rank ceil(q*n)), interpolated inside its bin and
    clamped to the smallest and largest value seen in that bin."""
    if n == 0:
        return None
    rank = max(1, math.ceil(q * n))
    cum = 0
    for i in sorted(bins):
        c, lo_seen, hi_seen = bins[i]
        if cum + c >= rank:
            lo, hi = math.exp(i / LOG_BINS), math.exp((i + 1) / LOG_BINS)
            v = lo + (hi - lo) * (rank - cum - 0.5) / c
            return float(min(max(v, lo_seen), hi_seen))
        cum += c
    return None


def _latency_approx(spark: Any, df: Any) -> dict[str, Rows]:
    df.createOrReplaceTempView("samples")
    qs = ", ".join(str(q) for q in QUANTILES)
    lat = spark.sql(f"""
        SELECT code, topic, GROUPING_ID(code, topic) AS gid, COUNT(1) AS records, SUM(w) AS est_requests,
               SUM(w * is_error) AS est_errors, SUM(w * req_size) AS est_req_bytes,
               percentile_approx(latency_us, array({qs}), {ACCURACY}) AS q,
               AVG(latency_us) AS mean_us, MAX(latency_us) AS max_us
        FROM samples WHERE latency_us >= 0
        GROUP BY GROUPING SETS ((code, topic), (code), (topic), ())
    """)
    out: dict[str, Rows] = {"code_topic": [], "code": [], "topic": [], "all": []}
    names = {0: "code_topic", 1: "code", 2: "topic", 3: "all"}
    for r in _rows(lat):
        q = r.pop("q") or [None] * len(QUANTILES)
        g = names[r.pop("gid")]
        d = {k: v for k, v in r.items() if not (k == "topic" and g in ("code", "all"))
             and not (k == "code" and g in ("topic", "all"))}
        d.update(p50_us=q[0], p99_us=q[1], p999_us=q[2])
        d["error_rate"] = (d["est_errors"] / d["est_requests"]) if d["est_requests"] else 0.0
        out[g].append(d)
    return out


# Per-second aggregates ----------------------------------------------------------------------


def hist_quantile(buckets: list[int], q: float) -> float | None:
    """Quantile from histogram bucket counts (LAT_BOUNDS_US), linear inside the bucket.

    Error bound: the true value lies in the same bucket, so the error is at most that
    bucket's width (the last, open bucket reports its lower bound).
    """
    total = sum(buckets)
    if total == 0:
        return None
    rank = q * total
    cum = 0
    for i, c in enumerate(buckets):
        if c and cum + c >= rank:
            lo = 0 if i == 0 else LAT_BOUNDS_US[i - 1]
            if i >= len(LAT_BOUNDS_US):
                return float(lo)
            hi = LAT_BOUNDS_US[i]
            return lo + (hi - lo) * max(0.0, rank - cum) / c
        cum += c
    return float(LAT_BOUNDS_US[-1])


def agg_jobs(spark: Any, df: Any, res: Result) -> None:
    from pyspark.sql import functions as F

    df = df.fillna(0).cache()
    st = df.agg(F.count(F.lit(1)).alias("n"), F.min("ts").alias("t0"), F.max("ts").alias("t1")).collect()[0]
    n = int(st["n"])
    res.counts["agg_rows"] = n
    if n == 0:
        res.notes.append("aggregate records: none")
        return
    b = bucket_for(float(st["t1"]) - float(st["t0"]))
    res.bucket_s["agg"] = b
    df = df.withColumn("bucket", _bucket_col(F.col("ts"), b))
    kind = F.col("kind")

    def table(name: str, where: Any, keys: list[str], sums: list[str], order: list[str] | None = None) -> Rows:
        g = df.where(where).groupBy(*keys).agg(*(F.sum(c).alias(c) for c in sums))
        rows = _rows(g)
        rows.sort(key=lambda r: tuple(str(r[k]) for k in (order or keys)))
        if "bucket" in keys:
            for r in rows:
                for c in sums:
                    r[f"{c}_per_s"] = r[c] / b
        res.tables[name] = rows
        return rows

    table("agg_throughput_topic", kind == "topic", ["bucket", "role", "topic"], ["count", "messages", "pulls", "bytes"])
    table("agg_throughput_worker", kind == "worker", ["bucket", "host", "worker", "role"], ["count", "bytes", "errors"])
    table("agg_requests_by_code", kind == "request", ["role", "code"], ["count", "bytes"])
    table("agg_responses_by_code", kind == "response", ["role", "code"], ["count", "errors"])
    table("agg_errors_over_time", kind == "response", ["bucket", "role"], ["count", "errors"])
    totals = _rows(df.where(kind == "topic").groupBy("topic").agg(
        F.sum("count").alias("sends"), F.sum("messages").alias("messages"), F.sum("pulls").alias("pulls"),
        F.sum("bytes").alias("bytes")).orderBy(F.desc("messages"), F.desc("bytes")).limit(TOP_N))
    res.tables["agg_top_topics"] = totals
    table("agg_limiter_over_time", kind == "limiter", ["bucket", "topic"],
          ["limiter_passed", "limiter_rejected", "limiter_shaped"])
    # spill: levels, not deltas -> the last level of each worker in the bucket, summed over workers
    sp = (df.where(kind == "spill").groupBy("bucket", "host", "worker")
          .agg(F.max_by("spill_backlog", "ts").alias("spill_backlog"),
               F.max("delivery_lag_ms").alias("delivery_lag_ms"),
               F.sum("spill_written").alias("spill_written"), F.sum("spill_delivered").alias("spill_delivered"))
          .groupBy("bucket").agg(F.sum("spill_backlog").alias("spill_backlog"),
                                 F.max("delivery_lag_ms").alias("delivery_lag_ms"),
                                 F.sum("spill_written").alias("spill_written"),
                                 F.sum("spill_delivered").alias("spill_delivered")))
    res.tables["agg_spill_over_time"] = sorted(_rows(sp), key=lambda r: r["bucket"])
    lat = _rows(df.where(kind == "latency").groupBy("role", "code", "topic").agg(
        *(F.sum(c).alias(c) for c in LAT_COLUMNS)))
    out = []
    for r in lat:
        hb = [int(r[c]) for c in LAT_COLUMNS]
        out.append({"role": r["role"], "code": r["code"], "topic": r["topic"], "count": sum(hb),
                    **{f"p{_qname(q)}_us": hist_quantile(hb, q) for q in QUANTILES}})
    res.tables["agg_latency_hist"] = sorted(out, key=lambda r: (r["role"], r["code"], r["topic"]))
    df.unpersist()


def _qname(q: float) -> str:
    s = f"{q * 100:g}"
    return s.replace(".", "")


# Benchmarks -------------------------------------------------------------------------------

#: A run is flagged when its throughput is this much below the median of earlier runs of
#: the same mode, scenario and target (or its p99 latency this much above).
RPS_DROP = 0.10
P99_RISE = 0.25


def bench_jobs(spark: Any, paths: list[str], res: Result) -> None:
    from pyspark.sql import functions as F

    raw = (spark.read.option("mode", "PERMISSIVE").option("columnNameOfCorruptRecord", "_corrupt_record")
           .json(paths).withColumn("_file", F.input_file_name()).cache())
    if "_corrupt_record" in raw.columns:
        for b in _rows(raw.where(F.col("_corrupt_record").isNotNull()).groupBy("_file").count()):
            res.problems.append((b["_file"], f"{b['count']} corrupt benchmark line(s) skipped"))
        raw = raw.where(F.col("_corrupt_record").isNull())
    if "kind" not in raw.columns:
        res.notes.append("benchmark files: no readable lines")
        return
    cols = set(raw.columns)
    want = ["run_id", "mode", "scenario", "target", "rps", "p50_us", "p99_us", "p999_us", "cpu_us_per_req",
            "cores", "errors", "runs"]
    summ = raw.where(F.col("kind") == "summary").select(*[F.col(c) if c in cols else F.lit(None).alias(c)
                                                         for c in want])
    if "machine" in cols:
        commits = raw.where(F.col("kind") == "summary").select(
            "run_id", F.col("machine.git_commit").alias("git_commit")).distinct()
        summ = summ.join(commits, "run_id", "left")
    rows = _rows(summ)
    res.counts["bench_runs"] = len({r["run_id"] for r in rows})
    checks = _rows(raw.where(F.col("kind") == "check").select("run_id", "name", "value", "goal", "met")) \
        if {"name", "goal", "met"} <= cols else []
    res.tables["bench_checks"] = sorted(checks, key=lambda r: (r["run_id"], r["name"]))
    raw.unpersist()
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


def run_all(spark: Any, inputs: Inputs, percentiles: str = "hist") -> Result:
    res = Result()
    res.problems.extend(inputs.problems())
    res.counts.update(agg_files=len(inputs.agg), sample_files=len(inputs.sample), bench_files=len(inputs.bench))
    if inputs.sample:
        df = _read(spark, inputs.sample, SAMPLE_COLUMNS, res, "sample")
        sample_jobs(spark, df, res, percentiles)
    if inputs.agg:
        df = _read(spark, inputs.agg, AGG_COLUMNS, res, "aggregate")
        agg_jobs(spark, df, res)
    if inputs.bench:
        bench_jobs(spark, inputs.bench, res)
    return res
