"""Synthetic traffic records at a realistic shape (scale benchmark and tests).

Written with the same Parquet writer and schema the workers use, into the same layout
(``sample/`` and ``agg/``), so reading them costs what reading real records costs.

Shape: a span of ``span_s`` seconds; ``hosts`` x ``workers`` writers; 300 clients; 50 topics
with Zipf-like popularity; request codes SEND_MESSAGE_V2 310 (60%), PULL_MESSAGE 11 (25%),
SEND_BATCH 320 (5%), HEART_BEAT 34 (6%), GET_ROUTEINFO 105 (2%), others; log-normal sizes
and latencies per code (pulls: 30% held by long polling for up to 15 s); 0.4% errors, 0.3%
rate-limited, a few closed connections.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rmqfast.records.parquet import write_table
from rmqfast.records.schema import AGG_COLUMNS, LAT_COLUMNS, SAMPLE_COLUMNS, SAMPLE_VERSION, schema_tag

CODES = (310, 11, 320, 34, 105, 41, 36)
CODE_P = (0.60, 0.25, 0.05, 0.06, 0.02, 0.01, 0.01)
TOPICS = tuple(f"Topic{i:03d}" for i in range(50))
TAGS = ("", "TagA", "TagB", "TagC", "order")


def sample_columns(n: int, seed: int = 1, t0: float = 1.7e9, span_s: float = 3600.0, hosts: int = 2,
                   workers: int = 2, sample_rate: float = 1.0) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    zipf = 1.0 / np.arange(1, len(TOPICS) + 1)
    zipf /= zipf.sum()
    code = rng.choice(np.array(CODES, dtype=np.int32), n, p=np.array(CODE_P) / sum(CODE_P))
    is_pull = code == 11
    is_send = (code == 310) | (code == 320)
    topic_idx = rng.choice(len(TOPICS), n, p=zipf)
    topics = np.array(TOPICS, dtype=object)[topic_idx]
    topics[(code == 34) | (code == 41)] = ""
    lat = rng.lognormal(np.log(350), 0.7, n)
    lat[code == 320] *= 2.5
    held = is_pull & (rng.random(n) < 0.3)
    lat[held] = rng.uniform(1e5, 1.5e7, int(held.sum()))
    u = rng.random(n)
    result = np.where(u < 0.004, "error", np.where(u < 0.007, "limited", np.where(u < 0.0075, "closed", "ok")))
    resp_code = np.where(result == "ok", 0, np.where(result == "error", 1, np.where(result == "limited", 2, -1)))
    lat_us = lat.astype(np.int64)
    lat_us[result == "closed"] = -1
    req = np.where(is_send, rng.lognormal(np.log(1100), 0.6, n), rng.lognormal(np.log(300), 0.3, n))
    resp = np.where(is_pull & ~held, rng.lognormal(np.log(16000), 0.8, n), rng.lognormal(np.log(200), 0.3, n))
    client_idx = rng.integers(0, 300, n)
    clients = np.array([f"10.1.{i // 200}.{i % 200 + 10}:{40000 + i * 7}" for i in range(300)], dtype=object)
    w = rng.integers(0, hosts * workers, n)
    ts = t0 + np.sort(rng.uniform(0, span_s, n))
    tags = np.array(TAGS, dtype=object)[rng.integers(0, len(TAGS), n)]
    tags[~is_send] = ""
    return {
        "v": np.full(n, SAMPLE_VERSION, dtype=np.int32),
        "ts": ts,
        "host": np.array([f"proxy-{i}" for i in range(hosts)], dtype=object)[w // workers].tolist(),
        "worker": (w % workers).astype(np.int32),
        "role": np.where(code == 105, "namesrv", "broker").astype(object).tolist(),
        "client": clients[client_idx].tolist(),
        "code": code,
        "topic": topics.tolist(),
        "tag": tags.tolist(),
        "req_size": req.astype(np.int64),
        "resp_size": np.where(result == "closed", 0, resp).astype(np.int64),
        "latency_us": lat_us,
        "resp_code": resp_code.astype(np.int32),
        "result": result.astype(object).tolist(),
        "sample_rate": np.full(n, sample_rate),
    }


def write_samples(out: str | os.PathLike[str], total: int, *, per_file: int = 1_000_000, seed: int = 1,
                  span_s: float = 3600.0, t0: float = 1.7e9, codec: str = "gzip") -> list[Path]:
    """``total`` sampled records in files of ``per_file`` under ``out/sample/``."""
    d = Path(out) / "sample"
    d.mkdir(parents=True, exist_ok=True)
    files = []
    nfiles = max(1, -(-total // per_file))
    for i in range(nfiles):
        n = min(per_file, total - i * per_file)
        cols = sample_columns(n, seed=seed + i, t0=t0 + i * span_s / nfiles, span_s=span_s / nfiles)
        p = d / f"sample-v{SAMPLE_VERSION}-synth-w{i % 2}-{i:05d}.parquet"
        write_table(p, SAMPLE_COLUMNS, cols, codec=codec, metadata={"rmqfast.schema": schema_tag("sample")})
        files.append(p)
    return files


def write_aggregates(out: str | os.PathLike[str], *, span_s: int = 3600, t0: int = 1_700_000_000, hosts: int = 2,
                     workers: int = 2, seed: int = 2, codec: str = "gzip") -> list[Path]:
    """Per-second aggregate rows for every worker over ``span_s`` seconds (topic, request,
    response, worker, latency, limiter and spill rows)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    d = Path(out) / "agg"
    d.mkdir(parents=True, exist_ok=True)
    files = []
    names = [c.name for c in AGG_COLUMNS]
    for h in range(hosts):
        for wk in range(workers):
            rows: dict[str, list[Any]] = {n: [] for n in names}
            add = _adder(rows, names, f"proxy-{h}", wk)
            for s in range(span_s):
                ts = t0 + s
                load = 1.0 + 0.5 * np.sin(s / 600.0)
                for ti, topic in enumerate(TOPICS[:10]):
                    m = int(rng.poisson(200 * load / (ti + 1)))
                    add(ts, "topic", topic=topic, count=m, messages=m, bytes=m * 1100)
                    if ti < 2:
                        add(ts, "limiter", topic=topic, limiter_passed=m, limiter_rejected=int(rng.poisson(2)),
                            limiter_shaped=int(rng.poisson(1)))
                sends = int(rng.poisson(600 * load))
                add(ts, "request", code=310, count=sends, bytes=sends * 1200)
                add(ts, "response", code=0, count=sends)
                add(ts, "response", code=2, count=int(rng.poisson(1)), errors=int(rng.poisson(1)))
                add(ts, "worker", count=2 * sends, bytes=sends * 1400)
                hist = rng.multinomial(sends, [0.05, 0.2, 0.4, 0.2, 0.1, 0.03, 0.01, 0.005, 0.005]
                                       + [0] * (len(LAT_COLUMNS) - 9))
                lat = dict(zip(LAT_COLUMNS, hist.tolist(), strict=True))
                add(ts, "latency", code=310, topic="", count=sends, **lat)
                add(ts, "spill", spill_written=int(rng.poisson(5)), spill_delivered=int(rng.poisson(5)),
                    spill_backlog=int(100 + 50 * np.sin(s / 300.0)), delivery_lag_ms=int(rng.uniform(5, 50)))
            p = d / f"agg-v1-proxy-{h}-w{wk}-synth.parquet"
            write_table(p, AGG_COLUMNS, rows, codec=codec, metadata={"rmqfast.schema": schema_tag("agg")})
            files.append(p)
    return files


def _adder(rows: dict[str, list[Any]], names: list[str], host: str, worker: int) -> Any:
    def add(ts: int, kind: str, role: str = "broker", code: int = -1, topic: str = "", **vals: int) -> None:
        base = {"v": 1, "ts": ts, "interval_ms": 1000, "host": host, "worker": worker, "role": role,
                "kind": kind, "code": code, "topic": topic}
        for n in names:
            rows[n].append(base.get(n, vals.get(n, 0)))

    return add
