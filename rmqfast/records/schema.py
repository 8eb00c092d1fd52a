"""The traffic record schemas (documented in docs/records.md).

Two record kinds, each in its own sub-directory of ``records.dir``:

* ``agg/``: per-second aggregates, one row per (second, worker, role, kind, code, topic).
* ``sample/``: sampled per-request records.

Versioning: every row carries ``v`` (the schema version it was written with), every Parquet
file carries ``rmqfast.schema`` = ``rmqfast-records/<kind>/<v>`` in its key/value metadata,
and file names contain ``v<N>``.  Within one major version columns are only ever *added*
(at the end); readers use the newest column list and treat columns a file lacks as 0/empty.
A change that removes or redefines a column bumps the version.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from rmqfast.codec import LATENCY_BOUNDS_NS
from rmqfast.records.parquet import Column

AGG_VERSION = 1
SAMPLE_VERSION = 1

#: Upper bounds (microseconds, inclusive) of the latency histogram buckets; the last bucket
#: (``lat_le_inf``) counts everything above the last bound.  The same buckets as the scanner's C
#: counters (rmqfast.codec.LATENCY_BOUNDS_NS) and the Prometheus histogram, so that the workers'
#: per-second latency rows are those counters' deltas.
LAT_BOUNDS_US: tuple[int, ...] = tuple(b // 1000 for b in LATENCY_BOUNDS_NS)
LAT_COLUMNS: tuple[str, ...] = tuple(f"lat_le_{b}" for b in LAT_BOUNDS_US) + ("lat_le_inf",)

#: ``code`` value of aggregate rows without a code (topic, worker, limiter, spill rows).
NO_CODE = -1
#: ``code`` value of the scanner's shared slot for codes outside its tables.
OTHER_CODE = -2

#: Aggregate row kinds.
AGG_KINDS = ("request", "response", "topic", "worker", "latency", "limiter", "spill")

#: ``result`` values of sampled records.
RESULTS = ("ok", "error", "denied", "limited", "shaped", "closed", "timeout")


@dataclass(slots=True)
class AggRow:
    """One per-second aggregate row (all counts are deltas over the interval, except
    ``spill_backlog`` and ``delivery_lag_ms`` which are levels at the end of it)."""

    kind: str
    role: str = ""
    code: int = NO_CODE
    topic: str = ""
    count: int = 0
    bytes: int = 0
    messages: int = 0
    pulls: int = 0
    errors: int = 0
    lat: tuple[int, ...] | None = None  # len(LAT_COLUMNS) bucket counts
    limiter_passed: int = 0
    limiter_rejected: int = 0
    limiter_shaped: int = 0
    spill_written: int = 0
    spill_delivered: int = 0
    spill_backlog: int = 0
    delivery_lag_ms: int = 0


_AGG_TAIL = [f.name for f in fields(AggRow) if f.name not in ("kind", "role", "code", "topic", "lat")]

AGG_COLUMNS: tuple[Column, ...] = (
    Column("v", "int32"),
    Column("ts", "int64"),  # epoch second at which the interval ends
    Column("interval_ms", "int32"),
    Column("host", "string"),
    Column("worker", "int32"),
    Column("role", "string"),
    Column("kind", "string"),
    Column("code", "int32"),
    Column("topic", "string"),
    *(Column(n, "int64") for n in _AGG_TAIL[:5]),  # count bytes messages pulls errors
    *(Column(n, "int64") for n in LAT_COLUMNS),
    *(Column(n, "int64") for n in _AGG_TAIL[5:]),  # limiter_*, spill_*, delivery_lag_ms
)

SAMPLE_COLUMNS: tuple[Column, ...] = (
    Column("v", "int32"),
    Column("ts", "double"),  # epoch seconds when the request arrived
    Column("host", "string"),
    Column("worker", "int32"),
    Column("role", "string"),
    Column("client", "string"),  # "ip:port"
    Column("code", "int32"),  # request code
    Column("topic", "string"),
    Column("tag", "string"),
    Column("req_size", "int64"),
    Column("resp_size", "int64"),
    Column("latency_us", "int64"),  # -1: no response (oneway, closed)
    Column("resp_code", "int32"),  # -1: no response
    Column("result", "string"),  # one of RESULTS
    Column("sample_rate", "double"),  # weight of this record is 1 / sample_rate
)


def agg_tuple(row: AggRow, v: int, ts: int, interval_ms: int, host: str, worker: int) -> tuple:
    lat = row.lat if row.lat is not None else _ZERO_LAT
    return (
        v, ts, interval_ms, host, worker, row.role, row.kind, row.code, row.topic,
        row.count, row.bytes, row.messages, row.pulls, row.errors, *lat,
        row.limiter_passed, row.limiter_rejected, row.limiter_shaped, row.spill_written,
        row.spill_delivered, row.spill_backlog, row.delivery_lag_ms,
    )


_ZERO_LAT = (0,) * len(LAT_COLUMNS)


def lat_bucket(latency_us: int) -> int:
    """Index of the histogram bucket for one latency."""
    for i, b in enumerate(LAT_BOUNDS_US):
        if latency_us <= b:
            return i
    return len(LAT_BOUNDS_US)


def schema_tag(kind: str) -> str:
    return f"rmqfast-records/{kind}/{AGG_VERSION if kind == 'agg' else SAMPLE_VERSION}"
