"""The worker's traffic recorder: per-second aggregates and sampled per-request records.

Worker side usage (see ``rmqfast/server/worker.py``)::

    rec = TrafficRecorder(cfg.records, worker_index)
    deltas = [StatsDelta("namesrv", stats_ns), StatsDelta("broker", stats_br)]
    ...
    # once a second, on the publish tick:
    rec.add_aggregates([row for d in deltas for row in d.take()])
    ...
    # per request, where latency is known (relay):
    if rec.want_sample():
        rec.sample(role="broker", client="10.0.0.7:51234", code=310, topic="T", tag="",
                   req_size=1200, resp_size=180, latency_us=412, resp_code=0, result="ok")
    ...
    rec.close()   # on drain

Nothing here blocks: rows are appended to lists; encoding and file I/O happen in one
background thread per stream (:class:`rmqfast.records.writer.RotatingWriter`).
"""

from __future__ import annotations

import math
import random
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rmqfast.codec import slot_code
from rmqfast.config import RecordsSection
from rmqfast.records.schema import (
    AGG_COLUMNS,
    AGG_VERSION,
    LAT_COLUMNS,
    OTHER_CODE,
    SAMPLE_COLUMNS,
    SAMPLE_VERSION,
    AggRow,
    agg_tuple,
    lat_bucket,
    schema_tag,
)
from rmqfast.records.writer import RotatingWriter


def _code(slot: int) -> int:
    c = slot_code(slot)
    return OTHER_CODE if c is None else c


class StatsDelta:
    """Aggregate rows for what a :class:`rmqfast.codec.ScanStats` counted since the last call.

    Reads the same cumulative counters as :class:`rmqfast.metrics.StatsPublisher`, with its
    own baseline, so the two never interfere.
    """

    def __init__(self, role: str, stats: Any) -> None:
        self.role = role
        self.stats = stats
        self._req: dict[int, tuple[int, int]] = {}
        self._resp: dict[int, int] = {}
        self._topics: dict[bytes, tuple[int, int, int, int]] = {}
        self._lat: dict[int, tuple[int, ...]] = {}
        self._frames = 0
        self._bytes = 0
        self._errors = 0

    def take(self) -> list[AggRow]:
        st, role = self.stats, self.role
        rows: list[AggRow] = []
        for slot, count, nbytes in st.requests():
            c0, b0 = self._req.get(slot, (0, 0))
            if count != c0:
                rows.append(AggRow("request", role, _code(slot), count=count - c0, bytes=nbytes - b0))
                self._req[slot] = (count, nbytes)
        for slot, count in st.responses():
            c0 = self._resp.get(slot, 0)
            if count != c0:
                code = _code(slot)
                rows.append(AggRow("response", role, code, count=count - c0, errors=0 if code == 0 else count - c0))
                self._resp[slot] = count
        for topic, sends, msgs, pulls, nbytes in st.topics():
            old = self._topics.get(topic, (0, 0, 0, 0))
            new = (sends, msgs, pulls, nbytes)
            if new != old:
                rows.append(AggRow("topic", role, topic=topic.decode("utf-8", "replace"), count=sends - old[0],
                                   messages=msgs - old[1], pulls=pulls - old[2], bytes=nbytes - old[3]))
                self._topics[topic] = new
        for slot, buckets, _sum_ns in st.latencies():  # timed in C by the scanners (request -> response)
            old = self._lat.get(slot)
            delta = buckets if old is None else tuple(b - a for a, b in zip(old, buckets, strict=True))
            if any(delta):
                rows.append(AggRow("latency", role, _code(slot), count=sum(delta), lat=delta))
                self._lat[slot] = buckets
        frames, nbytes, errors = st.frames, st.bytes, st.protocol_errors
        if (frames, nbytes, errors) != (self._frames, self._bytes, self._errors):
            rows.append(AggRow("worker", role, count=frames - self._frames, bytes=nbytes - self._bytes,
                               errors=errors - self._errors))
            self._frames, self._bytes, self._errors = frames, nbytes, errors
        return rows


class _Sampler:
    """Bernoulli sampling at ``rate`` without a random draw per request: the gap to the next
    sampled request is drawn from the geometric distribution (same law, no aliasing with
    periodic traffic)."""

    def __init__(self, rate: float, rng: random.Random | None = None) -> None:
        self.rate = rate
        self.rng = rng or random.Random()
        self._log1p = math.log1p(-rate) if 0 < rate < 1 else 0.0
        self.left = self._gap()

    def _gap(self) -> int:
        if self.rate >= 1:
            return 1
        if self.rate <= 0:
            return 1 << 62
        u = 1.0 - self.rng.random()  # (0, 1]
        return int(math.log(u) / self._log1p) + 1


class TrafficRecorder:
    """Writes one worker's traffic records under ``section.dir`` (``agg/`` and ``sample/``).

    ``host`` defaults to the machine's host name; it and ``worker_index`` go into every row
    and every file name, so many proxies can share one directory (e.g. on HDFS or S3 via a
    sync job).
    """

    def __init__(self, section: RecordsSection, worker_index: int, *, host: str | None = None,
                 rng: random.Random | None = None) -> None:
        self.section = section
        self.worker = worker_index
        self.host = host or socket.gethostname()
        self.sample_rate = section.sample_rate
        self._sampler = _Sampler(section.sample_rate, rng)
        self._last_tick = time.time()
        self._lat: dict[tuple[str, int, str], list[int]] = {}
        base = Path(section.dir)
        safe_host = "".join(ch if ch.isalnum() or ch in "-." else "_" for ch in self.host)
        common: dict[str, Any] = dict(fmt=section.format, rotate_seconds=section.rotate_seconds,
                                      rotate_bytes=section.rotate_bytes)
        self.agg = RotatingWriter(base / "agg", f"agg-v{AGG_VERSION}-{safe_host}-w{worker_index}", AGG_COLUMNS,
                                  metadata={"rmqfast.schema": schema_tag("agg")}, **common)
        self.samples: RotatingWriter | None = None
        if section.sample_rate > 0:
            self.samples = RotatingWriter(
                base / "sample", f"sample-v{SAMPLE_VERSION}-{safe_host}-w{worker_index}", SAMPLE_COLUMNS,
                metadata={"rmqfast.schema": schema_tag("sample")}, **common,
            )

    # Per request ------------------------------------------------------------------------

    def want_sample(self) -> bool:
        """True for a random ``sample_rate`` share of the calls (one per request)."""
        s = self._sampler
        s.left -= 1
        if s.left > 0:
            return False
        s.left = s._gap()
        return self.samples is not None

    def sample(self, *, role: str, client: str, code: int, topic: str = "", tag: str = "", req_size: int = 0,
               resp_size: int = 0, latency_us: int = -1, resp_code: int = -1, result: str = "ok",
               ts: float | None = None) -> None:
        """Record one sampled request (call it when :meth:`want_sample` said so)."""
        if self.samples is None:
            return
        self.samples.add((SAMPLE_VERSION, time.time() if ts is None else ts, self.host, self.worker, role, client,
                          code, topic, tag, req_size, resp_size, latency_us, resp_code, result, self.sample_rate))

    def latency(self, role: str, code: int, topic: str, latency_us: int) -> None:
        """Count one request's latency into this second's histogram for (role, code, topic)."""
        key = (role, code, topic)
        h = self._lat.get(key)
        if h is None:
            h = self._lat[key] = [0] * len(LAT_COLUMNS)
        h[lat_bucket(latency_us)] += 1

    # Once a second ----------------------------------------------------------------------

    def add_aggregates(self, rows: Iterable[AggRow], now: float | None = None) -> None:
        """Write this interval's aggregate rows (plus the latency histograms collected by
        :meth:`latency`), then let the writers rotate if due."""
        now = time.time() if now is None else now
        interval_ms = max(0, int(round((now - self._last_tick) * 1000)))
        self._last_tick = now
        ts = int(now)
        add, host, w = self.agg.add, self.host, self.worker
        for row in rows:
            add(agg_tuple(row, AGG_VERSION, ts, interval_ms, host, w))
        if self._lat:
            lat, self._lat = self._lat, {}
            for (role, code, topic), h in lat.items():
                add(agg_tuple(AggRow("latency", role, code, topic, count=sum(h), lat=tuple(h)),
                              AGG_VERSION, ts, interval_ms, host, w))
        self.tick()

    def tick(self) -> None:
        self.agg.tick()
        if self.samples is not None:
            self.samples.tick()

    def close(self) -> None:
        """Write everything buffered and close (rename) the open files."""
        self.agg.close()
        if self.samples is not None:
            self.samples.close()

    @property
    def files_written(self) -> list[Path]:
        out = list(self.agg.files_written)
        if self.samples is not None:
            out += self.samples.files_written
        return out

    @property
    def dropped(self) -> int:
        return self.agg.dropped + (self.samples.dropped if self.samples is not None else 0)
