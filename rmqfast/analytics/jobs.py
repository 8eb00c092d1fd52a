"""The Spark jobs: traffic records and benchmark results -> small result tables.

Only the DataFrame API is used (no Python UDFs), so executors need nothing but Spark: the
rmqfast package is needed on the driver only.  Every table collected to the driver is
small (bounded by time buckets x topics, or codes x topics).
"""

from __future__ import annotations

import math
from typing import Any

from rmqfast.analytics.benchcompare import bench_jobs
from rmqfast.analytics.inputs import Inputs, bad_ts_problem, ts_ok
from rmqfast.analytics.results import Result as Result  # re-exported: spark/analyze.py and the tests name it here
from rmqfast.analytics.results import Rows as Rows
from rmqfast.analytics.results import rows_of as _rows
from rmqfast.analytics.spark import struct_type
from rmqfast.records.schema import AGG_COLUMNS, LAT_BOUNDS_US, LAT_COLUMNS, SAMPLE_COLUMNS

#: percentile_approx accuracy: the returned value's rank is within N / ACCURACY of the exact
#: rank (Spark's documented guarantee: relative error 1 / accuracy).
ACCURACY = 10000
QUANTILES = (0.5, 0.9, 0.99, 0.999)
BUCKETS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400)
MAX_POINTS = 240
TOP_N = 20


def regroup(rows: Rows, keys: tuple[str, ...] | list[str], sums: tuple[str, ...] | list[str],
            where: Any = None) -> Rows:
    """Sum ``sums`` of ``rows`` by ``keys`` on the driver (the rows are one collected Spark
    result; regrouping them here costs no Spark job), sorted by the keys' text."""
    acc: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        if where is not None and not where(r):
            continue
        k = tuple(r[x] for x in keys)
        a = acc.get(k)
        if a is None:
            a = acc[k] = dict(zip(keys, k, strict=True))
            a.update((c, 0) for c in sums)
        for c in sums:
            a[c] += r[c] or 0
    return sorted(acc.values(), key=lambda r: tuple(str(r[k]) for k in keys))


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


#: Non-success answers that are a normal part of the protocol, by (role, response code): they
#: are counted and plotted apart from errors.  A client asks the name server for a topic's route
#: before the topic exists (auto-created on the first send); pulls and offset queries of a new
#: consumer find nothing yet.
EXPECTED_ANSWERS: dict[tuple[str, int], str] = {
    ("namesrv", 17): "route query for a topic that does not exist yet (created on the first send)",
    ("broker", 19): "pull found no new message",
    ("broker", 20): "pull to be retried at once",
    ("broker", 22): "no committed offset yet (new consumer group)",
    ("broker", 25): "consumer's subscription newer than the broker's (consumer starting)",
}


def expected_col(role: Any, code: Any) -> Any:
    """A boolean column: (role, response code) is an expected answer, not an error."""
    from pyspark.sql import functions as F

    cond = F.lit(False)
    for r, c in EXPECTED_ANSWERS:
        cond = cond | ((role == r) & (code == c))
    return cond


#: The aggregate tables need these keys of each row kind; other keys are nulled before the one
#: grouping so that it returns no more rows than the tables themselves hold.
AGG_KEYS: dict[str, tuple[str, ...]] = {
    "topic": ("bucket", "role", "topic"),
    "worker": ("bucket", "host", "worker", "role"),
    "request": ("role", "code"),
    "response": ("bucket", "role", "code"),
    "limiter": ("bucket", "topic"),
    "spill": ("bucket", "host", "worker"),
    "latency": ("role", "code", "topic"),
}
AGG_SUMS = ("count", "bytes", "messages", "pulls", "errors", "expected", "limiter_passed", "limiter_rejected",
            "limiter_shaped", "spill_written", "spill_delivered")


# Sampled per-request records -------------------------------------------------------------


def sample_jobs(spark: Any, df: Any, res: Result, method: str = "hist", small: bool = False) -> None:
    """``small``: few input bytes, so the time-keyed table is collected once and regrouped on
    the driver (one Spark job instead of four); otherwise it can hold ~10^5 rows, which are
    cheaper to regroup in Spark from a cached copy than to ship to Python."""
    from pyspark.sql import functions as F

    expected = (F.col("result") == "error") & expected_col(F.col("role"), F.col("resp_code"))
    df = (df.withColumn("w", F.when(F.col("sample_rate") > 0, 1.0 / F.col("sample_rate")).otherwise(1.0))
          .withColumn("result", F.when(expected, F.lit("expected")).otherwise(F.col("result")))
          .withColumn("is_error", (~F.col("result").isin("ok", "expected")).cast("int")))
    if small and method == "hist":
        _sample_jobs_small(df, res)
        return
    ok = ts_ok()
    st = df.agg(F.count(F.lit(1)).alias("n"), F.sum(F.when(ok, 0).otherwise(1)).alias("bad"),
                F.min(F.when(ok, F.col("ts"))).alias("t0"), F.max(F.when(ok, F.col("ts"))).alias("t1"),
                F.sum(F.when(ok, F.col("w"))).alias("est")).collect()[0]
    bad = int(st["bad"] or 0)
    bad_ts_problem(res.problems, bad)
    df = df.where(ok)
    n = int(st["n"]) - bad
    res.counts["sample_records"] = n
    if n == 0:
        res.notes.append("sampled records: none")
        return
    b = bucket_for(float(st["t1"]) - float(st["t0"]))
    res.bucket_s["sample"] = b
    res.counts["sample_estimated_requests"] = int(round(st["est"] or 0))
    df = df.withColumn("bucket", _bucket_col(F.col("ts"), b))
    # scan 1: everything keyed by time (buckets x topics x workers x results x codes), then
    # regrouped into four tables
    keys = ["bucket", "topic", "host", "worker", "result", "code"]
    sums = list(SAMPLE_SUMS)
    base_df = df.groupBy(*keys).agg(F.count(F.lit(1)).alias("records"), F.sum("w").alias("est_requests"),
                                    F.sum(F.col("w") * F.col("req_size")).alias("est_req_bytes"),
                                    F.sum(F.col("w") * F.col("resp_size")).alias("est_resp_bytes"),
                                    F.sum(F.col("w") * F.col("is_error")).alias("est_errors"))
    base = _rows(base_df) if small else None
    if base is None:
        base_df = base_df.cache()

    def table(*ks: str) -> Rows:
        if base is not None:
            rows = regroup(base, ks, sums)
        else:
            rows = sorted(_rows(base_df.groupBy(*ks).agg(*(F.sum(c).alias(c) for c in sums))),
                          key=lambda r: tuple(str(r[k]) for k in ks))
        if "bucket" in ks:
            for r in rows:
                r["req_per_s"] = r["est_requests"] / b
        return rows

    res.tables["sample_throughput_topic"] = table("bucket", "topic")
    res.tables["sample_throughput_worker"] = table("bucket", "host", "worker")
    res.tables["sample_results_over_time"] = table("bucket", "result")
    res.tables["sample_results_by_code"] = table("code", "result")
    if base is None:
        base_df.unpersist()
    # scan 2: clients
    clients = _rows(df.groupBy("client").agg(F.count(F.lit(1)).alias("records"), F.sum("w").alias("est_requests"),
                                             F.sum(F.col("w") * F.col("req_size")).alias("est_req_bytes"),
                                             F.sum(F.col("w") * F.col("is_error")).alias("est_errors")))
    clients.sort(key=lambda r: (-r["est_requests"], str(r["client"])))  # ties: by name
    res.counts["clients"] = len(clients)
    res.tables["sample_top_clients"] = clients[:TOP_N]
    # scan 3: latency
    if method == "approx":
        groups = _latency_approx(spark, df)
    else:
        groups = _latency_hist(df)
    _latency_tables(res, groups)


def _latency_tables(res: Result, groups: dict[str, Rows]) -> None:
    res.tables["latency_by_code_topic"] = sorted(groups["code_topic"], key=lambda r: (r["code"], r["topic"]))
    res.tables["latency_by_code"] = sorted(groups["code"], key=lambda r: r["code"])
    topics = sorted(groups["topic"], key=lambda r: (-r["est_requests"], str(r["topic"])))
    res.tables["latency_by_topic"] = topics
    res.tables["sample_top_topics"] = topics[:TOP_N]
    res.tables["latency_overall"] = groups["all"]


SAMPLE_SUMS = ("records", "est_requests", "est_req_bytes", "est_resp_bytes", "est_errors")


def _sample_jobs_small(df: Any, res: Result) -> None:
    """The sampled-record tables of a small input from one Spark job: one grouping by second
    and every key any table needs (at most one row per record), and the rest on the driver.
    Gives the same tables as the general path (tests/test_report_browser.py compares them)."""
    from pyspark.sql import functions as F

    lbin = F.when(F.col("latency_us") >= 0, F.floor(
        F.log(F.greatest(F.col("latency_us"), F.lit(1)).cast("double")) * LOG_BINS).cast("int"))
    sec = F.when(ts_ok(), F.floor(F.col("ts")).cast("long"))  # null: not a time, left out below
    rows = _rows(df.groupBy(sec.alias("sec"), "topic", "host", "worker", "result",
                            "code", "client", lbin.alias("lbin")).agg(
        F.count(F.lit(1)).alias("records"), F.sum("w").alias("est_requests"),
        F.sum(F.col("w") * F.col("req_size")).alias("est_req_bytes"),
        F.sum(F.col("w") * F.col("resp_size")).alias("est_resp_bytes"),
        F.sum(F.col("w") * F.col("is_error")).alias("est_errors"), F.sum("latency_us").alias("ls"),
        F.max("latency_us").alias("mx"), F.min("latency_us").alias("mn"),
        F.min("ts").alias("t0"), F.max("ts").alias("t1")))
    bad_ts_problem(res.problems, sum(r["records"] for r in rows if r["sec"] is None))
    rows = [r for r in rows if r["sec"] is not None]
    n = sum(r["records"] for r in rows)
    res.counts["sample_records"] = n
    if n == 0:
        res.notes.append("sampled records: none")
        return
    b = bucket_for(float(max(r["t1"] for r in rows)) - float(min(r["t0"] for r in rows)))
    res.bucket_s["sample"] = b
    res.counts["sample_estimated_requests"] = int(round(sum(r["est_requests"] for r in rows)))
    for r in rows:
        r["bucket"] = r["sec"] // b * b  # = floor(ts / b) * b, b being whole seconds

    def table(*ks: str) -> Rows:
        out = regroup(rows, ks, SAMPLE_SUMS)
        if "bucket" in ks:
            for r in out:
                r["req_per_s"] = r["est_requests"] / b
        return out

    res.tables["sample_throughput_topic"] = table("bucket", "topic")
    res.tables["sample_throughput_worker"] = table("bucket", "host", "worker")
    res.tables["sample_results_over_time"] = table("bucket", "result")
    res.tables["sample_results_by_code"] = table("code", "result")
    clients = regroup(rows, ("client",), ("records", "est_requests", "est_req_bytes", "est_errors"))
    clients.sort(key=lambda r: (-r["est_requests"], str(r["client"])))  # ties: by name
    res.counts["clients"] = len(clients)
    res.tables["sample_top_clients"] = clients[:TOP_N]
    bins: dict[tuple[Any, Any, int], dict[str, Any]] = {}
    for r in rows:
        if r["lbin"] is None:
            continue
        a = bins.get((r["code"], r["topic"], r["lbin"]))
        if a is None:
            bins[(r["code"], r["topic"], r["lbin"])] = {
                "code": r["code"], "topic": r["topic"], "lbin": r["lbin"], "n": r["records"], "w": r["est_requests"],
                "e": r["est_errors"], "rb": r["est_req_bytes"], "ls": r["ls"], "mx": r["mx"], "mn": r["mn"]}
        else:
            a["n"] += r["records"]
            a["w"] += r["est_requests"]
            a["e"] += r["est_errors"]
            a["rb"] += r["est_req_bytes"]
            a["ls"] += r["ls"]
            a["mx"] = max(a["mx"], r["mx"])
            a["mn"] = min(a["mn"], r["mn"])
    _latency_tables(res, _hist_groups(list(bins.values())))


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
    return _hist_groups(_rows(lat.groupBy("code", "topic", "lbin").agg(
        F.count(F.lit(1)).alias("n"), F.sum("w").alias("w"), F.sum(F.col("w") * F.col("is_error")).alias("e"),
        F.sum(F.col("w") * F.col("req_size")).alias("rb"), F.sum("latency_us").alias("ls"),
        F.max("latency_us").alias("mx"), F.min("latency_us").alias("mn"))))


def _hist_groups(rows: Rows) -> dict[str, Rows]:
    """Rows keyed (code, topic, lbin) with n, w, e, rb, ls, mx, mn -> the four latency tables."""
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
                     **{f"p{_qname(q)}_us": v for q, v in zip(QUANTILES, qv, strict=True)},
                     mean_us=a["ls"] / a["n"] if a["n"] else None,
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
        d.update({f"p{_qname(qq)}_us": v for qq, v in zip(QUANTILES, q, strict=True)})
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
    """Every aggregate table from one grouping (one Spark job after the span is known), split
    and summed further on the driver: a report over few rows costs few Spark jobs."""
    from pyspark.sql import functions as F

    df = df.fillna(0)
    st = df.agg(F.count(F.lit(1)).alias("n"), F.min("ts").alias("t0"), F.max("ts").alias("t1")).collect()[0]
    n = int(st["n"])
    res.counts["agg_rows"] = n
    if n == 0:
        res.notes.append("aggregate records: none")
        return
    b = bucket_for(float(st["t1"]) - float(st["t0"]))
    res.bucket_s["agg"] = b
    kind = F.col("kind")
    is_expected = (kind == "response") & expected_col(F.col("role"), F.col("code"))
    df = (df.withColumn("bucket", _bucket_col(F.col("ts"), b))
          .withColumn("expected", F.when(is_expected, F.col("count")).otherwise(F.lit(0)).cast("long"))
          .withColumn("errors", F.when(is_expected, F.lit(0)).otherwise(F.col("errors")).cast("long")))
    keyed = [F.when(kind.isin(*[k for k, ks in AGG_KEYS.items() if key in ks]), F.col(key)).alias(key)
             for key in ("bucket", "host", "worker", "role", "topic", "code")]
    rows = _rows(df.groupBy(kind, *keyed).agg(
        *(F.sum(c).alias(c) for c in AGG_SUMS + LAT_COLUMNS),
        F.max_by("spill_backlog", "ts").alias("spill_backlog"),  # a level: the last one in the bucket
        F.max("delivery_lag_ms").alias("delivery_lag_ms")))
    by_kind: dict[str, Rows] = {}
    for r in rows:
        by_kind.setdefault(r["kind"], []).append(r)

    def table(name: str, k: str, keys: tuple[str, ...], sums: tuple[str, ...]) -> Rows:
        out = regroup(by_kind.get(k, []), keys, sums)
        if "bucket" in keys:
            for r in out:
                for c in sums:
                    r[f"{c}_per_s"] = r[c] / b
        res.tables[name] = out
        return out

    table("agg_throughput_topic", "topic", ("bucket", "role", "topic"), ("count", "messages", "pulls", "bytes"))
    table("agg_throughput_worker", "worker", ("bucket", "host", "worker", "role"), ("count", "bytes", "errors"))
    table("agg_requests_by_code", "request", ("role", "code"), ("count", "bytes"))
    table("agg_responses_by_code", "response", ("role", "code"), ("count", "errors", "expected"))
    table("agg_errors_over_time", "response", ("bucket", "role"), ("count", "errors", "expected"))
    table("agg_expected_over_time", "response", ("bucket", "role", "code"), ("expected",))
    res.tables["agg_expected_over_time"] = [r for r in res.tables["agg_expected_over_time"] if r["expected"]]
    totals = regroup(by_kind.get("topic", []), ("topic",), ("count", "messages", "pulls", "bytes"))
    totals.sort(key=lambda r: (-r["messages"], -r["bytes"]))
    res.tables["agg_top_topics"] = [{"topic": r["topic"], "sends": r["count"], "messages": r["messages"],
                                     "pulls": r["pulls"], "bytes": r["bytes"]} for r in totals[:TOP_N]]
    table("agg_limiter_over_time", "limiter", ("bucket", "topic"),
          ("limiter_passed", "limiter_rejected", "limiter_shaped"))
    # spill: levels, not deltas -> the last level of each worker in the bucket, summed over workers
    spill: dict[int, dict[str, Any]] = {}
    for r in by_kind.get("spill", []):
        a = spill.setdefault(r["bucket"], {"bucket": r["bucket"], "spill_backlog": 0, "delivery_lag_ms": 0,
                                           "spill_written": 0, "spill_delivered": 0})
        a["spill_backlog"] += r["spill_backlog"] or 0
        a["delivery_lag_ms"] = max(a["delivery_lag_ms"], r["delivery_lag_ms"] or 0)
        a["spill_written"] += r["spill_written"] or 0
        a["spill_delivered"] += r["spill_delivered"] or 0
    res.tables["agg_spill_over_time"] = [spill[k] for k in sorted(spill)]
    out = []
    for r in regroup(by_kind.get("latency", []), ("role", "code", "topic"), LAT_COLUMNS):
        hb = [int(r[c]) for c in LAT_COLUMNS]
        out.append({"role": r["role"], "code": r["code"], "topic": r["topic"], "count": sum(hb),
                    **{f"p{_qname(q)}_us": hist_quantile(hb, q) for q in QUANTILES}})
    res.tables["agg_latency_hist"] = sorted(out, key=lambda r: (r["role"], r["code"], r["topic"]))


def _qname(q: float) -> str:
    s = f"{q * 100:g}"
    return s.replace(".", "")


# All of it -----------------------------------------------------------------------------------


def run_all(spark: Any, inputs: Inputs, percentiles: str = "hist", small: bool | None = None) -> Result:
    """Every job over ``inputs``; ``small`` (default: the local inputs' size is at most
    SMALL_INPUT_BYTES) lets jobs trade Spark jobs for work on the driver."""
    if small is None:
        from rmqfast.analytics.spark import SMALL_INPUT_BYTES

        small = 0 < inputs.total_bytes <= SMALL_INPUT_BYTES
    res = Result()
    res.problems.extend(inputs.problems())
    res.counts.update(agg_files=len(inputs.agg), sample_files=len(inputs.sample), bench_files=len(inputs.bench))
    if inputs.sample:
        df = _read(spark, inputs.sample, SAMPLE_COLUMNS, res, "sample")
        sample_jobs(spark, df, res, percentiles, small)
    if inputs.agg:
        df = _read(spark, inputs.agg, AGG_COLUMNS, res, "aggregate")
        agg_jobs(spark, df, res)
    if inputs.bench:
        bench_jobs(spark, inputs.bench, res)
    return res
